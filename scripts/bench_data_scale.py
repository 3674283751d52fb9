"""Host memory and time to the first batch of the train iterator, against the corpus's document count.

    python scripts/bench_data_scale.py [--docs 100000,1000000,10000000] [--dir /tmp/jaxtrain_scale]
                                       [--batches 200] [--seq_len 1024] [--batch 8]

Writes synthetic prepared corpora (the `prepare` format: ArrayRecord shards of 131,072 documents of 4..60
tokens, lengths and block indexes) once into --dir, then, for each size and each document order, starts a
fresh process that opens `train_iterator` and reports:
  - rss_first_mb: RSS growth from after the imports to the first batch (peak, ru_maxrss);
  - rss_mb: the same after --batches more batches (the readers and windows it has touched by then);
  - first_batch_s: from the call to train_iterator to the first batch;
  - tokens_per_s: the iterator's throughput over those batches (one prefetch thread, as in training).
Orders: "blocks1" (the block order, the default) and "permutation" (the materialised per-epoch permutation of
every document used before it; a data position saved before the block order still resumes with it).
Ends with one JSON line. Targets (issue 32): memory and first-batch time grow < 2x from 10^5 to 10^7 documents.
"""

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_DOCS = flags.DEFINE_list("docs", ["100000", "1000000", "10000000"], "Corpus sizes in documents.")
_DIR = flags.DEFINE_string("dir", "/tmp/jaxtrain_scale", "Where the synthetic corpora are kept between runs.")
_BATCHES = flags.DEFINE_integer("batches", 200, "Batches read after the first one.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per row.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per batch.")
_MEASURE = flags.DEFINE_string("measure", "", "Internal: measure one corpus dir (order after a colon).")

SHARD_DOCS = 1 << 17


def write_corpus(path: str, docs: int) -> None:
    """Random documents of 4..60 uint16 tokens in the prepared-dir format (what the trainer reads)."""
    from jaxtrain.data import layout, writer

    if os.path.exists(os.path.join(path, layout.MANIFEST)):
        return
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(docs)
    rows, n_shards = [], -(-docs // SHARD_DOCS)
    for s in range(n_shards):
        n = min(SHARD_DOCS, docs - s * SHARD_DOCS)
        lengths = rng.integers(4, 61, n)
        tokens = rng.integers(3, 8192, int(lengths.sum()), dtype=np.uint16)
        parts = np.split(tokens, np.cumsum(lengths)[:-1])
        rows.append(writer.write_shard(os.path.join(path, f"train-{s:05d}-of-{n_shards:05d}.array_record"), parts))
    manifest = {"corpus": "synthetic", "dtype": "uint16", "tokenizer": {"sha256": "0" * 64, "file": ""},
                "splits": {"train": rows}}
    with open(os.path.join(path, layout.MANIFEST), "w") as f:
        json.dump(manifest, f)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(data_dir: str, order: str) -> dict:
    """In this (fresh) process: the iterator's memory and speed on one corpus."""
    from jaxtrain.data import pipeline

    base = _peak_rss_mb()
    t = time.perf_counter()
    it = pipeline.train_iterator(data_dir, seq_len=_SEQ_LEN.value, global_batch=_BATCH.value, seed=0)
    if order != pipeline.ORDER:
        it.set_state({k: v for k, v in it.get_state().items() if k != "order"})
    next(it)
    first = time.perf_counter() - t
    rss_first = _peak_rss_mb() - base
    t = time.perf_counter()
    for _ in range(_BATCHES.value):
        next(it)
    rate = _BATCHES.value * _BATCH.value * _SEQ_LEN.value / (time.perf_counter() - t)
    it.close()
    return {"rss_first_mb": rss_first, "rss_mb": _peak_rss_mb() - base, "first_batch_s": first, "tokens_per_s": rate}


def main(argv):
    del argv
    if _MEASURE.value:
        data_dir, order = _MEASURE.value.rsplit(":", 1)
        print(json.dumps(measure(data_dir, order)))
        return
    result = {}
    for docs in map(int, _DOCS.value):
        path = os.path.join(_DIR.value, f"docs_{docs}")
        t = time.perf_counter()
        write_corpus(path, docs)
        print(f"corpus of {docs:,} documents ready in {time.perf_counter() - t:.1f} s: {path}", file=sys.stderr)
        for order in ("blocks1", "permutation"):
            cmd = [sys.executable, __file__, f"--measure={path}:{order}", f"--batches={_BATCHES.value}",
                   f"--seq_len={_SEQ_LEN.value}", f"--batch={_BATCH.value}"]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            result[f"{order}_{docs}"] = out
            print(f"{docs:>11,} docs {order:>11}: RSS +{out['rss_first_mb']:8.1f} MB at the first batch, "
                  f"+{out['rss_mb']:8.1f} MB after {_BATCHES.value} more | first batch {out['first_batch_s']:6.2f} s "
                  f"| {out['tokens_per_s']:,.0f} tok/s", file=sys.stderr)
    sizes = sorted(map(int, _DOCS.value))
    if len(sizes) > 1:
        for order in ("blocks1", "permutation"):
            lo, hi = result[f"{order}_{sizes[0]}"], result[f"{order}_{sizes[-1]}"]
            result[f"{order}_growth"] = {k: hi[k] / max(lo[k], 1e-9) for k in ("rss_mb", "first_batch_s")}
            print(f"{order}: {sizes[0]:,} -> {sizes[-1]:,} documents: memory x{result[f'{order}_growth']['rss_mb']:.2f}"
                  f", first batch x{result[f'{order}_growth']['first_batch_s']:.2f}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    app.run(main)
