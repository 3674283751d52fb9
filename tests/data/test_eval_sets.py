"""eval.sets: extra validation sets, each reported as eval_loss/<name> next to the primary eval_loss."""

import json
import math
import os
from pathlib import Path

import jax
import pytest

from jaxtrain import config as config_lib
from jaxtrain.data import pipeline, prepare
from jaxtrain import trainer as trainer_lib

TEXTS = [
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 6,
    "The quick brown fox jumps over the lazy dog while the compiler fuses every matmul. " * 6,
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date. " * 6,
]


@pytest.fixture(scope="module")
def eval_dirs(tiny_data_dir, tmp_path_factory):
    """(a dir prepared with tiny_data_dir's tokenizer, one with a tokenizer of its own), from other text."""
    root = tmp_path_factory.mktemp("eval_sets")
    files = []
    for i, text in enumerate(TEXTS):
        files.append(str(root / f"doc{i}.txt"))
        Path(files[-1]).write_text(text)
    same_tokenizer = str(root / "verse")
    prepare.prepare_sources(same_tokenizer, files, tokenizer=os.path.join(tiny_data_dir, "tokenizer.json"),
                            heldout_docs=1)
    own_tokenizer = str(root / "foreign")
    prepare.prepare_sources(own_tokenizer, files, vocab_size=300, heldout_docs=1)
    return same_tokenizer, own_tokenizer


def test_each_eval_set_reports_its_heldout_loss(tiny_config, tiny_data_dir, eval_dirs):
    from helpers import read_jsonl

    from jaxtrain import train

    verse = eval_dirs[0]
    # "self" is data.dir itself: its loss must be eval_loss, bit for bit.
    cfg = tiny_config(**{"train.steps": 4, "eval.every_steps": 2, "checkpoint.every_steps": 4,
                         "eval.sets": f"self={tiny_data_dir}, verse={verse}"})
    lines = []
    summary = train.run(cfg, print_fn=lines.append)

    evals, sets = summary["eval"], summary["eval_sets"]
    assert [s for s, _ in evals] == [0, 2, 4]
    assert sets["self"] == evals
    assert [s for s, _ in sets["verse"]] == [0, 2, 4]
    for (_, primary), (_, other) in zip(evals, sets["verse"]):
        assert math.isfinite(other) and other != primary

    # The number is the model's loss on that dir's held-out split: recompute it from the final params.
    facts = config_lib.validate(cfg, jax.device_count())
    trainer = trainer_lib.build_trainer(cfg, facts)
    batches = pipeline.eval_batches(verse, seq_len=cfg.train.seq_len, global_batch=cfg.train.batch_size,
                                    num_batches=cfg.eval.batches)
    assert trainer.evaluate(summary["state"]["params"], batches) == sets["verse"][-1][1]

    # Printed line, metrics.jsonl, summary.json and TensorBoard all carry them.
    workdir = Path(cfg.workdir)
    assert f"eval @ step 4: eval_loss {evals[-1][1]:.4f} | eval_loss/self {evals[-1][1]:.4f} | " \
           f"eval_loss/verse {sets['verse'][-1][1]:.4f}" in lines
    records = [r for r in read_jsonl(workdir / "metrics.jsonl") if "eval_loss" in r]
    assert [(r["step"], r["eval_loss"]) for r in records] == evals
    assert [(r["step"], r["eval_loss/self"]) for r in records] == evals
    assert [(r["step"], r["eval_loss/verse"]) for r in records] == sets["verse"]
    saved = json.loads((workdir / "summary.json").read_text())
    assert saved["eval"] == [list(e) for e in evals]
    assert saved["eval_sets"] == {name: [list(e) for e in history] for name, history in sets.items()}
    events = b"".join(p.read_bytes() for p in (workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert b"eval_loss/verse" in events and b"eval_loss/self" in events


@pytest.mark.parametrize("spec, reason", [
    ("verse", "is not <name>=<data dir>"),
    ("=/data/verse", "is not <name>=<data dir>"),
    ("verse=", "is not <name>=<data dir>"),
    ("my set=/data/verse", "is not <name>=<data dir>"),
    ("a/b=/data/verse", "is not <name>=<data dir>"),
    ("verse=/data/a,verse=/data/b", "name 'verse' is used twice"),
    (" , ", "has no <name>=<data dir> entry"),
])
def test_bad_specs_are_refused_at_validation(tiny_config, spec, reason):
    with pytest.raises(config_lib.ConfigError, match=reason) as e:
        config_lib.validate(tiny_config(**{"eval.sets": spec}), jax.device_count())
    assert e.value.field == "eval.sets" and "\n" not in str(e.value)
    assert pipeline.parse_eval_sets("a.b-1_c=/x/y=z, q=gs://b/d") == [("a.b-1_c", "/x/y=z"), ("q", "gs://b/d")]


@pytest.mark.parametrize("which", ["syntax", "missing dir", "other tokenizer"])
def test_the_cli_exits_2_naming_the_eval_set(tiny_config, tmp_path, eval_dirs, capsys, which):
    from jaxtrain import main

    spec = {"syntax": "verse:/data/verse", "missing dir": f"gone={tmp_path / 'gone'}",
            "other tokenizer": f"foreign={eval_dirs[1]}"}[which]
    expected = {"syntax": "error: eval.sets: 'verse:/data/verse' is not <name>=<data dir>",
                "missing dir": f"error: eval.sets: 'gone': {tmp_path / 'gone'}: data dir does not exist",
                "other tokenizer": f"error: eval.sets: 'foreign': {eval_dirs[1]}: tokenized with another tokenizer"}
    cfg = tiny_config(**{"eval.sets": spec})
    assert main.run(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected[which]) and err.count("\n") == 1, err
    assert not Path(cfg.workdir).exists()  # refused before the workdir is created
