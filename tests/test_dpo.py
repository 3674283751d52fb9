"""DPO as a run: on 8 devices with gradient accumulation, or a pipeline with a split sequence, it equals one device
(the reference an explicit frozen copy, or under LoRA the base with adapters off); it resumes bit-exactly with the reference unchanged; and after
SFT on answers that are half copies, half reversals, DPO preferring the copies reaches >90% held-out preference
accuracy and moves greedy answers to the copies. Sweeps and reports take DPO runs like any other."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import chat_tokenizer_dir, step_history, train_on_stream, trainer_on

from jaxtrain import config as config_lib
from jaxtrain import train
from jaxtrain import trainer as trainer_lib
from jaxtrain.config import base_config
from jaxtrain.data import chat, layout, prepare
from jaxtrain.models import lora as lora_lib
from jaxtrain.models import sampling
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.tools import hf as hf_cli
from jaxtrain.tools import report, sweep

WORDS = "red green blue cat dog sun moon tree fish bird king star rain wind fire stone".split()
QUIET = {"print_fn": lambda *a, **k: None}


def _message(role, words):
    return {"role": role, "content": " ".join(words)}


def _prepare(path, hf, records, **kw):
    (path.parent / f"{path.name}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    prepare.prepare_sources(str(path), [str(path.parent / f"{path.name}.jsonl")], field="*", tokenizer=str(hf),
                            heldout_docs=50, workers=1, **kw, **QUIET)
    return str(path)


def _pairs(words):
    """Preference pairs of the copy task: the copy is chosen over the reversal."""
    return [{"prompt": " ".join(w), "chosen": " ".join(w), "rejected": " ".join(w[::-1])} for w in words]


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rng = np.random.default_rng(0)
    words = [list(rng.choice(WORDS, 4)) for _ in range(200)]
    return _prepare(root / "pairs", chat_tokenizer_dir(root / "hf", WORDS), _pairs(words), preference=True,
                    max_len=128)


def _dpo(tiny_config, data, **overrides):
    return tiny_config(**{"data.dir": data, "train.seq_len": 128, "train.objective": "dpo", "dpo.beta": 0.5,
                          **overrides})


MESHES = {"reference_copy": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": 2},
          "lora": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "train.microbatches": 2, "model.lora_rank": 4},
          "pipeline_sequence": {"mesh.data": 2, "mesh.pipeline": 2, "mesh.sequence": 2, "pipeline.stages": 2,
                                "pipeline.microbatches": 2}}


@pytest.fixture(scope="module")
def one_device(tiny_config, pairs_data):
    """(trainer, train_on_stream's 3 steps) on one device, by whether LoRA's on: built and run once for the two
    meshes whose reference is a frozen copy."""
    made = {}

    def get(adapters):
        if adapters not in made:
            lora = {"model.lora_rank": 4} if adapters else {}
            one = trainer_on(_dpo(tiny_config, pairs_data, **lora), {"data": 1, "fsdp": 1, "tensor": 1},
                             mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1])
            made[adapters] = one, train_on_stream(one, pairs_data, 3, seq_len=128)
        return made[adapters]

    return get


@pytest.mark.parametrize("mesh", MESHES)
def test_dpo_on_eight_devices_equals_one_device(one_device, tiny_config, pairs_data, mesh):
    """data x fsdp x tensor with gradient accumulation (the reference a frozen copy, or LoRA's), and a
    pipeline with the sequence split."""
    settings = MESHES[mesh]
    adapters = "model.lora_rank" in settings
    cfg = _dpo(tiny_config, pairs_data, **settings)
    one, (before, after, history) = one_device(adapters)
    # The frozen reference: a copy of every weight, or under LoRA of the (fresh: B = 0) adapters over the base.
    copied = [str(p[-1].key) for p, _ in jax.tree_util.tree_leaves_with_path(one.abstract_state["reference"])]
    assert copied and all(lora_lib.is_adapter(k) for k in copied) == adapters
    facts = config_lib.validate(cfg, 8)
    eight = trainer_lib.build_trainer(cfg, facts)
    # The policy starts as the reference: every margin is 0, held out and in the first step.
    assert before == pytest.approx(np.log(2), rel=1e-6) and history[0, 0] == pytest.approx(np.log(2), rel=1e-6)
    assert after != before
    np.testing.assert_allclose(step_history(eight, pairs_data, 3, seq_len=128), history, rtol=1e-5, atol=1e-7)


def test_dpo_resumes_bit_exactly_with_the_reference_unchanged(tiny_config, pairs_data):
    # The first run saves where it stops (2); the straight run saves only at its end (a save costs compiles).
    run = {"train.steps": 4, "checkpoint.every_steps": 4, "eval.every_steps": 2}
    straight = train.run(_dpo(tiny_config, pairs_data, **run), **QUIET)
    first = _dpo(tiny_config, pairs_data, **run, **{"train.stop_at": 2})
    assert train.run(first, **QUIET)["step"] == 2
    resumed = train.run(_dpo(tiny_config, pairs_data, workdir=first.workdir, **run), **QUIET)
    assert resumed["resumed"] and resumed["state_checksum"] == straight["state_checksum"]
    assert resumed["eval"] == straight["eval"]
    # The reference is the weights the run started from, bit for bit, after training and a restore.
    cfg = _dpo(tiny_config, pairs_data, **run)
    facts = config_lib.validate(cfg, 1)
    one = trainer_lib.build_trainer(cfg, facts, devices=jax.devices()[:1])
    start = one.init()["params"]
    for a, b in zip(jax.tree.leaves(resumed["state"]["reference"]), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(resumed["state"]["params"]),
                                                        jax.tree.leaves(start)))


def test_a_sweep_and_a_report_over_dpo_runs_with_lora(tiny_config, pairs_data, tmp_path):
    """A grid over dpo.beta: each trial's objective is its last eval_loss (the mean pair loss), and the report
    draws the preference accuracy and margin beside the losses."""
    config = _dpo(tiny_config, pairs_data, **{"train.steps": 2, "eval.every_steps": 2, "checkpoint.every_steps": 2,
                                              "log.every_steps": 1, "model.lora_rank": 4, "model.n_layers": 1,
                                              "optim.lr": 1e-2, "optim.warmup_steps": 0})
    results = sweep.run(config, {"space": {"dpo.beta": [0.1, 1.0]}, "sampler": "grid", "name": "dpo"},
                        tmp_path / "sweep", print_fn=lambda *a, **k: None)
    rows = results["rows"]
    assert sorted(r["dpo.beta"] for r in rows) == [0.1, 1.0] and {r["state"] for r in rows} == {"complete"}
    for r in rows:
        records = [json.loads(line) for line in (Path(r["workdir"]) / "metrics.jsonl").read_text().splitlines()]
        assert r["objective"] == [x["eval_loss"] for x in records if "eval_loss" in x][-1]
        assert json.loads((Path(r["workdir"]) / "config.json").read_text())["dpo"]["beta"] == r["dpo.beta"]
    assert rows[0]["objective"] != rows[1]["objective"]  # beta scales the margins
    written = report.write_report([r["workdir"] for r in rows], tmp_path / "report")
    assert {"dpo/accuracy", "dpo/margin", "loss", "eval_loss"} <= set(written["paths"])
    assert written["paths"]["dpo/accuracy"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [row["steps"] for row in written["rows"]] == [2, 2]


def _config(workdir, data, steps, seq_len, **groups):
    c = base_config()
    c.workdir = str(workdir)
    c.model.update(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=128)
    c.train.update(batch_size=16, seq_len=seq_len, steps=steps)
    c.optim.update(warmup_steps=10, lr=3e-3)
    c.data.update(dir=data, vocab_size=512)
    c.eval.update(batches=2, every_steps=steps, at_start=True)
    c.checkpoint.update(every_steps=steps)
    c.log.update(every_steps=steps)
    c.sample.update(max_new_tokens=0)
    for group, values in groups.items():
        c[group].update(values)
    return c


@pytest.mark.slow
def test_dpo_after_sft_prefers_the_chosen_answers(tmp_path):
    rng = np.random.default_rng(0)
    words = [list(rng.choice(WORDS, 3)) for _ in range(3000)]
    hf = chat_tokenizer_dir(tmp_path / "hf", WORDS)
    # SFT: the answer is the copy or the reversal, at random: greedy answers are some of each.
    sft = [{"messages": [_message("user", w), _message("assistant", w if rng.random() < 0.5 else w[::-1])]}
           for w in words[:1500]]
    sft_data = _prepare(tmp_path / "sft", hf, sft, chat=True, max_len=64)
    pairs = _prepare(tmp_path / "pairs", hf, _pairs(words[1500:]), preference=True, max_len=128)
    # Kept at 600 + 120 steps: 300 + 100 (SFT lr 5e-3, beta 0.5) passed with one prompt to spare on the reversals.
    sft_run = _config(tmp_path / "sft_run", sft_data, 600, 64)
    train.run(sft_run, **QUIET)
    assert hf_cli.main(["export", "--workdir", sft_run.workdir, "--output", str(tmp_path / "sft_hf")]) == 0

    tok = layout.load_tokenizer(sft_data)
    template, variables = chat.load_template(sft_data), chat.special_tokens(sft_data)
    prompts = [list(rng.choice(WORDS, 3)) for _ in range(40)]

    def shares(workdir):
        """The shares of held-out prompts answered greedily with the copy, and with the reversal."""
        _, _, graphdef, params = trainer_lib.restore_params(workdir)
        answers = [tok.decode(sampling.generate(graphdef, params, chat.encode_prompt(
            tok, template, [_message("user", w)], variables), window=64, max_new_tokens=12, stop_id=tok.eos_id)[0])
            for w in prompts]
        return (np.mean([a == " ".join(w) for a, w in zip(answers, prompts)]),
                np.mean([a == " ".join(w[::-1]) for a, w in zip(answers, prompts)]))

    copies, reversals = shares(sft_run.workdir)
    assert reversals >= 0.2, (copies, reversals)  # there is something to move
    dpo_run = _config(tmp_path / "dpo_run", pairs, 120, 128, train={"objective": "dpo"}, optim={"lr": 1e-3},
                      model={"init_from": str(tmp_path / "sft_hf"), "lora_rank": 8})
    summary = train.run(dpo_run, **QUIET)
    (_, before), (_, after) = summary["eval"][0], summary["eval"][-1]
    assert before == pytest.approx(np.log(2), rel=1e-5) and after < 0.5 * before
    records = [json.loads(line) for line in (tmp_path / "dpo_run" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval_dpo/accuracy"] for r in records if "eval_dpo/accuracy" in r]
    assert accuracy[-1] > 0.9, accuracy
    copies_after, reversals_after = shares(dpo_run.workdir)
    assert copies_after > copies and reversals_after < 0.25 * reversals, (copies, reversals, copies_after,
                                                                          reversals_after)
