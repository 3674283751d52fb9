"""Tests of the data pipeline: prepare (ArrayRecord shards), tokenizer, Grain pipeline."""

import collections
import json
import os
from pathlib import Path
import re
import subprocess
import sys
import time

import grain
import numpy as np
import pytest

from jaxtrain.data import corpus, pipeline, tokenizer
from jaxtrain.data.prepare import DataError
from jaxtrain.data import layout
from jaxtrain import files

VOCAB = 512  # Small vocab keeps preparation fast; tokens stay uint16.
SEQ = 64  # Many KJV paragraphs are longer than this: packing must split them.
REPO = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kjv") / "data")
    corpus.prepare_default_corpus(path, VOCAB)
    return path


def records(data_dir, split):
    """All documents of a split as tuples of token ids, in file order."""
    manifest = layout.load_manifest(data_dir)
    paths = [os.path.join(data_dir, s["file"]) for s in manifest["splits"][split]]
    source = grain.sources.ArrayRecordDataSource(paths)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    return [tuple(np.frombuffer(source[i], dtype).tolist()) for i in range(len(source))]


def token_stream(batches):
    """Non-pad tokens of the batches, row after row."""
    return np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches]).tolist()


def split_docs(stream):
    """Complete documents (ending with EOS) of a token stream; drops the tail."""
    docs, start = [], 0
    for i, t in enumerate(stream):
        if t == tokenizer.EOS_ID:
            docs.append(tuple(stream[start : i + 1]))
            start = i + 1
    return docs


def take(it, n):
    return [next(it) for _ in range(n)]


def fingerprints(batches):
    return [pipeline.tokens_per_batch_fingerprint(b) for b in batches]


# ----------------------------------------------------------------- prepare


def test_records_decode_to_source_documents(data_dir):
    tok = tokenizer.load(os.path.join(data_dir, "tokenizer.json"))
    decoded = []
    for split in ("train", "heldout"):
        for rec in records(data_dir, split):
            assert rec[-1] == tokenizer.EOS_ID and tokenizer.EOS_ID not in rec[:-1]
            decoded.append(tok.decode(rec[:-1]))
    assert sorted(decoded) == sorted(corpus.read_kjv_documents())
    assert len(records(data_dir, "heldout")) == 200


def test_manifest_counts_and_hashes(data_dir):
    m = layout.load_manifest(data_dir)
    assert (m["vocab_size"], m["heldout_docs"], m["seed"], m["dtype"]) == (VOCAB, 200, 0, "uint16")
    assert m["tokenizer"]["sha256"] == files.file_hash(os.path.join(data_dir, "tokenizer.json"))
    assert len(m["splits"]["train"]) == corpus.NUM_TRAIN_SHARDS
    for split, shards in m["splits"].items():
        recs = records(data_dir, split)
        assert sum(s["docs"] for s in shards) == len(recs)
        assert sum(s["tokens"] for s in shards) == sum(map(len, recs))
        for s in shards:
            assert s["sha256"] == files.file_hash(os.path.join(data_dir, s["file"]))


def test_tokenizer_is_deterministic_and_round_trips():
    texts = corpus.read_kjv_documents()[:300] + ["<|endoftext|> stays text — Æ’"]
    a, b = tokenizer.train_bpe(texts, 400), tokenizer.train_bpe(texts, 400)
    assert a.to_str() == b.to_str()
    assert (a.token_to_id("<|pad|>"), a.token_to_id("<|endoftext|>")) == (0, 1)
    for t in texts:
        ids = a.encode(t).ids
        assert tokenizer.EOS_ID not in ids and a.decode(ids) == t


def test_reuse_does_not_touch_files(data_dir, capsys):
    before = {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)}
    start = time.perf_counter()
    manifest = corpus.prepare_default_corpus(data_dir, VOCAB)
    assert time.perf_counter() - start < 0.5
    assert manifest == layout.load_manifest(data_dir)
    after = {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)}
    assert after == before
    assert capsys.readouterr().out == ""  # Reuse is silent; only real work prints.


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(vocab_size=1024), "vocab_size"),
        (dict(vocab_size=VOCAB, seed=1), "seed"),
        (dict(vocab_size=VOCAB, heldout_docs=100), "heldout_docs"),
    ],
)
def test_different_settings_raise(data_dir, kwargs, setting):
    with pytest.raises(DataError, match=setting) as e:
        corpus.prepare_default_corpus(data_dir, **kwargs)
    assert data_dir in str(e.value)


def test_missing_data_dir_raises(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError, match=re.escape(missing)):
        layout.load_manifest(missing)
    with pytest.raises(DataError, match=re.escape(missing)):
        pipeline.train_iterator(missing, seq_len=SEQ, global_batch=2, seed=0)
    with pytest.raises(DataError, match=re.escape(missing)):
        pipeline.eval_batches(missing, seq_len=SEQ, global_batch=2, num_batches=1)


def test_interrupted_prepare_leaves_nothing(tmp_path, monkeypatch):
    def crash(out_dir, settings):
        open(os.path.join(out_dir, "tokenizer.json"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "_prepare_into", crash)
    with pytest.raises(KeyboardInterrupt):
        corpus.prepare_default_corpus(str(tmp_path / "data"), VOCAB)
    assert os.listdir(tmp_path) == []


def test_concurrent_preparers_and_cli(tmp_path):
    out = str(tmp_path / "data")
    cmd = [sys.executable, "-m", "jaxtrain", "prepare", "--output", out, "--vocab_size", str(VOCAB)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    assert [rc for _, _, rc in results] == [0, 0], results
    assert os.listdir(tmp_path) == ["data"]  # No temp dir left behind.
    assert len(records(out, "heldout")) == 200

    bad = subprocess.run(cmd[:-1] + ["1024"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "vocab_size" in bad.stderr and out in bad.stderr


# ---------------------------------------------------------------- pipeline


def check_packing(batch, local_batch):
    for key in ("tokens", "segment_ids", "positions"):
        assert batch[key].shape == (local_batch, SEQ) and batch[key].dtype == np.int32
    for tok, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
        pad = seg == 0
        assert (tok[pad] == tokenizer.PAD_ID).all() and (pos[pad] == 0).all()
        assert tokenizer.PAD_ID not in tok[~pad]
        assert seg[0] == 1 and pos[0] == 0
        same = seg[1:] == seg[:-1]
        assert (pos[1:][same] == pos[:-1][same] + 1).all()  # Positions count up in a doc...
        assert (pos[1:][~same] == 0).all()  # ...and restart at each new doc.
        new_doc = ~same & ~pad[1:]
        assert (seg[1:][new_doc] == seg[:-1][new_doc] + 1).all()
        assert (tok[:-1][new_doc] == tokenizer.EOS_ID).all()  # A doc ends in EOS before the next.


def test_packing_keeps_every_token(data_dir):
    batches = take(pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0), 60)
    for b in batches:
        check_packing(b, 8)
    stream = token_stream(batches)
    assert len(stream) == 60 * 8 * SEQ  # Endless training stream: no padding at all.
    docs = split_docs(stream)
    # Cutting the stream at EOS yields whole train documents, each once: so no
    # token was dropped or duplicated, including in docs longer than a row.
    train = collections.Counter(records(data_dir, "train"))
    assert all(train[d] >= c for d, c in collections.Counter(docs).items())
    assert max(map(len, docs)) > 3 * SEQ


def tiny_prepared_dir(path, docs, dtype="<u2", block_records=None, shards=1):
    """A prepared-looking data dir holding `docs` (lists of ids) as its train split: in the oldest format (a
    manifest naming the shard only), or with lengths indexes and blocks of `block_records` documents."""
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(path)
    rows = []
    for i, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        name = f"train-{i:05d}-of-{shards:05d}.array_record"
        writer = ArrayRecordWriter(os.path.join(path, name), "group_size:1")
        for j in part:
            writer.write(np.asarray(docs[j], dtype).tobytes())
        writer.close()
        rows.append({"file": name})
        if block_records:  # the block index is then summed from the lengths at open
            lengths = np.array([len(docs[j]) for j in part], np.uint32)
            np.save(os.path.join(path, name + ".lengths"), lengths)
            rows[-1].update(docs=len(part), tokens=int(lengths.sum()), lengths=name + layout.LENGTHS_SUFFIX,
                            block_records=block_records)
    manifest = {"dtype": np.dtype(dtype).name, "tokenizer": {"sha256": "0" * 64}, "splits": {"train": rows}}
    with open(os.path.join(path, layout.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return str(path)


def test_rows_are_exact_slices_of_the_stream(tmp_path):
    d = tiny_prepared_dir(tmp_path / "d", [[10, 11, 12], [20, 21, 22, 23, 24, 25], [30, 31]])
    stream = pipeline.PackedStream(d, "train", seed=None)  # file order every epoch
    rows = [stream.row(4 * i, 4) for i in range(4)]
    b = {k: [r[k].tolist() for r in rows] for k in rows[0]}
    # Epoch 0 ends inside row 2; epoch 1 continues the stream with no padding and no dropped token.
    assert b["tokens"] == [[10, 11, 12, 20], [21, 22, 23, 24], [25, 30, 31, 10], [11, 12, 20, 21]]
    assert b["segment_ids"] == [[1, 1, 1, 2], [1, 1, 1, 1], [1, 2, 2, 3], [1, 1, 2, 2]]
    assert b["positions"] == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 1, 0], [0, 1, 0, 1]]


def test_eval_batches_are_deterministic_and_wrap(data_dir):
    kw = dict(seq_len=SEQ, global_batch=8)
    heldout = records(data_dir, "heldout")
    num = sum(map(len, heldout)) // (8 * SEQ) + 5  # More than one pass.
    batches = pipeline.eval_batches(data_dir, num_batches=num, **kw)
    assert len(batches) == num
    for b in batches:
        check_packing(b, 8)
    assert split_docs(token_stream(batches))[: len(heldout) + 1] == heldout + heldout[:1]
    again = pipeline.eval_batches(data_dir, num_batches=3, **kw)
    assert fingerprints(again) == fingerprints(batches[:3])


@pytest.mark.parametrize("k", [0, 5])
def test_exact_resume(data_dir, k):
    kw = dict(seq_len=SEQ, global_batch=8, seed=3)
    it = pipeline.train_iterator(data_dir, **kw)
    take(it, k)
    state = json.loads(json.dumps(it.get_state()))  # As Orbax stores it.
    expected = fingerprints(take(it, 5))
    fresh = pipeline.train_iterator(data_dir, **kw)
    fresh.set_state(state)
    assert fingerprints(take(fresh, 5)) == expected


def test_elastic_resume_changes_batch_and_length_without_repeat_or_skip(data_dir):
    """The state is a token offset: a resume with another batch size and sequence length (and so any
    process count) continues the same token stream exactly."""
    def flat(batches):
        return np.concatenate([b["tokens"].reshape(-1) for b in batches])

    reference = flat(take(pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3), 10))
    first = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3)
    head = take(first, 5)
    state = json.loads(json.dumps(first.get_state()))
    resumed = pipeline.train_iterator(data_dir, seq_len=SEQ // 2, global_batch=4, seed=3)
    resumed.set_state(state)
    tail = take(resumed, 20)  # 20 x 4 x 32 tokens = 5 x 8 x 64
    np.testing.assert_array_equal(np.concatenate([flat(head), flat(tail)]), reference)


@pytest.mark.parametrize("block_records", [None, 2])
def test_elastic_resume_from_2_processes_to_1_sees_every_document_once(tmp_path, block_records):
    """Document ids: every token of document d is the id d, so counting ids over an epoch shows any document
    repeated or skipped. 2 processes x batch 6 stop after 3 steps; 1 process x batch 4 (another seq_len too)
    resumes from their common state and reads on to exactly the end of epoch 0. With 2-document blocks, the
    epoch spans 11 windows of the block order (161 blocks), over 3 shards."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=50 if block_records is None else 320)
    d = tiny_prepared_dir(tmp_path / "ids", [[doc] * n for doc, n in enumerate(lengths)], block_records=block_records,
                          shards=1 if block_records is None else 3)
    assert pipeline.PackedStream(d, "train", 5).n_windows == (1 if block_records is None else 11)
    epoch = int(lengths.sum())
    seen = collections.Counter()
    parts = [pipeline.train_iterator(d, seq_len=10, global_batch=6, seed=5, process_index=p, process_count=2)
             for p in range(2)]
    for _ in range(3):
        for it in parts:
            seen.update(next(it)["tokens"].reshape(-1).tolist())
    states = {json.dumps(it.get_state()) for it in parts}
    assert len(states) == 1  # one position for every process
    resumed = pipeline.train_iterator(d, seq_len=7, global_batch=4, seed=5)
    resumed.set_state(json.loads(states.pop()))
    tail = np.concatenate([next(resumed)["tokens"].reshape(-1) for _ in range(-(-(epoch - 180) // 28))])
    seen.update(tail[: epoch - 180].tolist())  # 180 = 3 steps x 6 rows x 10 tokens
    assert seen == collections.Counter({doc: int(n) for doc, n in enumerate(lengths)})


def test_block_order_windows_hold_whole_random_blocks_and_read_only_those(tmp_path, monkeypatch):
    """Each window of an epoch is the documents of its blocks (consecutive records), in a shuffled order; the
    first row opens only the shards of its window's blocks and reads only their lengths."""
    lengths = np.random.default_rng(1).integers(1, 30, size=384)  # 8 shards x 12 blocks of 4
    d = tiny_prepared_dir(tmp_path / "b", [[i % 7 + 1] * n for i, n in enumerate(lengths)], block_records=4,
                          shards=8)
    stream = pipeline.PackedStream(d, "train", seed=2, window_blocks=4)
    assert stream.n_windows == 24
    read_blocks, opened = [], []
    real_lengths, real_reader = stream.records.block_lengths, stream.records._reader
    monkeypatch.setattr(stream.records, "block_lengths", lambda b: read_blocks.append(b) or real_lengths(b))
    monkeypatch.setattr(stream.records, "_reader", lambda s: opened.append(s) or real_reader(s))
    stream.row(0, 16)
    first_blocks = stream.blocks.blocks(0, 0)
    assert sorted(set(read_blocks)) == sorted(first_blocks.tolist())
    assert set(opened) <= {int(b) // 12 for b in first_blocks}
    for epoch in range(2):
        visited = []
        for w in range(stream.n_windows):
            units, ends = stream.window(epoch, w)
            blocks = stream.blocks.blocks(epoch, w)
            assert sorted(units.tolist()) == sorted(u for b in blocks.tolist() for u in range(4 * b, 4 * b + 4))
            np.testing.assert_array_equal(np.diff(ends, prepend=0), lengths[units])
            visited.append(blocks)
        visited = np.concatenate(visited)
        assert sorted(visited.tolist()) == list(range(96))  # every block once an epoch
        assert visited.tolist() != list(range(96))
    assert stream.blocks.blocks(0, 0).tolist() != stream.blocks.blocks(1, 0).tolist()


def test_a_position_saved_before_the_block_order_resumes_in_its_own_order(data_dir):
    """A data state without "order" was saved by the materialised permutation of every document: resuming it
    continues that order exactly (here rebuilt from its definition) and keeps saying so in its state."""
    lengths = pipeline.PackedStream(data_dir, "train", 3).document_lengths()
    train = records(data_dir, "train")
    perm = np.random.default_rng(np.random.SeedSequence([3, 0])).permutation(len(lengths))
    old_stream = [t for doc in perm for t in train[doc]]
    it = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3)
    state = it.get_state()
    assert state["order"] == pipeline.ORDER
    del state["order"]
    state["next_token"] = 5 * 8 * SEQ
    it.set_state(state)
    assert it.get_state()["order"] == pipeline.LEGACY_ORDER
    got = np.concatenate([b["tokens"].reshape(-1) for b in take(it, 3)]).tolist()
    assert got == old_stream[5 * 8 * SEQ: 8 * 8 * SEQ]
    with pytest.raises(DataError, match="document order 'zigzag'"):
        it.set_state({**state, "order": "zigzag"})


def test_resume_refuses_another_seed(data_dir):
    state = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3).get_state()
    other = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=4)
    with pytest.raises(DataError, match="seed"):
        other.set_state(state)


def test_resume_refuses_other_documents_at_the_same_path_unless_allowed(data_dir, tmp_path):
    """The position is a token offset: into other documents (the shards reordered here, as another prepare at the
    same path could) it would resume silently on wrong data. allow_changed resumes and says what changed."""
    import shutil  # noqa: PLC0415

    state = json.loads(json.dumps(pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3).get_state()))
    state["next_token"] = 2 * 8 * SEQ
    other = tmp_path / "data"
    shutil.copytree(data_dir, other)
    manifest = json.loads((other / layout.MANIFEST).read_text())
    manifest["splits"]["train"].reverse()
    (other / layout.MANIFEST).write_text(json.dumps(manifest))
    it = pipeline.train_iterator(str(other), seq_len=SEQ, global_batch=8, seed=3)
    with pytest.raises(DataError, match=r"^data\.dir: the train data \(.*\) holds other documents.*allow_changed"):
        it.set_state(state)
    said = it.set_state(state, allow_changed=True)
    assert "holds other documents" in said and it.get_state()["content"] != state["content"]
    assert it.get_state()["next_token"] == 2 * 8 * SEQ
    again = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=3)
    assert again.set_state(state) is None  # the same data
    del state["content"]  # a position saved before content ids: taken as it is
    assert it.set_state(state) is None


@pytest.mark.parametrize("edit, message", [
    (lambda m: [], "not a JSON object"),
    (lambda m: m.pop("splits") and None, "splits: missing or empty"),
    (lambda m: m.update(dtype="int8"), "dtype: 'int8' is not a token dtype"),
    (lambda m: m.update(dtype="uint32"), "dtype: 'uint32' is not a token dtype"),
    (lambda m: m["splits"]["train"][0].update(block_records=0), r"splits\.train\[0\]\.block_records: 0"),
    (lambda m: m["splits"]["train"][1].update(docs=-3), r"splits\.train\[1\]\.docs: -3 is not a count"),
    (lambda m: m["splits"]["train"].append(m["splits"]["train"][0]), r"splits\.train\[4\]\.file: .* listed twice"),
    (lambda m: m["splits"]["train"].pop(2) and None,
     r"splits\.train: lists 3 of the 4 shards train-\*-of-00004 \(not train-00002-of-00004\.array_record\)"),
    (lambda m: m["splits"]["train"][0].update(lengths="../x.npy"), "not a file name inside the data dir"),
    (lambda m: m["tokenizer"].pop("sha256") and None, "tokenizer: must be an object"),
    (lambda m: m["tokenizer"].update(file="/etc/passwd"), "tokenizer.file: .* not a file name inside"),
])
def test_a_manifest_the_readers_cannot_trust_is_named_by_field(data_dir, tmp_path, edit, message):
    """Each edit is one that used to end in a traceback, or in training on wrong data (issue 53)."""
    manifest = json.loads(Path(data_dir, layout.MANIFEST).read_text())
    replaced = edit(manifest)  # None: edited in place
    (tmp_path / layout.MANIFEST).write_text(json.dumps(manifest if replaced is None else replaced))
    with pytest.raises(DataError, match=message):
        layout.load_manifest(str(tmp_path))


def test_a_dtype_of_another_width_is_named_at_open(data_dir, tmp_path):
    import shutil  # noqa: PLC0415

    other = tmp_path / "data"
    shutil.copytree(data_dir, other)
    manifest = json.loads((other / layout.MANIFEST).read_text())
    (other / layout.MANIFEST).write_text(json.dumps({**manifest, "dtype": "int32"}))
    with pytest.raises(DataError, match=r"train-00000-of-00004\.array_record: its first record has \d+ bytes, the "
                                        r"manifest's dtype and lengths say \d+ \(int32, without loss weights\)"):
        pipeline.PackedStream(str(other), "train", seed=0)


def test_seeds(data_dir):
    def first(seed):
        return fingerprints(take(pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=seed), 5))

    assert first(0) == first(0)
    assert first(0) != first(1)


def test_each_epoch_is_a_new_shuffle(data_dir):
    stream = pipeline.PackedStream(data_dir, "train", seed=0)
    n, total = len(stream.document_lengths()), stream.epoch_tokens
    epochs = [[doc for doc, _, _ in stream.pieces(e * total, total)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # every epoch is a permutation of all documents
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    # And a row's tokens are those documents' tokens.
    train = records(data_dir, "train")
    row = stream.row(total - 5, 2 * SEQ)  # straddles the epoch boundary
    expected = [t for doc, first, stop in stream.pieces(total - 5, 2 * SEQ) for t in train[doc][first:stop]]
    assert row["tokens"].tolist() == expected


@pytest.mark.parametrize("process_count", [2, 4])
def test_processes_read_disjoint_rows_of_the_same_global_batch(data_dir, process_count):
    whole = take(pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0), 3)
    parts = [pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0, process_index=p,
                                     process_count=process_count) for p in range(process_count)]
    for k in range(3):
        local = [next(it) for it in parts]
        assert local[0]["tokens"].shape == (8 // process_count, SEQ)
        for key in whole[k]:
            np.testing.assert_array_equal(np.concatenate([b[key] for b in local]), whole[k][key])
    assert len({json.dumps(it.get_state()) for it in parts}) == 1  # one state for all processes
    evals = [pipeline.eval_batches(data_dir, seq_len=SEQ, global_batch=8, num_batches=2, process_index=p,
                                   process_count=process_count) for p in range(process_count)]
    for k, b in enumerate(pipeline.eval_batches(data_dir, seq_len=SEQ, global_batch=8, num_batches=2)):
        np.testing.assert_array_equal(np.concatenate([e[k]["tokens"] for e in evals]), b["tokens"])


def test_batch_must_divide_over_processes(data_dir):
    with pytest.raises(DataError, match="process_count"):
        pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=5, seed=0, process_count=2)


def test_a_changed_tokenizer_stops_the_run_before_training(data_dir, tmp_path, tiny_config):
    import shutil

    from jaxtrain import train

    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    assert layout.verified_tokenizer(str(copy)) == str(copy / "tokenizer.json")
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")  # any byte: another file than the shards were tokenized with
    with pytest.raises(DataError, match=r"tokenizer.json: sha256 \w+ differs from \w+, the tokenizer the shards"):
        layout.verified_tokenizer(str(copy))
    cfg = tiny_config(**{"data.dir": str(copy), "data.vocab_size": VOCAB, "model.vocab_size": VOCAB})
    with pytest.raises(DataError, match="differs"):
        train.run(cfg, print_fn=lambda *a: None)
    assert not os.path.exists(cfg.workdir)  # stopped before the workdir was created


def test_mixture_proportions_order_and_no_repeats(data_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(data_dir, other)  # same tokenizer: a valid second dataset
    it = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0, mixture=f"{data_dir}:0.7,{other}:0.3")
    mix = it.stream
    located = [mix.locate(r) for r in range(10_000)]
    counts = collections.Counter(d for d, _ in located)
    assert abs(counts[0] / 10_000 - 0.7) <= 0.02 and abs(counts[1] / 10_000 - 0.3) <= 0.02
    for d in (0, 1):  # each dataset's rows are used in order, none repeated or skipped
        assert [i for dd, i in located if dd == d] == list(range(counts[d]))
    assert [d for d, _ in located[:40]] != sorted(d for d, _ in located[:40])  # interleaved, not in runs
    # Tokens: mixture row r is row i of dataset d's own stream, and batches are made of those rows.
    batch = next(it)
    for r in range(8):
        d, i = located[r]
        np.testing.assert_array_equal(batch["tokens"][r], mix.streams[d].row(i * SEQ, SEQ)["tokens"])
    # Exact resume; another seq_len is refused for a mixture.
    state = json.loads(json.dumps(it.get_state()))
    expected = fingerprints(take(it, 3))
    again = pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0,
                                    mixture=f"{data_dir}:0.7,{other}:0.3")
    again.set_state(state)
    assert fingerprints(take(again, 3)) == expected
    shorter = pipeline.train_iterator(data_dir, seq_len=SEQ - 8, global_batch=8, seed=0,
                                      mixture=f"{data_dir}:0.7,{other}:0.3")
    with pytest.raises(DataError, match="train.seq_len"):
        shorter.set_state(state)


def test_mixture_refuses_another_tokenizer_and_bad_specs(data_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(data_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="another tokenizer"):
        pipeline.train_iterator(data_dir, seq_len=SEQ, global_batch=8, seed=0, mixture=f"{data_dir}:1,{other}:1")
    for bad in ("", "x", "x:0", "x:-1", "x:abc", ":1"):
        with pytest.raises(ValueError):
            pipeline.parse_mixture(bad)
    assert pipeline.parse_mixture("gs://b/d:0.25, /x:3") == [("gs://b/d", 0.25), ("/x", 3.0)]


def test_a_run_trains_on_a_mixture(tiny_config, tiny_data_dir, tmp_path):
    import shutil

    from jaxtrain import train

    other = tmp_path / "other"
    shutil.copytree(tiny_data_dir, other)
    cfg = tiny_config(**{"train.steps": 3, "data.mixture": f"{tiny_data_dir}:0.5,{other}:0.5", "log.fingerprints": True})
    summary = train.run(cfg, print_fn=lambda *a: None)
    assert summary["finished"]
    it = pipeline.train_iterator(tiny_data_dir, seq_len=cfg.train.seq_len, global_batch=cfg.train.batch_size, seed=0,
                                 mixture=cfg.data.mixture)
    seen = [json.loads(line)["fingerprint"] for line in open(os.path.join(cfg.workdir, "data_fingerprints.0.jsonl"))]
    assert seen == fingerprints(take(it, 3))
