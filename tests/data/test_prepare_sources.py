"""Tests of `prepare --input`: text/JSONL/Parquet sources -> ArrayRecord shards + manifest."""

import gzip
import json
import os
import subprocess
import sys

import grain
import numpy as np
import pytest

from jaxtrain.data import pipeline, tokenizer
from jaxtrain.data import layout
from jaxtrain.tools import prepare as prepare_cli
from jaxtrain import files

VOCAB = 300
PARAS = ["In the beginning was the word.\nAnd the word was data.", "Second paragraph — with ünïcode.", "Third one."]


def read_back(data_dir):
    """All documents of both splits, decoded with the data dir's own tokenizer."""
    m = layout.load_manifest(data_dir)
    tok = tokenizer.load(layout.verified_tokenizer(data_dir))
    files = [os.path.join(data_dir, s["file"]) for split in m["splits"].values() for s in split]
    src = grain.sources.ArrayRecordDataSource(files)
    docs = []
    for r in src.__getitems__(range(len(src))):
        ids = np.frombuffer(r, dtype=np.dtype(m["dtype"]).newbyteorder("<")).tolist()
        assert ids[-1] == tokenizer.EOS_ID
        docs.append(tok.decode(ids[:-1]))
    return sorted(docs)


def run(tmp_path, *args, out="out"):
    return prepare_cli.main(["--output", str(tmp_path / out), "--vocab_size", str(VOCAB), "--heldout_docs", "1", *args])


@pytest.fixture
def txt(tmp_path):
    d = tmp_path / "txt"
    d.mkdir()
    (d / "a.txt").write_text("\n\n".join(PARAS) + "\n")
    (d / "b.txt").write_text("line one\nline two\n")
    return d


@pytest.mark.parametrize(
    "split,expected",
    [
        ("file", ["\n\n".join(PARAS) + "\n", "line one\nline two\n"]),
        ("paragraph", PARAS + ["line one\nline two"]),
        ("line", [*"\n\n".join(PARAS).split("\n"), "line one", "line two"]),
    ],
)
def test_text_round_trip(tmp_path, txt, split, expected):
    assert run(tmp_path, "--input", str(txt / "*.txt"), "--text_split", split) == 0
    assert read_back(tmp_path / "out") == sorted(d for d in expected if d.strip())


def test_jsonl_custom_field_and_counted_skips(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"body": "doc one"}), json.dumps({"body": "doc two ✓"}), json.dumps({"other": "x"}),
             json.dumps({"body": "  "}), json.dumps({"body": 7}), ""]
    f.write_bytes(("\n".join(lines) + "\n").encode() + b'{"body": "bad \xff byte"}\n')
    assert run(tmp_path, "--input", str(f), "--field", "body") == 0
    assert read_back(tmp_path / "out") == ["doc one", "doc two ✓"]
    (row,) = layout.load_manifest(tmp_path / "out")["sources"]
    assert row == {"path": str(f), "kind": "jsonl", "field": "body", "docs": 2,
                   "skipped": {"empty": 1, "missing_field": 1, "not_text": 1, "undecodable": 1}}
    assert "skipped 4 (empty 1, missing_field 1, not_text 1, undecodable 1)" in capsys.readouterr().out


def test_gzipped_jsonl(tmp_path):
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write('{"text": "zipped one"}\n{"text": "zipped two"}\n')
    assert run(tmp_path, "--input", str(tmp_path / "*.jsonl.gz")) == 0
    assert read_back(tmp_path / "out") == ["zipped one", "zipped two"]
    (tmp_path / "bad.jsonl.gz").write_text("not gzip")
    assert run(tmp_path, "--input", str(tmp_path / "bad.jsonl.gz"), out="out2") == 2


def test_txt_undecodable_paragraph_is_skipped(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"good one\n\nbad \xff\n \n\ngood two\n\n\n\n")
    assert run(tmp_path, "--input", str(f), "--text_split", "paragraph") == 0
    assert read_back(tmp_path / "out") == ["good one", "good two"]
    assert layout.load_manifest(tmp_path / "out")["sources"][0]["skipped"] == {"undecodable": 1}


def test_parquet_round_trip_and_trains(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [f"parquet document {i} " * (i + 1) for i in range(6)]
    pq.write_table(pa.table({"content": docs + [None], "id": list(range(7))}), tmp_path / "d.parquet")
    assert run(tmp_path, "--input", str(tmp_path / "d.parquet"), "--field", "content", "--num_shards", "2") == 0
    out = tmp_path / "out"
    assert read_back(out) == sorted(docs)
    m = layout.load_manifest(out)
    assert len(m["splits"]["train"]) == 2 and sum(s["docs"] for s in m["splits"]["train"]) == 5
    assert m["sources"][0]["skipped"] == {"missing_field": 1}
    batch = next(iter(pipeline.train_iterator(str(out), seq_len=16, global_batch=2, seed=0)))
    assert batch["tokens"].shape == (2, 16)


def test_existing_tokenizer_is_copied_and_hashed(tmp_path, txt):
    tok_file = tmp_path / "my_tokenizer.json"
    tokenizer.train_bpe(PARAS * 3, VOCAB).save(str(tok_file))
    assert run(tmp_path, "--input", str(txt / "a.txt"), "--text_split", "paragraph", "--tokenizer", str(tok_file)) == 0
    out = tmp_path / "out"
    m = layout.load_manifest(out)
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert m["tokenizer"]["sha256"] == files.file_hash(tok_file) == m["tokenizer_sha256"]
    assert read_back(out) == sorted(PARAS)

    # The same dir with another tokenizer (here: a trained one) is refused, naming the difference.
    tokenizer.train_bpe(["something else entirely"] * 3, VOCAB).save(str(tok_file))
    assert run(tmp_path, "--input", str(txt / "a.txt"), "--text_split", "paragraph", "--tokenizer", str(tok_file)) == 2
    assert run(tmp_path, "--input", str(txt / "a.txt"), "--text_split", "paragraph") == 2


def test_rerun_rewrites_nothing_and_other_settings_are_refused(tmp_path, txt, capsys):
    args = ["--input", str(txt / "*.txt"), "--text_split", "line"]
    assert run(tmp_path, *args) == 0
    out = tmp_path / "out"
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    assert run(tmp_path, *args) == 0
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before
    capsys.readouterr()
    assert run(tmp_path, "--input", str(txt / "*.txt"), "--text_split", "paragraph") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "text_split='line' (requested 'paragraph')" in err
    (txt / "b.txt").write_text("line one\nline two changed\n")  # Changed input size: different data.
    assert run(tmp_path, *args) == 2


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda d: d / "nothing-*.txt", "matches no file"),
        (lambda d: d / "missing.jsonl", "matches no file"),
        (lambda d: (d / "x.parquet").write_text("not parquet") and d / "x.parquet", "not a Parquet file"),
        (lambda d: (d / "x.csv").write_text("a,b") and d / "x.csv", "unknown extension"),
    ],
)
def test_bad_input_exits_2_naming_the_path(tmp_path, capsys, make, reason):
    path = make(tmp_path)
    assert run(tmp_path, "--input", str(path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and reason in err
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_malformed_lines_are_skipped_and_counted_up_to_max_bad_fraction(tmp_path, capsys):
    """A corpus of billions of lines nearly always holds a few broken ones (a truncated last line, a stray
    array): they are skipped and counted like other bad documents, until they pass --max_bad_fraction."""
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 7)}) for i in range(3000)]
    lines[1200] = "[1, 2]"
    f.write_text("\n".join(lines) + '\n{"text": "cut off mid-wr')  # 2 of 3001 records: 0.067%
    where = [f"{f}: line 1201 is not a JSON object", f"{f}: line 3001 is not JSON (Unterminated string starting at)"]

    assert run(tmp_path, "--input", str(f), "--max_bad_fraction", "0.0005") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: 2 of 3001 records (0.07%) are malformed JSONL lines, past --max_bad_fraction 0.0005;"
                       f" the first: {where[0]}. Fix the input or raise the limit: the finished shards are kept, so "
                       f"a rerun resumes")
    assert not (tmp_path / "out").exists()

    assert run(tmp_path, "--input", str(f)) == 0  # the default limit, 0.1%: resumes from the kept shards
    err = capsys.readouterr().err
    assert "resuming, 1 of 1 shards already done" in err
    assert f"skipped 2 malformed JSONL lines (within --max_bad_fraction 0.001); the first: {'; '.join(where)}" in err
    (row,) = layout.load_manifest(tmp_path / "out")["sources"]
    assert row["skipped"] == {"not_an_object": 1, "not_json": 1} and row["malformed_at"] == where
    assert row["docs"] == 2999 and len(read_back(tmp_path / "out")) == 2999

    assert run(tmp_path, "--input", str(f), "--max_bad_fraction", "0", out="strict") == 2  # today's strict mode
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {where[0]}"
    assert not (tmp_path / "strict").exists() and not list(tmp_path.glob("strict*"))


def test_cli_subprocess_bad_json_and_success(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n{oops\n')
    cmd = [sys.executable, "-m", "jaxtrain", "prepare", "--output", str(tmp_path / "out"), "--heldout_docs", "1",
           "--vocab_size", str(VOCAB), "--input", str(f)]
    r = subprocess.run([*cmd, "--max_bad_fraction", "0"], check=False, capture_output=True, text=True, timeout=60)
    expected = f"error: {f}: line 2 is not JSON (Expecting property name enclosed in double quotes)"
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [expected]
    f.write_text('{"text": "a"}\n{"text": "b"}\n{"nope": 1}\n')
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("prepared 1 files") and "2 docs" in r.stdout and "skipped 1 (missing_field 1)" in r.stdout


def test_a_run_trains_on_prepared_sources(tmp_path, tiny_config):
    from jaxtrain import config as config_lib, train

    lines = [json.dumps({"text": f"Document number {i}: " + "words and more words " * (i % 7 + 1)}) for i in range(60)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "prepared"
    assert prepare_cli.main(["--input", str(tmp_path / "docs.jsonl"), "--output", str(out), "--vocab_size", "300",
                         "--heldout_docs", "5"]) == 0
    cfg = tiny_config(**{"data.dir": str(out), "data.vocab_size": 300, "train.steps": 2, "optim.warmup_steps": 0})
    summary = train.run(cfg, print_fn=lambda *a: None)
    assert summary["finished"] and summary["step"] == 2
    small = tiny_config(**{"data.dir": str(out), "data.vocab_size": 258, "model.vocab_size": 260,
                           "train.steps": 2, "optim.warmup_steps": 0})
    with pytest.raises(config_lib.ConfigError, match="model.vocab_size: 260 is smaller than the vocab"):
        train.run(small, print_fn=lambda *a: None)
