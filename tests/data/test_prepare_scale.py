"""Tests of the scalable `prepare --input`: byte/row-range pieces, parallel shard building, shard-level
resume, input identity, given tokenizers (SentencePiece, custom EOS) and the per-shard lengths index."""

import collections
import hashlib
import json
import os
import random
import subprocess
import sys

import grain
import numpy as np
import pytest

from jaxtrain.data import encode, pipeline, prepare, sources, tokenizer
from jaxtrain.data import layout
from jaxtrain.tools import prepare as prepare_cli
from jaxtrain import files

VOCAB = 300
WORDS = ("the quick brown fox jumps over a lazy dog; data ünïcode — “quoted” 中文 ✓ tokens and more words "
         "alpha beta gamma delta epsilon").split()


def make_docs(n, seed=0, max_words=400):
    """n distinct documents of very different lengths (1 to max_words words)."""
    rng = random.Random(seed)
    lengths = [1, 2, max_words, max_words // 2] + [int(max_words ** rng.random()) for _ in range(n - 4)]
    return [f"d{i} " + " ".join(rng.choice(WORDS) for _ in range(k)) for i, k in enumerate(lengths[:n])]


def digests(data_dir):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(data_dir.iterdir())}


def snapshot(data_dir):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(data_dir.iterdir())}


def records(data_dir, split=None):
    """Token id arrays of every record (manifest order), checked to end with the manifest's EOS id."""
    m = layout.load_manifest(str(data_dir))
    splits = [split] if split else list(m["splits"])
    files = [os.path.join(data_dir, s["file"]) for sp in splits for s in m["splits"][sp]]
    src = grain.sources.ArrayRecordDataSource(files)
    out = [np.frombuffer(r, dtype=np.dtype(m["dtype"]).newbyteorder("<")) for r in src.__getitems__(range(len(src)))]
    assert all(len(r) and r[-1] == m["eos_id"] for r in out)
    return out


def decoded(data_dir, eos_token=None):
    """Multiset of the documents of both splits, decoded with the data dir's own tokenizer."""
    tok = tokenizer.load(layout.verified_tokenizer(str(data_dir)), eos_token)
    return collections.Counter(tok.decode(r[:-1]) for r in records(data_dir))


def run(out, *args, heldout=3, vocab=VOCAB):
    return prepare_cli.main(["--output", str(out), "--vocab_size", str(vocab), "--heldout_docs", str(heldout), *args])


def write_jsonl(path, docs, extra=()):
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs) + "".join(extra))
    return path


@pytest.fixture
def corpus(tmp_path):
    """A big JSONL file (many byte-range pieces), a Parquet file with several row groups, two .txt files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "in"
    d.mkdir()
    docs = make_docs(240)
    write_jsonl(d / "big.jsonl", docs[:160])
    pq.write_table(pa.table({"text": docs[160:220]}), d / "p.parquet", row_group_size=8)
    (d / "t1.txt").write_text(docs[220])
    (d / "t2.txt").write_text("\n".join(docs[221:]))
    inputs = [str(d / "big.jsonl"), str(d / "p.parquet"), str(d / "*.txt")]
    expected = collections.Counter(docs[:221] + ["\n".join(docs[221:])])
    return inputs, expected


# 1 -------------------------------------------------------------------------------------------------------
def test_parallel_equals_serial(tmp_path, corpus, monkeypatch):
    inputs, expected = corpus
    assert run(tmp_path / "serial", "--input", *inputs, "--num_shards", "4", "--workers", "1", heldout=7) == 0
    assert run(tmp_path / "parallel", "--input", *inputs, "--num_shards", "4", "--workers", "2", heldout=7) == 0
    # The same shard jobs as an Apache Beam pipeline (DirectRunner, in this process).
    assert run(tmp_path / "beam", "--input", *inputs, "--num_shards", "4", "--runner", "DirectRunner", heldout=7) == 0
    serial, parallel = digests(tmp_path / "serial"), digests(tmp_path / "parallel")
    assert serial == parallel == digests(tmp_path / "beam")  # shards, indexes, tokenizer.json and the manifest
    # Tokenizing in small batches (bounded memory) changes nothing either.
    monkeypatch.setattr(encode, "TOKENIZE_BATCH_BYTES", 500)
    assert run(tmp_path / "batched", "--input", *inputs, "--num_shards", "4", "--workers", "1", heldout=7) == 0
    assert digests(tmp_path / "batched") == serial
    names = set(serial)
    assert {"tokenizer.json", "manifest.json"} < names
    m = layout.load_manifest(str(tmp_path / "serial"))
    assert m["splits"] == layout.load_manifest(str(tmp_path / "parallel"))["splits"]
    assert len(m["splits"]["train"]) == 4
    for row in m["splits"]["train"] + m["splits"]["heldout"]:
        assert row["file"] in names and row["lengths"] == row["file"] + layout.LENGTHS_SUFFIX in names
    assert decoded(tmp_path / "parallel") == expected


# 2 -------------------------------------------------------------------------------------------------------
def test_interrupted_run_resumes_shard_by_shard(tmp_path, corpus, monkeypatch):
    inputs, expected = corpus
    args = ["--input", *inputs, "--num_shards", "5", "--workers", "1"]
    assert run(tmp_path / "ref", *args) == 0

    real = prepare._build_shard
    calls = []

    def interrupting(job, fail_at=None):
        calls.append(job["plan"].index)
        if len(calls) == fail_at:
            raise KeyboardInterrupt
        return real(job)

    out, partial = tmp_path / "out", tmp_path / ".out.partial"
    monkeypatch.setattr(prepare, "_build_shard", lambda job: interrupting(job, fail_at=3))
    assert run(out, *args) == 130  # Ctrl-C: one line, the finished shards kept for the rerun
    assert not out.exists() and partial.is_dir()
    assert sorted(p.name for p in partial.glob("*.done.json")) == ["shard-00000.done.json", "shard-00001.done.json"]
    assert sorted(p.name for p in partial.glob("train-*.array_record")) == [
        "train-00000-of-00005.array_record", "train-00001-of-00005.array_record"]

    calls.clear()
    monkeypatch.setattr(prepare, "_build_shard", interrupting)
    assert run(out, *args) == 0
    assert sorted(calls) == [2, 3, 4]  # only the missing shards
    assert not partial.exists()
    assert digests(out) == digests(tmp_path / "ref")  # manifest included: nothing in it is path-dependent
    assert layout.load_manifest(str(out)) == layout.load_manifest(str(tmp_path / "ref"))
    assert decoded(out) == expected

    # Interrupted again, then rerun with other settings: the partial work is discarded, everything is rebuilt.
    calls.clear()
    monkeypatch.setattr(prepare, "_build_shard", lambda job: interrupting(job, fail_at=3))
    assert run(tmp_path / "out2", *args) == 130
    assert len(list((tmp_path / ".out2.partial").glob("*.done.json"))) == 2
    calls.clear()
    monkeypatch.setattr(prepare, "_build_shard", interrupting)
    assert run(tmp_path / "out2", *args, "--seed", "1") == 0
    assert sorted(calls) == [0, 1, 2, 3, 4]
    assert not (tmp_path / ".out2.partial").exists()
    assert layout.load_manifest(str(tmp_path / "out2"))["seed"] == 1
    assert decoded(tmp_path / "out2") == expected


# 3 -------------------------------------------------------------------------------------------------------
def _line_corpus(n=120, max_words=600):
    docs = make_docs(n, seed=3, max_words=max_words)
    lines = [d.encode() + b"\n" for d in docs]
    lines[5] = docs[5].encode() + b"\r\n"  # a CRLF line
    lines.insert(9, b"\n")  # an empty line
    lines.insert(40, b"   \t\n")  # a blank one
    lines[-1] = lines[-1].rstrip(b"\n")  # no final newline
    return docs, b"".join(lines)


def _check_pieces_cover(src, text_split, parts):
    """Reading any cut of src into pieces gives the whole-file documents, each once, in order."""
    whole = list(sources.documents(src, text_split))
    for target in [max(1, int(src.size // k)) for k in parts]:
        pieces = src.pieces(target, text_split)
        assert len(pieces) > 1
        assert pieces[-1][1] == (-1 if src.kind != "parquet" else src.pieces(1 << 40)[0][1])
        got = [d for a, b, _ in pieces for d in sources.documents(src, text_split, a, b)]
        assert got == whole, target
    return whole


def test_txt_lines_in_byte_range_pieces(tmp_path):
    small_docs, small = _line_corpus(n=30, max_words=8)  # pieces down to 1 byte
    (tmp_path / "small.txt").write_bytes(small)
    (src,) = sources.expand([str(tmp_path / "small.txt")], None, "text")
    assert _check_pieces_cover(src, "line", [len(small), len(small) // 2, 3, 2]) == small_docs

    docs, data = _line_corpus()
    f = tmp_path / "lines.txt"
    f.write_bytes(data)
    (src,) = sources.expand([str(f)], None, "text")
    whole = _check_pieces_cover(src, "line", [1.01, 4, 37, 500])
    assert whole == docs  # the CRLF line lost its "\r", empty and blank lines are skipped

    assert run(tmp_path / "out", "--input", str(f), "--text_split", "line", "--num_shards", "4", heldout=5) == 0
    m = layout.load_manifest(str(tmp_path / "out"))
    # Line starts are not on piece boundaries: some lines straddle them.
    starts = {0} | {i + 1 for i, c in enumerate(data) if c == ord("\n")}
    assert any(a not in starts for a, _, _ in src.pieces(-(-len(data) // 4), "line"))
    assert len(m["splits"]["train"]) == 4
    assert decoded(tmp_path / "out") == collections.Counter(docs)
    assert m["sources"] == [{"path": str(f), "kind": "txt", "field": None, "docs": len(docs),
                             "skipped": {"empty": 2}}]
    assert sum(s["docs"] for sp in m["splits"].values() for s in sp) == len(docs)


def test_jsonl_in_byte_range_pieces(tmp_path):
    docs, _ = _line_corpus()
    docs = docs[:59] + ["with\r\ninside"] + docs[59:]
    body = [json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n" for d in docs]
    body[7] = body[7].rstrip(b"\n") + b"\r\n"
    body[30:30] = [b"\n", json.dumps({"id": 1}).encode() + b"\n", json.dumps({"text": " "}).encode() + b"\n"]
    f = tmp_path / "big.jsonl"
    f.write_bytes(b"".join(body))
    (src,) = sources.expand([str(f)], None, "text")
    assert _check_pieces_cover(src, "file", [1.01, 4, 37, 500]) == docs

    assert run(tmp_path / "out", "--input", str(f), "--num_shards", "4", "--workers", "2", heldout=6) == 0
    m = layout.load_manifest(str(tmp_path / "out"))
    assert decoded(tmp_path / "out") == collections.Counter(docs)
    (row,) = m["sources"]
    assert row["docs"] == len(docs) and row["skipped"] == {"empty": 1, "missing_field": 1}
    assert sum(s["docs"] for sp in m["splits"].values() for s in sp) == row["docs"]
    assert sum(s["docs"] for s in m["splits"]["heldout"]) == 6


def test_json_error_in_a_later_piece_names_the_byte_offset(tmp_path, capsys):
    good = [json.dumps({"text": d}).encode() + b"\n" for d in make_docs(40, seed=5)]
    bad_at = sum(map(len, good[:30]))
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"".join(good[:30]) + b'{"text": oops}\n' + b"".join(good[30:]))
    (src,) = sources.expand([str(f)], None, "text")
    assert src.pieces(-(-src.size // 4))[0][1] < bad_at  # not in the first piece

    tok_file = tmp_path / "tok.json"
    tokenizer.train_bpe(make_docs(20), VOCAB).save(str(tok_file))
    # A given tokenizer: the error comes from a worker process, not from training a tokenizer.
    assert run(tmp_path / "out", "--input", str(f), "--num_shards", "4", "--workers", "2",
               "--tokenizer", str(tok_file), "--max_bad_fraction", "0") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"error: {f}: the line at byte {bad_at} is not JSON (Expecting value)"
    assert not (tmp_path / "out").exists()


# 4 -------------------------------------------------------------------------------------------------------
def test_parquet_row_groups_in_row_range_pieces(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = make_docs(70, seed=7)
    column = [None if i % 9 == 4 else d for i, d in enumerate(docs)] + ["", "  "]
    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": column, "n": list(range(len(column)))}), f, row_group_size=6)
    assert pq.ParquetFile(f).num_row_groups == 12
    (src,) = sources.expand([str(f)], None, "text")
    kept = [d for d in column if d and d.strip()]
    assert _check_pieces_cover(src, "file", [3, 5, 100]) == kept

    assert run(tmp_path / "out", "--input", str(f), "--num_shards", "4", heldout=4) == 0
    m = layout.load_manifest(str(tmp_path / "out"))
    assert len(m["splits"]["train"]) == 4
    assert decoded(tmp_path / "out") == collections.Counter(kept)
    assert m["sources"][0]["docs"] == len(kept)
    assert m["sources"][0]["skipped"] == {"missing_field": column.count(None), "empty": 2}


# 5 -------------------------------------------------------------------------------------------------------
def test_heldout_quotas_are_proportional_and_add_up(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    rng = random.Random(1)
    docs = make_docs(300, seed=11)
    write_jsonl(d / "a.jsonl", docs[:200])
    for i in range(5):  # small files of very different sizes, read whole
        (d / f"t{i}.txt").write_text("\n\n".join(docs[200 + 20 * i: 200 + 20 * i + rng.randint(2, 20)]))
    srcs = sources.expand([str(d / "a.jsonl"), str(d / "*.txt")], None, "text")
    for n, heldout in [(1, 5), (3, 7), (4, 11), (6, 1), (8, 40)]:
        plans = prepare.plan_shards(srcs, "paragraph", n, heldout)
        assert [p.index for p in plans] == list(range(len(plans))) and 1 <= len(plans) <= n
        assert sum(p.heldout for p in plans) == heldout
        sizes = np.array([p.size for p in plans], float)
        assert sizes.sum() == sum(s.size for s in srcs)
        share = sizes / sizes.sum() * heldout
        assert np.all(np.abs(np.array([p.heldout for p in plans]) - share) < 1), (n, heldout)
        # Pieces stay in input order and each byte range / file appears once.
        flat = [pc for p in plans for pc in p.pieces]
        assert flat == [(i, a, b) for i, s in enumerate(srcs) for a, b, _ in s.pieces(-(-int(sizes.sum()) // n),
                                                                                     "paragraph")]

    assert run(tmp_path / "out", "--input", str(d / "a.jsonl"), str(d / "*.txt"), "--text_split", "paragraph",
               "--num_shards", "4", heldout=13) == 0
    m = layout.load_manifest(str(tmp_path / "out"))
    plans = prepare.plan_shards(srcs, "paragraph", 4, 13)
    assert sum(s["docs"] for s in m["splits"]["heldout"]) == 13
    by_index = {int(s["file"].split("-")[1]): s["docs"] for s in m["splits"]["heldout"]}
    assert by_index == {p.index: p.heldout for p in plans if p.heldout}
    assert len(records(tmp_path / "out", "heldout")) == 13


def test_heldout_shortfall_is_reported(tmp_path, capsys):
    """Quotas follow size: a shard of one long document cannot give its share; the run says so."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a_big.txt").write_text("big " * 2500)  # one document, 10 KB: shard 0, quota 4 of 4
    for i in range(10):
        (d / f"b{i}.txt").write_text(f"small doc {i} " * 8)  # ten documents, 1 KB: shard 1, quota 0
    assert run(tmp_path / "out", "--input", str(d / "*.txt"), "--num_shards", "2", "--workers", "1", heldout=4) == 0
    assert "prepare: warning: 1 held-out documents instead of --heldout_docs 4" in capsys.readouterr().err
    m = layout.load_manifest(str(tmp_path / "out"))
    assert [s["docs"] for s in m["splits"]["heldout"]] == [1]
    assert [s["docs"] for s in m["splits"]["train"]] == [0, 10]  # an empty train shard is fine for the pipeline
    assert len(pipeline.PackedStream(str(tmp_path / "out"), "train", seed=0).document_lengths()) == 10


# 6 -------------------------------------------------------------------------------------------------------
def test_input_identity_by_content(tmp_path, capsys, monkeypatch):
    f = tmp_path / "d.jsonl"
    docs = make_docs(30, seed=2)
    write_jsonl(f, docs)
    out = tmp_path / "out"
    assert run(out, "--input", str(f), "--num_shards", "2") == 0
    before = snapshot(out)

    hashed = []
    real_sha = sources.file_sha256
    monkeypatch.setattr(sources, "file_sha256", lambda p: hashed.append(p) or real_sha(p))
    # path + size + mtime match the manifest: its recorded sha256 is trusted, the file is not read again.
    assert run(out, "--input", str(f), "--num_shards", "2") == 0
    assert hashed == [] and snapshot(out) == before

    # (b) Touched only: hashed again, found the same, nothing is rewritten.
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert run(out, "--input", str(f), "--num_shards", "2") == 0
    assert hashed == [str(f)] and snapshot(out) == before

    # (a) Same size, other content, new mtime: different data, refused.
    data = f.read_bytes()
    changed = data.replace(b"d0 ", b"D0 ", 1)
    assert changed != data and len(changed) == len(data)
    f.write_bytes(changed)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000_000))
    capsys.readouterr()
    assert run(out, "--input", str(f), "--num_shards", "2") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}: holds data prepared with different settings: inputs=") and "\n" not in \
        err.rstrip("\n")
    assert snapshot(out) == before


# 7 -------------------------------------------------------------------------------------------------------
def test_sentencepiece_model_prepares_and_trains(tmp_path, tiny_config):
    spm = pytest.importorskip("sentencepiece")
    from jaxtrain import train

    docs = make_docs(80, seed=4, max_words=60) + [" leading space", "two  spaces\tand tab", "line\nbreak ✓",
                                                  "a literal </s> stays text"]
    (tmp_path / "spm.txt").write_text("\n".join(d.replace("\n", " ") for d in docs) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "spm.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=400, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
        pad_id=0, unk_id=1, bos_id=-1, eos_id=2, minloglevel=2, num_threads=1)
    model = tmp_path / "sp.model"
    sp = spm.SentencePieceProcessor(model_file=str(model))
    f = write_jsonl(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    assert run(out, "--input", str(f), "--tokenizer", str(model), "--num_shards", "2", heldout=5) == 0

    m = layout.load_manifest(str(out))
    assert (out / "tokenizer.model").read_bytes() == model.read_bytes() and not (out / "tokenizer.json").exists()
    assert m["tokenizer"] == {"file": "tokenizer.model", "sha256": files.file_hash(model), "kind": "sentencepiece"}
    assert m["eos_id"] == sp.eos_id() == 2 and m["dtype"] == "uint16"
    recs = records(out)  # every record ends with the EOS id, and has it nowhere else
    assert all(2 not in r[:-1] for r in recs)
    assert collections.Counter(sp.decode(r[:-1].tolist()) for r in recs) == collections.Counter(docs)
    assert decoded(out) == collections.Counter(docs)
    tok = layout.load_tokenizer(str(out))
    assert tok.kind == "sentencepiece" and tok.eos_id == 2 and tok.vocab_size == 400

    # A model without an EOS piece needs --eos_token naming one it has.
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "spm.txt"), model_prefix=str(tmp_path / "noeos"), vocab_size=340, model_type="bpe",
        normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
        unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, user_defined_symbols=["<doc_end>"], minloglevel=2, num_threads=1)
    noeos = tmp_path / "noeos.model"
    assert run(tmp_path / "out2", "--input", str(f), "--tokenizer", str(noeos)) == 2
    assert run(tmp_path / "out2", "--input", str(f), "--tokenizer", str(noeos), "--eos_token", "<nope>") == 2
    assert run(tmp_path / "out2", "--input", str(f), "--tokenizer", str(noeos), "--eos_token", "<doc_end>") == 0
    sp2 = spm.SentencePieceProcessor(model_file=str(noeos))
    assert layout.load_manifest(str(tmp_path / "out2"))["eos_id"] == sp2.piece_to_id("<doc_end>") == 1
    assert layout.load_tokenizer(str(tmp_path / "out2")).eos_id == 1
    assert decoded(tmp_path / "out2", "<doc_end>") == collections.Counter(docs)

    cfg = tiny_config(**{"data.dir": str(out), "data.vocab_size": 400, "model.vocab_size": 448, "train.steps": 2,
                         "optim.warmup_steps": 0})
    summary = train.run(cfg, print_fn=lambda *a: None)
    assert summary["finished"] and summary["step"] == 2


# 8 -------------------------------------------------------------------------------------------------------
def test_tokenizer_json_without_a_known_eos_needs_eos_token(tmp_path, capsys):
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    docs = make_docs(40, seed=6) + ["a literal [END] and <|endoftext|> stay text"]
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[BEGIN]", "[END]"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
    tok_file = tmp_path / "custom.json"
    hf.save(str(tok_file))
    end_id = hf.token_to_id("[END]")
    assert end_id == 2
    f = write_jsonl(tmp_path / "d.jsonl", docs)

    assert run(tmp_path / "out", "--input", str(f), "--tokenizer", str(tok_file)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tok_file}: ") and "--eos_token" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()

    assert run(tmp_path / "out", "--input", str(f), "--tokenizer", str(tok_file), "--eos_token", "[END]") == 0
    m = layout.load_manifest(str(tmp_path / "out"))
    assert m["eos_id"] == end_id and m["eos_token"] == "[END]"
    assert decoded(tmp_path / "out", "[END]") == collections.Counter(docs)
    assert all(end_id not in r[:-1] for r in records(tmp_path / "out"))
    # What train.run loads: the data dir's tokenizer with the EOS its documents end with.
    assert layout.load_tokenizer(str(tmp_path / "out")).eos_id == end_id

    capsys.readouterr()
    assert run(tmp_path / "out2", "--input", str(f), "--tokenizer", str(tok_file), "--eos_token", "[NOPE]") == 2
    assert "[NOPE]" in capsys.readouterr().err


# 9 -------------------------------------------------------------------------------------------------------
def test_lengths_index(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", make_docs(60, seed=8))
    out = tmp_path / "out"
    assert run(out, "--input", str(f), "--num_shards", "3") == 0
    m = layout.load_manifest(str(out))
    for split in ("train", "heldout"):
        from_records = np.array([len(r) for r in records(out, split)])
        stream = pipeline.PackedStream(str(out), split, seed=0)
        np.testing.assert_array_equal(stream.document_lengths(), from_records)
        for row in m["splits"][split]:
            index = np.load(out / row["lengths"])
            assert index.dtype == np.uint32 and len(index) == row["docs"] and int(index.sum()) == row["tokens"]

    # An old data dir (no `lengths` keys): lengths measured from the records, the same.
    manifest_path = out / "manifest.json"
    original = manifest_path.read_text()
    old = json.loads(original)
    for rows in old["splits"].values():
        for row in rows:
            del row["lengths"]
    manifest_path.write_text(json.dumps(old))
    np.testing.assert_array_equal(pipeline.PackedStream(str(out), "train", seed=0).document_lengths(),
                                  [len(r) for r in records(out, "train")])
    manifest_path.write_text(original)

    # An index that disagrees with the manifest, or is unreadable, is refused naming the file.
    index_path = out / m["splits"]["train"][1]["lengths"]
    good = np.load(index_path)
    bad = good.copy()
    bad[-1] += 1
    with open(index_path, "wb") as fh:
        np.save(fh, bad)
    # (The lengths are read, and checked against the block index, block by block as the stream reaches them.)
    with pytest.raises(prepare.DataError, match=f"{index_path}: does not match"):
        pipeline.PackedStream(str(out), "train", seed=0).document_lengths()
    bad = good.copy()
    bad[0] += 1  # the first document's length is also checked against its record when the split opens
    with open(index_path, "wb") as fh:
        np.save(fh, bad)
    with pytest.raises(prepare.DataError, match=f"{str(index_path)[:-len(layout.LENGTHS_SUFFIX)]}: its first record"):
        pipeline.PackedStream(str(out), "train", seed=0)
    bad = good.copy()
    bad[2], bad[3] = bad[2] + 1, bad[3] - 1  # the block's sum intact: found when the stream reads record 2
    with open(index_path, "wb") as fh:
        np.save(fh, bad)
    stream = pipeline.PackedStream(str(out), "train", seed=None)
    with pytest.raises(prepare.DataError, match=rf"{str(index_path)[:-len(layout.LENGTHS_SUFFIX)]}: record 2 holds "
                                                rf"{good[2]} tokens, not what its lengths index"):
        for start in range(0, stream.epoch_tokens, 16):
            stream.row(start, 16)
    with open(index_path, "wb") as fh:
        np.save(fh, good[:-1])
    with pytest.raises(prepare.DataError, match=f"{index_path}: does not match"):
        pipeline.PackedStream(str(out), "train", seed=0).document_lengths()
    index_path.write_bytes(b"garbage")
    with pytest.raises(prepare.DataError, match=f"{index_path}: unreadable lengths index"):
        pipeline.PackedStream(str(out), "train", seed=0).document_lengths()
    with open(index_path, "wb") as fh:
        np.save(fh, good)

    # The block index: tokens per block of layout.BLOCK_RECORDS documents, read whole at start.
    blocks_path = out / m["splits"]["train"][1]["blocks"]
    np.testing.assert_array_equal(np.load(blocks_path), [good.sum()])  # (20 docs: one block)
    np.save(str(blocks_path)[:-4], np.array([good.sum() + 1]))
    with pytest.raises(prepare.DataError, match=f"{blocks_path}: does not match"):
        pipeline.PackedStream(str(out), "train", seed=0)
    blocks_path.write_bytes(b"garbage")
    with pytest.raises(prepare.DataError, match=f"{blocks_path}: unreadable block index"):
        pipeline.PackedStream(str(out), "train", seed=0)


# 10 ------------------------------------------------------------------------------------------------------
def test_concurrent_cli_preparers(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", make_docs(200, seed=9))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxtrain", "prepare", "--output", str(out), "--heldout_docs", "3",
           "--vocab_size", str(VOCAB), "--input", str(f), "--num_shards", "3", "--workers", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [r[0] for r in results] == [0, 0], results
    assert sum(r[1].startswith("prepared 1 files") for r in results) == 1  # the other found it done
    assert not (tmp_path / ".out.partial").exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no lock file left beside it
    assert decoded(out) == collections.Counter(make_docs(200, seed=9))
    assert run(tmp_path / "ref", "--input", str(f), "--num_shards", "3", "--workers", "1") == 0
    assert digests(out) == digests(tmp_path / "ref")


def test_an_unknown_beam_runner_exits_2_before_any_work(tmp_path, capsys):
    inputs = [str(write_jsonl(tmp_path / "a.jsonl", make_docs(20)))]
    assert run(tmp_path / "out", "--input", *inputs, "--runner", "NoSuchRunner") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--runner NoSuchRunner" in err[0] and "Unexpected pipeline runner" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]
