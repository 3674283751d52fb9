"""Input pipeline: ArrayRecord documents -> packed, batched numpy dicts, as a pure function of position.

The train split is one endless token stream (each epoch's documents in a seeded block order, order.py). Row r
is the `seq_len` tokens from token `r * seq_len`, global batch k holds rows k*B .. k*B+B-1, and each process
builds only its own block of rows. So the batch at step k is the same on 1 host or 64, and the iterator
state is one number, the next token offset: a checkpoint restores on any process count, batch size or
sequence length without repeating or skipping a token (elastic resume).

A batch is {"tokens", "segment_ids", "positions"}, each int32[B // processes, seq_len]: segment ids number the
documents of a row from 1, and positions restart at each document. Documents are never padded or dropped.
records.py reads the shards lazily; Grain prefetches (optionally in worker processes); the packing itself is
random access, which is what makes it position-addressable (docs/data.md). Chat data (`prepare --chat`) adds
"loss_weights" and is packed by whole conversations instead: a row holds the conversations that fit, then
padding (segment 0), and rows are addressed by number (the offset counts seq_len slots per row). Preference
pairs (`prepare --preference`) are packed and shuffled as units, so pair j of a row is segments 2j+1 (chosen)
and 2j+2 (rejected).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import signal
import threading
import time
import weakref

import grain
import numpy as np
from absl import flags

from jaxtrain import files, storage
from jaxtrain.data import order as order_lib
from jaxtrain.data import records
from jaxtrain.data.layout import content_id, load_manifest
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.fields import Group

_KEYS = ("tokens", "segment_ids", "positions")
# The config's `data` group. `dir` empty = ~/.cache/jaxtrain/data/<corpus>_v<vocab_size>_h<heldout_docs>, the
# default corpus prepared on first use (layout.default_dir). `vocab_size`: the default corpus tokenizer's (a data.dir
# prepared by `jaxtrain prepare` has its own, checked at open); it may be smaller than
# model.vocab_size (padding rows for better matmul shapes). `mixture` (optional): train on several prepared dirs with
# weights, "dirA:0.7,dirB:0.3", all tokenized with `dir`'s tokenizer; `dir` still supplies the tokenizer and the
# held-out split. `num_workers` > 0: build train batches in that many Grain worker processes (the same batches);
# 0 = one prefetch thread in the trainer, which is faster on a few CPU cores.
# `allow_changed`: resume although the train data differs from what the checkpoint's position refers to (another
# dir, or the same dir prepared again with other content); the run logs the change. Off: such a resume exits 2.
CONFIG = dict(corpus="kjv", dir="", vocab_size=8192, heldout_docs=200, mixture="", num_workers=0,
              allow_changed=False)


def check_config(data, *, model_vocab_size: int) -> None:
    """ConfigError naming the first bad field of the `data` group."""
    g = Group(data, "data")
    if data.corpus != "kjv":
        raise ConfigError("data.corpus", f"unknown corpus {data.corpus!r}; only 'kjv' ships so far")
    g.positive_int("vocab_size")
    if data.vocab_size < 258:
        raise ConfigError("data.vocab_size", f"must be at least 258 (256 bytes + 2 special tokens), "
                          f"got {data.vocab_size}")
    if data.vocab_size > model_vocab_size and not data.dir:  # a data.dir's own tokenizer is checked at open
        raise ConfigError("model.vocab_size", f"{model_vocab_size} is smaller than the tokenizer's "
                          f"data.vocab_size={data.vocab_size}")
    g.positive_int("heldout_docs")
    if data.mixture:
        try:
            parse_mixture(data.mixture)
        except ValueError as e:
            raise ConfigError("data.mixture", str(e)) from None
    g.positive_int("num_workers", allow_zero=True)
    g.choice("allow_changed", (True, False))


def check_eval_sets(spec) -> None:
    """ConfigError for an `eval.sets` that does not parse (the dirs are checked when the run opens them)."""
    if not isinstance(spec, str):
        raise ConfigError("eval.sets", f"must be a string \"name=DIR,...\", got {spec!r}")
    if spec:
        try:
            parse_eval_sets(spec)
        except ValueError as e:
            raise ConfigError("eval.sets", str(e)) from None


# The train order: "blocks1" = order.BlockOrder with WINDOW_BLOCKS blocks a window. Saved with the data position;
# a position saved without one (before the block order) resumes in the order it was made in, LEGACY_ORDER.
ORDER, LEGACY_ORDER = "blocks1", "permutation"
WINDOW_BLOCKS = 16


class PackedStream:
    """Random access to the packed token stream of one split.

    `seed=None` keeps the file order in every epoch (eval); otherwise epoch e is the block order of (seed, e)
    (order.py): windows of WINDOW_BLOCKS random blocks, each window's documents shuffled, so nearby seeds and
    epochs are uncorrelated and only one window's documents are ever in memory.
    """

    def __init__(self, data_dir: str, split: str, seed: int | None, *, window_blocks: int = WINDOW_BLOCKS):
        manifest = load_manifest(data_dir)
        if split not in manifest["splits"]:
            raise DataError(f"{data_dir}: no split {split!r} (has {sorted(manifest['splits'])})")
        self.data_dir, self.shards = data_dir, manifest["splits"][split]
        sizes = storage.sizes(data_dir, [s["file"] for s in self.shards])
        for s, size in zip(self.shards, sizes):
            if size is None:
                raise DataError(f"{os.path.join(data_dir, s['file'])}: missing shard of split {split!r}")
        self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self.seed = seed
        self.identity = f"{manifest['tokenizer']['sha256'][:16]}/{split}"  # what a saved position refers to
        self.content = content_id(manifest, split)  # and the documents it counts through
        self.weighted = bool(manifest.get("loss_weights"))  # chat data: a uint8 weight per token after the tokens
        self.row_addressed = self.weighted  # whole conversations per row: a position is a row, not a token
        try:
            self.records = records.Split(data_dir, self.shards, self.dtype, self.weighted, sizes)
            self.records.verify()
        except RuntimeError as e:  # Riegeli found a damaged file
            raise self._damaged(e) from None
        if self.records.n_records == 0:
            raise DataError(f"{data_dir}: split {split!r} has no documents")
        # What is shuffled and packed whole: a document, or preference data's (chosen, rejected) pair of records.
        self.group = 2 if manifest.get("pairs") else 1
        if self.records.n_records % self.group:
            raise DataError(f"{data_dir}: split {split!r} holds {self.records.n_records} records, not whole pairs; "
                            f"prepare the data again")
        self.epoch_tokens = int(self.records.block_tokens.sum())
        self.blocks = order_lib.BlockOrder(self.records.block_tokens, seed, window_blocks)
        self.use_order(ORDER)

    def data_dirs(self) -> str:
        return self.data_dir

    def use_order(self, name: str) -> None:
        """Switches to the train order `name` (ORDER, or LEGACY_ORDER for a position saved before it)."""
        if name not in (ORDER, LEGACY_ORDER):
            raise DataError(f"checkpointed data position uses document order {name!r}; this version knows "
                            f"{ORDER!r} and {LEGACY_ORDER!r}: resume it with the jaxtrain that saved it")
        self.order_name = name
        self._windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._row_starts: dict[tuple[int, int, int], np.ndarray] = {}
        self._row_ends: dict[int, list[int]] = {}  # seq_len -> cumulative rows of windows (0,0), (0,1), ...
        self._unit_lengths = None
        if name == LEGACY_ORDER:  # every document's length in memory, as that order was made with
            lengths = self.records.all_lengths()
            self._unit_lengths = lengths.reshape(-1, self.group).sum(1)

    @property
    def n_windows(self) -> int:
        return 1 if self._unit_lengths is not None else self.blocks.n_windows

    def document_lengths(self) -> np.ndarray:
        """Every record's tokens, in file order (O(documents) memory: for tests and tools)."""
        return self.records.all_lengths()

    def _damaged(self, error: RuntimeError) -> DataError:
        """The shard that fails its manifest checksum (hashed only now, on failure), named with the fix."""
        bad = next((s["file"] for s in self.shards
                    if s.get("sha256") and files.file_hash(os.path.join(self.data_dir, s["file"])) != s["sha256"]),
                   None)
        where = os.path.join(self.data_dir, bad) if bad else f"a shard in {self.data_dir}"
        return DataError(f"{where}: damaged ({str(error).splitlines()[0][:120]}); prepare the data dir again "
                         f"(for the default corpus: delete {self.data_dir} and rerun)")

    def _window_ends(self, epoch: int) -> np.ndarray:
        """Exclusive end, in tokens from the epoch's start, of each window of the epoch."""
        if self._unit_lengths is not None:
            return np.array([self.epoch_tokens])
        return self.blocks.window_ends(epoch)

    def window(self, epoch: int, w: int) -> tuple[np.ndarray, np.ndarray]:
        """(units, exclusive end offset of each within the window) of window w of an epoch, in stream order."""
        if (epoch, w) not in self._windows:
            if self._unit_lengths is not None:
                n = len(self._unit_lengths)
                units = np.arange(n) if self.seed is None else \
                    np.random.default_rng(np.random.SeedSequence([self.seed, epoch])).permutation(n)
                lengths = self._unit_lengths[units]
            else:
                blocks = self.blocks.blocks(epoch, w)
                first, count = self.records.block_first[blocks], self.records.block_records[blocks]
                units = np.concatenate([np.arange(f, f + c) for f, c in zip(first, count)]) // self.group
                lengths = np.concatenate([self.records.block_lengths(b) for b in blocks.tolist()])
                units, lengths = units[::self.group], lengths.reshape(-1, self.group).sum(1)
                inner = self.blocks.inner(epoch, w, len(units))
                units, lengths = units[inner], lengths[inner]
            if len(self._windows) >= 3:  # rows straddle at most neighbouring windows
                self._windows.pop(next(iter(self._windows)))
            self._windows[(epoch, w)] = (units, np.cumsum(lengths))
        return self._windows[(epoch, w)]

    def pieces(self, start: int, length: int):
        """The documents covering stream tokens [start, start + length): (doc id, first, stop) triples."""
        out = []
        while length > 0:
            epoch, offset = divmod(start, self.epoch_tokens)
            window_ends = self._window_ends(epoch)
            w = int(np.searchsorted(window_ends, offset, side="right"))
            offset -= int(window_ends[w - 1]) if w else 0
            units, ends = self.window(epoch, w)
            k = int(np.searchsorted(ends, offset, side="right"))
            doc_start = int(ends[k - 1]) if k else 0
            first = offset - doc_start
            take = min(length, int(ends[k]) - doc_start - first)
            out.append((int(units[k]), first, first + take))
            start, length = start + take, length - take
        return out

    def _packed_rows(self, epoch: int, w: int, seq_len: int) -> np.ndarray:
        """Chat data: index (in the window's order) of each row's first conversation, and the count at the end.
        Greedy: a conversation that does not fit in what is left of a row starts the next one; rows never
        straddle windows."""
        if (epoch, w, seq_len) not in self._row_starts:
            _, ends = self.window(epoch, w)
            lengths = np.diff(ends, prepend=0)
            if (longest := int(lengths.max())) > seq_len:
                raise DataError(f"{self.data_dir}: holds a {'pair' if self.group > 1 else 'conversation'} of "
                                f"{longest} tokens, longer than "
                                f"train.seq_len={seq_len}; prepare it with --max_len {seq_len}")
            starts, fill = [0], 0
            for i, n in enumerate(lengths.tolist()):
                if fill + n > seq_len:
                    starts.append(i)
                    fill = 0
                fill += n
            if len(self._row_starts) >= 3:
                self._row_starts.pop(next(iter(self._row_starts)))
            self._row_starts[(epoch, w, seq_len)] = np.array(starts + [len(lengths)])
        return self._row_starts[(epoch, w, seq_len)]

    def _locate_row(self, row: int, seq_len: int) -> tuple[int, int, int]:
        """(epoch, window, row within it) of chat row `row`: windows hold different numbers of rows. Finding a
        row packs every window before it once (lengths only); the counts are kept, an int per window."""
        ends = self._row_ends.setdefault(seq_len, [])
        while not ends or ends[-1] <= row:
            epoch, w = divmod(len(ends), self.n_windows)
            ends.append((ends[-1] if ends else 0) + len(self._packed_rows(epoch, w, seq_len)) - 1)
        i = bisect.bisect_right(ends, row)
        epoch, w = divmod(i, self.n_windows)
        return epoch, w, row - (ends[i - 1] if i else 0)

    def _index_mismatch(self, doc: int, tokens: int) -> DataError:
        shard = int(np.searchsorted(self.records.starts, doc, side="right")) - 1
        return DataError(f"{self.records.paths[shard]}: record {doc - int(self.records.starts[shard])} holds {tokens} "
                         f"tokens, not what its lengths index ({self.shards[shard].get('lengths')}) says; the index "
                         f"does not match the shard: prepare the data again")

    def _records(self, docs: list[int]) -> list[bytes]:
        """The documents' raw records; a damaged shard is a DataError naming it."""
        try:
            return self.records.read(docs)
        except RuntimeError as e:
            raise self._damaged(e) from None

    def _conversations_row(self, start: int, seq_len: int) -> dict:
        epoch, w, k = self._locate_row(start // seq_len, seq_len)
        units, _ = self.window(epoch, w)
        starts = self._packed_rows(epoch, w, seq_len)
        docs = [unit * self.group + i for unit in units[starts[k]:starts[k + 1]].tolist() for i in range(self.group)]
        row = {key: np.zeros(seq_len, np.int32) for key in (*_KEYS, "loss_weights")}
        at = 0
        for segment, (doc, record) in enumerate(zip(docs, self._records(docs)), start=1):
            n = len(record) // self.records.record_width
            if at + n > seq_len:  # packed by the lengths index, which says this record is shorter
                raise self._index_mismatch(doc, n)
            row["tokens"][at:at + n] = np.frombuffer(record, self.dtype, n)
            row["loss_weights"][at:at + n] = np.frombuffer(record, np.uint8, n, offset=n * self.dtype.itemsize)
            row["segment_ids"][at:at + n] = segment
            row["positions"][at:at + n] = np.arange(n)
            at += n
        return row

    def row(self, start: int, seq_len: int) -> dict:
        """`seq_len` tokens from stream offset `start`, with segment ids and positions (chat data: the row of
        whole conversations numbered start // seq_len, with its loss weights, padded)."""
        if self.weighted:
            return self._conversations_row(start, seq_len)
        pieces = self.pieces(start, seq_len)
        records = self._records([doc for doc, _, _ in pieces])
        tokens, segment_ids, positions = [], [], []
        for segment, ((doc, first, stop), record) in enumerate(zip(pieces, records), start=1):
            if stop > (have := len(record) // self.dtype.itemsize):  # the lengths index says it is longer
                raise self._index_mismatch(doc, have)
            tokens.append(np.frombuffer(record, self.dtype)[first:stop])
            segment_ids.append(np.full(stop - first, segment, np.int32))
            positions.append(np.arange(stop - first, dtype=np.int32))
        return {"tokens": np.concatenate(tokens).astype(np.int32), "segment_ids": np.concatenate(segment_ids),
                "positions": np.concatenate(positions)}


class MixedStream:
    """A weighted mixture of several prepared datasets, row-addressable like one stream.

    Rows are taken in blocks of BLOCK: in every block, dataset d gets its exact quota round(w_d * BLOCK)
    (largest remainder, so the quotas fill the block), in a seeded order that changes per block. Row r is
    therefore a pure function of (seed, r): dataset d's n-th row in the mixture is row n of d's own
    stream, so no dataset row is repeated or skipped, and the realised proportions are exact per block.
    Resuming with another train.seq_len is refused (rows, not tokens, are the unit here).
    """

    BLOCK = 10_000

    def __init__(self, streams: list[PackedStream], weights: list[float], seed: int):
        if len(streams) != len(weights) or not streams or min(weights) <= 0:
            raise DataError(f"a mixture needs one positive weight per dataset, got {weights}")
        share = np.asarray(weights, np.float64) / sum(weights) * self.BLOCK
        quotas = np.floor(share).astype(np.int64)
        quotas[np.argsort(quotas - share)[: self.BLOCK - quotas.sum()]] += 1  # largest remainders first
        if (quotas == 0).any():
            raise DataError(f"mixture weight {min(weights)} is below 1/{self.BLOCK} of the total")
        self.streams, self.quotas, self.seed = streams, quotas, seed
        self.identity = "mix(" + ",".join(f"{s.identity}:{q}" for s, q in zip(streams, quotas)) + ")"
        self.content = hashlib.sha256(",".join(s.content for s in streams).encode()).hexdigest()[:16]
        self._slots = np.repeat(np.arange(len(streams)), quotas)
        self.row_addressed = True
        if len({s.weighted for s in streams}) > 1:
            raise DataError("a mixture cannot mix chat data (loss weights) with plain documents")
        self.weighted = streams[0].weighted
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset of each row in block k, that row's rank among the block's rows of its dataset)."""
        if k not in self._blocks:
            which = np.random.default_rng(np.random.SeedSequence([self.seed, k, 7])).permutation(self._slots)
            rank = np.empty_like(which)
            for d in range(len(self.streams)):
                rows = which == d
                rank[rows] = np.arange(rows.sum())
            if len(self._blocks) >= 2:
                self._blocks.pop(min(self._blocks))
            self._blocks[k] = (which, rank)
        return self._blocks[k]

    @property
    def order_name(self) -> str:
        return self.streams[0].order_name

    def data_dirs(self) -> str:
        return ", ".join(s.data_dir for s in self.streams)

    def use_order(self, name: str) -> None:
        for stream in self.streams:
            stream.use_order(name)

    def locate(self, row: int) -> tuple[int, int]:
        """(dataset, row within that dataset's stream) of mixture row `row`."""
        k, j = divmod(row, self.BLOCK)
        which, rank = self._block(k)
        d = int(which[j])
        return d, k * int(self.quotas[d]) + int(rank[j])

    def row(self, start: int, seq_len: int) -> dict:
        d, i = self.locate(start // seq_len)
        return self.streams[d].row(i * seq_len, seq_len)


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """"dirA:0.7,dirB:0.3" -> [(dirA, 0.7), (dirB, 0.3)]; the weight follows the last ':' (gs:// paths work)."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        path, sep, weight = part.rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not path or not value > 0:
            raise ValueError(f"{part!r} is not <data dir>:<positive weight>")
        out.append((path, value))
    if not out:
        raise ValueError("empty mixture")
    return out


def _local_batch(global_batch: int, process_index: int, process_count: int) -> int:
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} not in [0, {process_count})")
    if global_batch % process_count:
        raise DataError(f"global_batch={global_batch} is not divisible by process_count={process_count}")
    return global_batch // process_count


class _ProcessRows:
    """Row i that one process reads, counted from stream offset `next_token`. An object rather than a
    closure over the iterator: Grain pickles it into its worker processes."""

    def __init__(self, stream, *, next_token: int, seq_len: int, global_batch: int, local_batch: int,
                 process_index: int):
        self.stream, self.next_token, self.seq_len, self.local_batch = stream, next_token, seq_len, local_batch
        self.batch_tokens = global_batch * seq_len
        self.rows_before = process_index * local_batch  # this process's rows come after these in a batch

    def __call__(self, i: int) -> dict:
        step, j = divmod(i, self.local_batch)
        start = self.next_token + step * self.batch_tokens + (self.rows_before + j) * self.seq_len
        return self.stream.row(start, self.seq_len)


def _init_worker(worker_index: int, worker_count: int) -> None:
    """First thing in each Grain worker process. Grain 0.2.18 starts them with the "spawn" method (a fresh
    interpreter, never a fork of a process whose XLA threads are running), and stops them itself on
    close() or at exit. Two gaps are closed here."""
    # Ctrl-C or a SIGTERM sent to the whole process group must not kill a worker under the trainer,
    # which handles the signal (a preemption save still needs batches) and then stops its workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A worker whose trainer was SIGKILLed would wait forever on its full queue: exit once orphaned.
    parent = os.getppid()

    def exit_when_orphaned():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=exit_when_orphaned, name="orphan-watch", daemon=True).start()


def _own_memory(batch: dict) -> dict:
    """Copies a batch out of the shared memory Grain's workers hand it over in (Grain unlinks that memory
    when the array dies, which may be at interpreter exit: noisy, and not what a jax.Array should alias)."""
    return {k: np.array(v) for k, v in batch.items()}


def _close_and_drop(reader: list) -> None:
    """Closes the Grain iterator in `reader` and drops it, so that it is also collected while the
    interpreter still works (Grain's __del__ fails noisily during teardown)."""
    while reader:
        reader.pop().close()


class TrainIterator:
    """Endless train batches for one process. State: {"next_token", "stream"}, identical on every process.

    `num_workers` > 0 builds the batches in that many Grain worker processes (batch k in worker k mod n)
    instead of one prefetch thread; the batches are the same, since each is a pure function of its position.
    On 2 CPU cores the thread is faster; workers pay off when building a batch costs more than a step."""

    def __init__(self, stream: PackedStream, *, seq_len: int, global_batch: int, process_index: int,
                 process_count: int, prefetch: int = 2, num_workers: int = 0, next_token: int = 0):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise DataError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.local_batch = _local_batch(global_batch, process_index, process_count)
        self.process_index, self.prefetch, self.num_workers = process_index, prefetch, num_workers
        self._reader: list = []  # the Grain iterator; a list the finalizer below empties
        self._close_reader = lambda: None
        self._start(next_token)

    def _start(self, next_token: int):
        self._close_reader()  # a restart (set_state) must not leave the old thread or workers running
        self.next_token = next_token
        rows = _ProcessRows(self.stream, next_token=next_token, seq_len=self.seq_len,
                            global_batch=self.global_batch, local_batch=self.local_batch,
                            process_index=self.process_index)
        ds = grain.MapDataset.range(2**62).map(rows).batch(self.local_batch)
        # One background thread builds the next batches while the step runs (more only fight the GIL here).
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=self.prefetch))
        if self.num_workers:
            # Grain reads its absl flags when it starts workers; a notebook or a test has parsed none.
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            options = grain.MultiprocessingOptions(num_workers=self.num_workers, per_worker_buffer_size=self.prefetch)
            ds = ds.mp_prefetch(options, worker_init_fn=_init_worker).map(_own_memory)
        self._reader = [iter(ds)]
        # Stops the thread or the workers on close(), when this iterator is collected, or at interpreter exit
        # (weakref.finalize runs its atexit hook before modules are torn down): a run never hangs on them.
        self._close_reader = weakref.finalize(self, _close_and_drop, self._reader)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self._reader[0])
        self.next_token += self.global_batch * self.seq_len
        return batch

    def get_state(self) -> dict:
        return {"next_token": self.next_token, "stream": self.stream.identity, "seed": self.stream.seed,
                "order": self.stream.order_name, "content": self.stream.content}

    def set_state(self, state: dict, allow_changed: bool = False) -> str | None:
        """Continues at a saved position. Returns what changed in the data when `allow_changed` lets a position
        saved on other content resume (positions saved before content ids were recorded are taken as they are)."""
        for key, mine in (("stream", self.stream.identity), ("seed", self.stream.seed)):
            if state.get(key) != mine:
                raise DataError(f"checkpointed data position refers to {key}={state.get(key)!r}, this run has "
                                f"{mine!r}; resume with the same data dir (or mixture) and train.seed, or start "
                                f"a new workdir")
        changed = None
        if state.get("content", self.stream.content) != self.stream.content:
            changed = (f"the train data ({self.stream.data_dirs()}) holds other documents than the checkpoint's "
                       f"position counts through (content {state['content']}, now {self.stream.content})")
            if not allow_changed:
                raise DataError(f"data.dir: {changed}; resume with the data the run trained on, set "
                                f"data.allow_changed=true to go on with this data, or start a new workdir")
        if self.stream.row_addressed and state["next_token"] % self.seq_len:
            what = "a mixture" if isinstance(self.stream, MixedStream) else "chat data"
            raise DataError(f"train.seq_len: {self.seq_len} does not divide the checkpointed position of {what} "
                            f"({state['next_token']} tokens); resume it with its seq_len")
        self._close_reader()  # its thread must not read the stream while the order changes under it
        self.stream.use_order(state.get("order", LEGACY_ORDER))
        self._start(int(state["next_token"]))
        return changed

    def close(self) -> None:
        """Stops the prefetch thread or the worker processes; the iterator is spent afterwards."""
        self._close_reader()


def train_iterator(data_dir: str, *, seq_len: int, global_batch: int, seed: int, process_index: int = 0,
                   process_count: int = 1, mixture: str = "", num_workers: int = 0) -> TrainIterator:
    """Endless, shuffled, packed train batches; exactly resumable through get_state/set_state.

    `mixture` ("dirA:0.7,dirB:0.3", see MixedStream) trains on those datasets instead of `data_dir`'s train
    split; each must have been tokenized with `data_dir`'s tokenizer. `num_workers` > 0: build the batches
    in Grain worker processes (the same batches; see TrainIterator)."""
    _local_batch(global_batch, process_index, process_count)  # fail before reading anything
    if not mixture:
        stream = PackedStream(data_dir, "train", seed)
    else:
        check_extra_dirs(data_dir, mixture, "")
        streams, weights = [], []
        for d, (path, weight) in enumerate(parse_mixture(mixture)):
            # Each dataset gets its own epoch order, unrelated to the others'.
            streams.append(PackedStream(path, "train", int(np.random.SeedSequence([seed, d]).generate_state(1)[0])))
            weights.append(weight)
        stream = MixedStream(streams, weights, seed)
    return TrainIterator(stream, seq_len=seq_len, global_batch=global_batch, process_index=process_index,
                         process_count=process_count, num_workers=num_workers)


def eval_batches(data_dir: str, *, seq_len: int, global_batch: int, num_batches: int, process_index: int = 0,
                 process_count: int = 1) -> list[dict]:
    """The first num_batches packed batches of the held-out split, in file order (wrapping if it is short)."""
    local = _local_batch(global_batch, process_index, process_count)
    stream = PackedStream(data_dir, "heldout", seed=None)
    rows = [stream.row(((k * process_count + process_index) * local + j) * seq_len, seq_len)
            for k in range(num_batches) for j in range(local)]
    return [{key: np.stack([r[key] for r in rows[k * local:(k + 1) * local]]) for key in rows[0]}
            for k in range(num_batches)]


def check_data_dir(data) -> None:
    """ConfigError unless the `data` group's dir exists (or is a URL, or empty: the default corpus's cache, made on
    first use): a typo in data.dir must not prepare the default corpus there and train on it."""
    if data.dir and not storage.is_url(data.dir) and not os.path.exists(data.dir):
        raise ConfigError("data.dir", f"{data.dir}: no such directory; prepare data there (jaxtrain prepare --output "
                          f"{data.dir} ...), or leave data.dir empty for the default corpus")


def check_conversations_fit(data_dir: str, seq_len: int) -> None:
    """Chat data: ConfigError when its longest conversation does not fit a row (cheap: the manifest only)."""
    chat = load_manifest(data_dir).get("chat") or {}
    if chat.get("longest", 0) > seq_len:
        raise ConfigError("train.seq_len", f"{seq_len} is shorter than the longest conversation in {data_dir} "
                          f"({chat['longest']} tokens); prepare it with --max_len {seq_len}")


def data_kind(data_dir: str) -> str:
    """What a prepared dir holds: "pairs" (prepare --preference), "prompts" (prepare --prompts) or "documents"
    (jaxtrain.objectives.DATA_KINDS)."""
    manifest = load_manifest(data_dir)
    return "prompts" if manifest.get("kind") == "prompts" else "pairs" if manifest.get("pairs") else "documents"


def check_data_kind(data_dir: str, objective: str, kind: str, suits: dict, mixture: str = "",
                    eval_sets: str = "") -> None:
    """ConfigError naming train.objective unless every dir's data is of the `kind` the objective trains on: a
    preference objective needs preference pairs (prepare --preference), and pairs need one (as language-model
    data they would train on the rejected responses). `suits`: kind -> the objectives that train on it."""
    dirs = [data_dir, *(path for path, _ in parse_mixture(mixture))] if mixture else [data_dir]
    dirs += [path for _, path in parse_eval_sets(eval_sets)]
    for path in dirs:
        held = data_kind(path)
        if held != kind:
            what = {"pairs": "preference pairs (prepare --preference)", "prompts": "prompts (prepare --prompts)",
                    "documents": "documents"}[held]
            fix = " or ".join(suits.get(held, ())) or "another objective"
            if kind != "documents":
                fix += f", or prepare the data with --{'preference' if kind == 'pairs' else kind}"
            raise ConfigError("train.objective", f"{objective!r}, but {path} holds {what}; set it to {fix}")


def batch_keys(data_dir: str) -> tuple[str, ...]:
    """The keys of the data dir's batches: chat data adds "loss_weights"."""
    return (*_KEYS, "loss_weights") if load_manifest(data_dir).get("loss_weights") else _KEYS


_EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def parse_eval_sets(spec: str) -> list[tuple[str, str]]:
    """"web=dirA,code=dirB" -> [("web", dirA), ("code", dirB)]; "" -> []. Names are unique and made of
    letters, digits, '_', '.' and '-' (they become metric names: eval_loss/<name>)."""
    out: list[tuple[str, str]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, path = (x.strip() for x in part.partition("="))
        if not sep or not path or not _EVAL_SET_NAME.fullmatch(name):
            raise ValueError(f"{part!r} is not <name>=<data dir> with a name of letters, digits, '_', '.' or '-'")
        if name in dict(out):
            raise ValueError(f"name {name!r} is used twice")
        out.append((name, path))
    if spec.strip() and not out:
        raise ValueError(f"{spec!r} has no <name>=<data dir> entry")
    return out


def eval_set_batches(data_dir: str, spec: str, *, seq_len: int, global_batch: int, num_batches: int,
                     process_index: int = 0, process_count: int = 1) -> dict[str, list[dict]]:
    """{name: eval_batches of that dir's held-out split} for the eval sets in `spec` (see parse_eval_sets).
    Each dir must have been tokenized with `data_dir`'s tokenizer: the model only reads those ids."""
    check_extra_dirs(data_dir, "", spec)
    out = {}
    for name, path in parse_eval_sets(spec):
        try:
            out[name] = eval_batches(path, seq_len=seq_len, global_batch=global_batch, num_batches=num_batches,
                                     process_index=process_index, process_count=process_count)
        except DataError as e:
            raise DataError(f"eval.sets: {name!r}: {e}") from None
    return out


def check_extra_dirs(data_dir: str, mixture: str, eval_sets: str) -> None:
    """Every data.mixture and eval.sets dir is prepared and tokenized with data_dir's tokenizer (the model only
    reads those ids). Cheap (manifests only): train.run calls it before the workdir is touched."""
    tokenizer = load_manifest(data_dir)["tokenizer"]

    def same_tokenizer(path, advice):
        if (have := load_manifest(path)["tokenizer"]["sha256"]) != tokenizer["sha256"]:
            raise DataError(f"{path}: tokenized with another tokenizer ({have[:12]}) than {data_dir} "
                            f"({tokenizer['sha256'][:12]}); {advice}")

    for path, _ in parse_mixture(mixture) if mixture else []:
        same_tokenizer(path, "a mixture needs one tokenizer")
    for name, path in parse_eval_sets(eval_sets):
        try:
            same_tokenizer(path, f"prepare it with --tokenizer {os.path.join(data_dir, tokenizer['file'])}")
        except DataError as e:
            raise DataError(f"eval.sets: {name!r}: {e}") from None


def tokens_per_batch_fingerprint(batch: dict) -> str:
    """Short sha256 of the batch's tokens (shape included): proves exact resume."""
    tokens = np.ascontiguousarray(batch["tokens"], dtype=np.int32)
    return hashlib.sha256(str(tokens.shape).encode() + tokens.tobytes()).hexdigest()[:16]
