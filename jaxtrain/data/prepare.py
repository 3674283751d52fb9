"""Prepares your own files and datasets as tokenized ArrayRecord shards: what `jaxtrain prepare --input` runs.

It writes the format `jaxtrain.data.layout` reads: a record per document (its token ids and the EOS id, as
little-endian uint16, or int32 when the vocab does not fit 16 bits), indexes beside each shard, the tokenizer
and manifest.json. The inputs are planned as shards of about 256 MB of text, each tokenized by a worker
process (or an Apache Beam worker) into a sibling work dir `.<name>.partial`; the finished dir is renamed into
place whole. An interrupted run resumes there, redoing only unfinished shards; a rerun on the same inputs
touches nothing. The default corpus is corpus.py; encoding, encode.py; writing and the output dir, writer.py.
Its command line is `jaxtrain prepare` (jaxtrain.tools.prepare); docs/data.md has the formats.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time

import numpy as np

from jaxtrain import files
from jaxtrain.data import beam_runner, encode, layout, writer
from jaxtrain.data import sources as sources_lib
from jaxtrain.data import tokenizer as tok_lib
from jaxtrain.errors import DataError, SourceError, TokenizerError

SOURCES_FORMAT = 2  # layout of a `prepare --input` dir (inputs identified by content, per-shard heldout)
SHARD_BYTES = 256 << 20  # default text per train shard
TOKENIZER_SAMPLE_BYTES = 1 << 30  # at most this much train text teaches a new BPE
MAX_BAD_FRACTION = 0.001  # of the records read, malformed JSONL lines skipped before prepare gives up


@dataclasses.dataclass
class ShardPlan:
    index: int
    pieces: list  # [(source index, start, stop)], see sources.Source.pieces
    size: int  # estimated bytes of text
    heldout: int  # held-out documents drawn from this shard


def plan_shards(srcs: list, text_split: str, num_shards: int | None, heldout_docs: int) -> list[ShardPlan]:
    """Contiguous groups of source pieces of about equal text size, in input order; the held-out documents
    are spread over them in proportion to size (largest remainder), so no shard needs to see another."""
    total = sum(s.size for s in srcs)
    n = num_shards or max(1, -(-total // SHARD_BYTES))
    target = max(1, -(-total // n))
    pieces = [(i, a, b, size) for i, s in enumerate(srcs) for a, b, size in s.pieces(target, text_split)]
    sizes = np.array([p[3] for p in pieces], np.float64)
    # A piece goes to the shard its midpoint falls in: groups stay contiguous and near `target` each.
    mid = np.cumsum(sizes) - sizes / 2
    group = np.minimum((mid * n // max(total, 1)).astype(int), n - 1) if total else np.zeros(len(pieces), int)
    plans = []
    for g in sorted(set(group.tolist())):
        members = [p for p, k in zip(pieces, group) if k == g]
        plans.append(ShardPlan(len(plans), [p[:3] for p in members], int(sum(p[3] for p in members)), 0))
    share = np.array([p.size for p in plans], np.float64)
    share = share / share.sum() * heldout_docs if share.sum() else np.eye(len(plans))[0] * heldout_docs
    quota = np.floor(share).astype(int)
    quota[np.argsort(quota - share)[: heldout_docs - quota.sum()]] += 1
    for p, q in zip(plans, quota):
        p.heldout = int(q)
    return plans


def _shard_documents(srcs: list, plan: ShardPlan, text_split: str, seed: int, records: bool = False):
    """(train docs, heldout docs, per-source stats) of one shard. Stats are counted on private copies of
    the sources, so reading a shard twice (tokenizer sample, then the build) never double counts."""
    counted = {}
    docs = []
    for i, start, stop in plan.pieces:
        src = counted.setdefault(i, dataclasses.replace(srcs[i], docs=0, skipped=collections.Counter(),
                                                        text_bytes=0, malformed_at=[]))
        docs.extend(sources_lib.documents(src, text_split, start, stop, records=records))
    picked = np.random.default_rng(np.random.SeedSequence([seed, plan.index])).choice(
        len(docs), min(plan.heldout, len(docs)), replace=False)
    is_heldout = np.zeros(len(docs), bool)
    is_heldout[picked] = True
    train = [d for d, h in zip(docs, is_heldout) if not h]
    heldout = [d for d, h in zip(docs, is_heldout) if h]
    stats = {i: {"docs": s.docs, "skipped": dict(s.skipped), "text_bytes": s.text_bytes,
                 "malformed_at": s.malformed_at} for i, s in counted.items()}
    return train, heldout, stats


def _build_shard(job: dict) -> dict:
    """Reads, splits, tokenizes and writes one shard into the work dir; its `.done.json` record, written
    last and atomically, is what marks it finished. Runs in a worker process (or in-process)."""
    plan, work, n, chat = job["plan"], job["work_dir"], job["num_shards"], job["chat"]
    train, heldout, stats = _shard_documents(job["sources"], plan, job["text_split"], job["seed"], bool(chat))
    # A Hugging Face directory's tokenizer was copied in with its tokenizer_config.json: the work dir reads as it.
    tok = tok_lib.load(work if job["tokenizer_dir"] else os.path.join(work, job["tokenizer_file"]), job["eos_token"])
    dtype = np.dtype(job["dtype"])
    record = {"key": job["key"], "index": plan.index, "sources": stats, "train": None, "heldout": None}
    if chat:
        record["chat"] = collections.Counter()
    for split, docs in (("train", train), ("heldout", heldout)):
        if not docs and split == "heldout":
            continue
        path = os.path.join(work, f"{split}-{plan.index:05d}-of-{n:05d}.array_record")
        if chat:
            ids, weights = encode.encode_conversations(tok, docs, dtype, chat, record["chat"])
            record[split] = writer.write_shard(path, ids, weights)
        else:
            record[split] = writer.write_shard(path, encode.tokenize(tok, docs, dtype))
    files.write_json(os.path.join(work, writer.done_name(plan.index)), record)
    return record


def _input_identities(srcs: list, previous: dict | None) -> list[dict]:
    """What "the same inputs" means to a rerun: each file's sha256 (datasets: their own identity). A file
    whose path, size and mtime match the previous run's record keeps its recorded hash unread."""
    # The manifest keeps mtimes apart from `inputs` (which must compare equal across touches): `input_mtimes`.
    rows = (previous or {}).get("inputs", [])
    mtimes = (previous or {}).get("input_mtimes") or [None] * len(rows)
    known = {(r["path"], r["bytes"], r.get("mtime_ns", m)): r["sha256"]
             for r, m in zip(rows, mtimes) if "sha256" in r and r.get("mtime_ns", m)}
    out = []
    for s in srcs:
        if s.dataset is not None:
            out.append({"path": s.path, "kind": s.kind, "identity": s.dataset.identity})
            continue
        sha = known.get((s.path, s.size, s.mtime_ns)) or sources_lib.file_sha256(s.path)
        out.append({"path": s.path, "kind": s.kind, "bytes": s.size, "mtime_ns": s.mtime_ns, "sha256": sha})
    return out


def _comparable(inputs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "mtime_ns"} for r in inputs]


def prepare_sources(
    data_dir: str,
    inputs: list[str],
    *,
    fmt: str | None = None,
    field: str = "text",
    text_split: str = "file",
    tokenizer: str | None = None,
    eos_token: str | None = None,
    vocab_size: int = 8192,
    heldout_docs: int = 200,
    seed: int = 0,
    num_shards: int | None = None,
    workers: int | None = None,
    split: str = "train",
    tfds_data_dir: str | None = None,
    chat: bool = False,
    chat_template: str | None = None,
    max_len: int | None = None,
    truncate: str = "left",
    preference: bool = False,
    max_bad_fraction: float = MAX_BAD_FRACTION,
    runner: str | None = None,
    beam_options: str = "",
    print_fn=print,
) -> dict:
    """Prepares (or reuses, or finishes) data_dir from files and datasets (see sources.py); returns the
    manifest. `workers` processes tokenize shards in parallel (default: one per CPU, at most one per shard);
    they are spawned, so a script calling this with workers > 1 needs the usual `if __name__ == "__main__":`.
    `chat`: conversations rendered with the tokenizer directory's chat template (or `chat_template`, a file),
    with loss weights; `max_len` and `truncate` ("left" or "drop") bound a conversation's tokens. `preference`:
    pairs {"prompt", "chosen", "rejected"} for DPO, as chat data (implies `chat`), stored chosen then rejected.
    `max_bad_fraction`: JSONL lines that are not JSON objects are skipped and counted up to this fraction of all
    records read; past it DataError (the finished shards are kept, so a rerun with a higher limit resumes). 0
    raises on the first one. `runner`: build the shards on this Apache Beam runner instead of `workers`
    processes (beam_runner.py; the same bytes), with `beam_options` ("--flag=value ...")."""
    if tokenizer and not os.path.exists(tokenizer):
        raise DataError(f"{tokenizer}: tokenizer not found")
    if runner:
        beam_runner.pipeline(runner, beam_options)  # a bad runner or option fails now, not after the tokenizer
    chat_settings = encode.chat_settings(tokenizer, chat_template, max_len, truncate, preference) \
        if chat or preference else None
    if heldout_docs < 1:
        raise DataError(f"heldout_docs must be >= 1, got {heldout_docs}")
    if not 0 <= max_bad_fraction <= 1:
        raise DataError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    if not tokenizer and vocab_size < 258:  # 256 byte tokens + 2 special tokens.
        raise DataError(f"vocab_size must be >= 258, got {vocab_size}")
    tok = layout.open_tokenizer(tokenizer, eos_token) if tokenizer else None
    srcs = sources_lib.expand(inputs, fmt, field, split=split, tfds_data_dir=tfds_data_dir)
    for s in srcs:
        s.strict = max_bad_fraction == 0
    data_dir = writer.local_output(data_dir)
    start = time.perf_counter()
    with writer.locked(data_dir):
        previous = None
        if os.path.exists(os.path.join(data_dir, layout.MANIFEST)):
            previous = layout.load_manifest(data_dir)
        elif os.path.exists(state := os.path.join(writer.work_path(data_dir), "settings.json")):
            with contextlib.suppress(OSError, json.JSONDecodeError), open(state) as f:
                previous = json.load(f)
        identities = _input_identities(srcs, previous)
        settings = {
            "format": SOURCES_FORMAT,
            "corpus": "sources",
            "inputs": _comparable(identities),
            "field": field,
            "text_split": text_split,
            "split": split if any(s.dataset for s in srcs) else None,
            "vocab_size": None if tokenizer else vocab_size,
            "tokenizer_sha256": _tokenizer_hash(tokenizer) if tokenizer else None,
            "eos_token": eos_token,
            "heldout_docs": heldout_docs,
            "seed": seed,
            "num_shards": num_shards,
        }
        if chat_settings:
            settings["chat"] = {k: v for k, v in chat_settings.items() if k not in ("template", "variables")}
        if existing := writer.existing_manifest(data_dir, settings):
            return existing
        work = writer.work_dir(data_dir, settings, [r.get("mtime_ns") for r in identities], print_fn)
        try:
            manifest = _prepare_sources_into(work, data_dir, srcs, inputs, settings, identities, tok, tokenizer, eos_token,
                                             text_split, num_shards, heldout_docs, seed, vocab_size, workers,
                                             print_fn, chat_settings, max_bad_fraction, runner, beam_options)
        except TooManyMalformed:
            raise  # the shards are good: a rerun with a higher limit finishes from them
        except (DataError, SourceError, TokenizerError):
            shutil.rmtree(work, ignore_errors=True)  # bad input: nothing worth resuming, nothing left beside it
            raise

    seconds = time.perf_counter() - start
    skipped = collections.Counter()
    for s in srcs:
        skipped.update(s.skipped)
    # and the conversations or pairs chat preparation skipped (not conversations, template failures, too long)
    skipped.update({k: v for k, v in (manifest.get("chat") or {}).items() if k.startswith(("skipped_", "dropped_"))})
    tokens = sum(s["tokens"] for split_rows in manifest["splits"].values() for s in split_rows)
    docs = sum(s["docs"] for split_rows in manifest["splits"].values() for s in split_rows)
    held = sum(s["docs"] for s in manifest["splits"]["heldout"])
    text_bytes = sum(s.text_bytes for s in srcs)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
    if malformed := sum(skipped[r] for r in sources_lib.MALFORMED):
        shown = [w for s in srcs for w in s.malformed_at][:sources_lib.MALFORMED_SHOWN]
        print_fn(f"prepare: warning: skipped {malformed} malformed JSONL lines (within --max_bad_fraction "
                 f"{max_bad_fraction:g}); the first: " + "; ".join(shown), file=sys.stderr)
    print_fn(
        f"prepared {len(srcs)} {'files' if not any(s.dataset for s in srcs) else 'inputs'} in {seconds:.1f}s:"
        f" {docs} docs / {tokens} tokens (heldout {held} docs), {len(manifest['splits']['train'])} shards,"
        f" skipped {sum(skipped.values())}{f' ({reasons})' if reasons else ''},"
        f" {text_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s of text -> {data_dir}",
        flush=True,
    )
    return manifest


def _prepare_sources_into(work, data_dir, srcs, inputs, settings, identities, tok, tokenizer, eos_token, text_split,
                          num_shards, heldout_docs, seed, vocab_size, workers, print_fn, chat=None,
                          max_bad_fraction=MAX_BAD_FRACTION, runner=None, beam_options="") -> dict:
    """Tokenizes `srcs` into the work dir, then renames it to data_dir; returns the manifest."""
    plans = plan_shards(srcs, text_split, num_shards, heldout_docs)
    tok_file, tok = _tokenizer_into(work, tok, tokenizer, srcs, plans, text_split, seed, vocab_size)
    dtype = np.dtype("<u2") if tok.vocab_size <= 2**16 else np.dtype("<i4")
    if chat:  # the template the shards were rendered with travels with them (generate --chat reads it)
        with open(os.path.join(work, encode.CHAT_TEMPLATE), "w", encoding="utf-8") as f:
            f.write(chat["template"])
    records = _build_shards(work, srcs, plans, text_split, seed, tok_file, tok.hf_dir is not None, eos_token, dtype,
                            workers, print_fn, chat, runner, beam_options)

    # Shards counted on private copies of the sources (see _shard_documents): their sums go on srcs.
    for r in records:
        for i, st in r["sources"].items():
            src = srcs[int(i)]
            src.docs += st["docs"]
            src.skipped.update(st["skipped"])
            src.text_bytes += st["text_bytes"]
            src.malformed_at = (src.malformed_at + st.get("malformed_at", []))[:sources_lib.MALFORMED_SHOWN]
    _check_malformed(srcs, max_bad_fraction)
    counts = collections.Counter()
    if chat:
        for r in records:
            counts.update(r["chat"])
        _report_template_failures(counts, inputs, print_fn)
    train_rows = [r["train"] for r in records]
    heldout_rows = [r["heldout"] for r in records if r["heldout"]]
    if not sum(r["docs"] for r in train_rows):
        read = sum(s.docs + sum(s.skipped.values()) for s in srcs)
        if not chat and read and sum(s.skipped["missing_field"] for s in srcs) == read:
            field = settings.get("field", "text")
            raise DataError(f"{', '.join(inputs)}: no record has the {field!r} field (--field); conversations "
                            f"('messages', or 'prompt' and 'completion') are read with --chat")
        raise DataError(f"{', '.join(inputs)}: no documents left for training after {sum(r['docs'] for r in heldout_rows)}"
                        f" held-out ones; add data or lower --heldout_docs")
    if (held_total := sum(r["docs"] for r in heldout_rows)) < heldout_docs:
        # Quotas follow text size: a shard of few, long documents may have fewer than its share.
        print_fn(f"prepare: warning: {held_total} held-out documents instead of --heldout_docs {heldout_docs}: "
                 f"some shards had fewer documents than their share", file=sys.stderr)
    manifest = {
        **settings,
        "input_mtimes": [r.get("mtime_ns") for r in identities],
        "dtype": dtype.name,
        "byte_order": "little",
        "pad_id": tok_lib.PAD_ID if not tokenizer else None,
        "eos_id": tok.eos_id,
        "tokenizer": {"file": tok_file, "sha256": files.file_hash(os.path.join(work, tok_file)),
                      "kind": tok.kind, **_hf_dir_entry(work, tok)},
        "splits": {"train": train_rows, "heldout": heldout_rows},
        "sources": [s.row() for s in srcs],
    }
    if chat:
        counts = collections.Counter({k: v for k, v in counts.items() if not k.startswith(encode.REASON)})
        counts["longest"] = max(r["chat"].get("longest", 0) for r in records)  # a maximum, not a sum
        manifest["loss_weights"] = True
        if chat.get("preference"):
            manifest["pairs"] = True  # records come in (chosen, rejected) twos
        manifest["chat"] = {**settings["chat"], "template_file": encode.CHAT_TEMPLATE, **dict(sorted(counts.items()))}
    for r in range(len(plans)):
        os.remove(os.path.join(work, writer.done_name(r)))
    os.remove(os.path.join(work, "settings.json"))
    files.write_json(os.path.join(work, layout.MANIFEST), manifest)
    if os.path.isdir(data_dir):
        os.rmdir(data_dir)  # an empty dir (checked above) is replaced
    os.rename(work, data_dir)
    return manifest


def _report_template_failures(counts: collections.Counter, inputs: list, print_fn) -> None:
    """A template that failed on every record is the error (its own message, not "no documents left"); one that
    failed on some is a warning with the first reasons."""
    failed, reasons = encode.template_failures(counts)
    if not failed:
        return
    if not (counts["conversations"] or counts["pairs"]):
        raise DataError(f"{', '.join(inputs)}: the chat template failed on all {failed} records: {reasons[0]}")
    print_fn(f"prepare: warning: the chat template failed on {failed} records, which are skipped: "
             + "; ".join(reasons), file=sys.stderr)


class TooManyMalformed(DataError):
    """More malformed JSONL lines than --max_bad_fraction allows (the shards built are kept for a rerun)."""


def _check_malformed(srcs: list, max_bad_fraction: float) -> None:
    malformed = sum(s.skipped[r] for s in srcs for r in sources_lib.MALFORMED)
    read = sum(s.docs + sum(s.skipped.values()) for s in srcs)
    if malformed > max_bad_fraction * read:
        first = next(w for s in srcs for w in s.malformed_at)
        raise TooManyMalformed(f"{malformed} of {read} records ({malformed / read:.2%}) are malformed JSONL lines, "
                               f"past --max_bad_fraction {max_bad_fraction:g}; the first: {first}. Fix the input or "
                               f"raise the limit: the finished shards are kept, so a rerun resumes")


def _tokenizer_hash(given: str) -> str:
    """sha256 of a tokenizer file; of a Hugging Face directory, of both files that decide its encoding."""
    if not os.path.isdir(given):
        return files.file_hash(given)
    parts = [files.file_hash(p) if os.path.isfile(p) else "" for p in
             (os.path.join(given, n) for n in (tok_lib.HF_TOKENIZER, tok_lib.HF_TOKENIZER_CONFIG))]
    return hashlib.sha256(json.dumps(["hf_dir", *parts]).encode()).hexdigest()


def _hf_dir_entry(work: str, tok: tok_lib.Tokenizer) -> dict:
    """The manifest's record that the data dir reads as the Hugging Face directory it was made with."""
    if tok.hf_dir is None:
        return {}
    config = os.path.join(work, tok_lib.HF_TOKENIZER_CONFIG)
    return {"hf_dir": True, "config_sha256": files.file_hash(config) if os.path.exists(config) else None}


def _tokenizer_into(work, tok, given, srcs, plans, text_split, seed, vocab_size):
    """Copies the given tokenizer into the work dir (a Hugging Face directory's tokenizer.json with its
    tokenizer_config.json), or trains a BPE on (a sample of) the train documents; an interrupted run's
    tokenizer is reused. Returns (file name in the dir, Tokenizer)."""
    if given:
        if tok.hf_dir is not None:
            copies = [(os.path.join(given, n), n) for n in (tok_lib.HF_TOKENIZER, tok_lib.HF_TOKENIZER_CONFIG)
                      if os.path.isfile(os.path.join(given, n))]
            name = layout.TOKENIZER
        else:
            name = layout.TOKENIZER_SPM if given.endswith(tok_lib.SENTENCEPIECE_SUFFIX) else layout.TOKENIZER
            copies = [(given, name)]
        for src, dst in copies:
            if not os.path.exists(os.path.join(work, dst)):
                shutil.copyfile(src, os.path.join(work, dst + ".tmp"))  # the data dir must be self-contained
                os.replace(os.path.join(work, dst + ".tmp"), os.path.join(work, dst))
        return name, tok
    path = os.path.join(work, layout.TOKENIZER)
    if not os.path.exists(path):
        # Train on train documents only, so held-out loss is not flattered by the vocab. A corpus larger
        # than the sample budget contributes whole shards in a seeded order until the budget is spent.
        total = sum(p.size for p in plans)
        order = range(len(plans)) if total <= TOKENIZER_SAMPLE_BYTES else \
            np.random.default_rng(seed).permutation(len(plans)).tolist()

        def sample():
            seen = 0
            for k in order:
                train, _, _ = _shard_documents(srcs, plans[k], text_split, seed)
                for doc in train:
                    if seen >= TOKENIZER_SAMPLE_BYTES:
                        return
                    seen += len(doc)
                    yield doc

        tok_lib.train_bpe(sample(), vocab_size).save(path + ".tmp")
        os.replace(path + ".tmp", path)
    return layout.TOKENIZER, tok_lib.load(path)


def _build_shards(work, srcs, plans, text_split, seed, tok_file, tok_dir, eos_token, dtype, workers,
                  print_fn, chat=None, runner=None, beam_options="") -> list[dict]:
    """Builds every shard not already finished in `work`, in parallel worker processes (or on Beam's `runner`),
    with a progress line."""
    tok_sha = files.file_hash(os.path.join(work, tok_file))
    jobs, records = [], {}
    for plan in plans:
        # The work dir only survives with identical settings (inputs included), so a finished shard is
        # reused when its plan and the tokenizer are the same too.
        key = hashlib.sha256(json.dumps([plan.pieces, plan.heldout, len(plans), tok_sha, dtype.name]).encode())
        key = key.hexdigest()
        if done := writer.finished_shard(work, plan.index, key):
            records[plan.index] = done
        else:
            jobs.append({"plan": plan, "work_dir": work, "num_shards": len(plans), "sources": srcs,
                         "text_split": text_split, "seed": seed, "tokenizer_file": tok_file, "tokenizer_dir": tok_dir,
                         "eos_token": eos_token, "dtype": dtype.name, "key": key, "chat": chat})
    if records:
        print_fn(f"prepare: resuming, {len(records)} of {len(plans)} shards already done", file=sys.stderr)
    todo = sum(j["plan"].size for j in jobs)
    t0, done_bytes = time.perf_counter(), 0

    def progress(record):
        nonlocal done_bytes
        records[record["index"]] = record
        done_bytes += plans[record["index"]].size
        if len(plans) > 1:
            rate = done_bytes / max(time.perf_counter() - t0, 1e-9)
            eta = (todo - done_bytes) / max(rate, 1e-9)
            print_fn(f"prepare: shard {len(records)}/{len(plans)} | {done_bytes / 1e6:,.1f} of {todo / 1e6:,.1f} MB "
                     f"| {rate / 1e6:.1f} MB/s | ETA {int(eta) // 60}m{int(eta) % 60:02d}s", file=sys.stderr)

    workers = min(workers or len(os.sched_getaffinity(0)), len(jobs))  # the CPUs this process may use
    if runner and jobs:
        print_fn(f"prepare: {len(jobs)} shards on Apache Beam's {runner}", file=sys.stderr)
        beam_runner.run(jobs, _build_shard, runner, beam_options)
        for job in jobs:  # each worker left its shard's record in the work dir
            if (record := writer.finished_shard(work, job["plan"].index, job["key"])) is None:
                raise DataError(f"{work}: the Beam pipeline finished without shard {job['plan'].index}")
            progress(record)
    elif workers <= 1:
        for job in jobs:
            progress(_build_shard(job))
    else:
        # spawn, not fork: the caller may be a process with JAX's threads running (train.run, tests).
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_quiet_worker) as pool:
            futures = [pool.submit(_build_shard, job) for job in jobs]
            try:
                for f in concurrent.futures.as_completed(futures):
                    progress(f.result())
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    return [records[p.index] for p in plans]


def _quiet_worker():
    # Each worker is one of several processes: Rust threads inside each would only oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


if __name__ == "__main__":  # the command moved to `jaxtrain prepare`
    from jaxtrain.compat import old_paths

    old_paths.run("jaxtrain.data.prepare")
