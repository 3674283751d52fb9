"""Grain input pipeline: ArrayRecord shards -> packed, batched numpy dicts.

Every batch is process-local: {"tokens", "segment_ids", "positions"}, each
int32[global_batch // process_count, seq_len]. segment_ids number the documents
within a row from 1 (0 = padding); positions restart at 0 at each document
start in a row. Documents are concatenated and cut into rows, so no token is
ever dropped; a long document continues in the next row, where it is
segment 1 with positions from 0 again (it cannot attend to the previous row).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import weakref

import grain
import numpy as np

from jaxtrain.data.prepare import DataError, load_manifest

_KEYS = {"tokens": "tokens", "tokens_segment_ids": "segment_ids", "tokens_positions": "positions"}
# Read in the calling thread: records are tiny and already on local disk, and
# on 2 cores extra reader threads only fight over the GIL.
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _documents(data_dir: str, split: str, process_index: int, process_count: int) -> grain.MapDataset:
    """This process's share of a split's documents, as int32 token arrays."""
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} not in [0, {process_count})")
    manifest = load_manifest(data_dir)
    paths = [os.path.join(data_dir, s["file"]) for s in manifest["splits"][split]]
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
    # Shard by document index before anything reads: each host reads its share.
    ds = ds[process_index::process_count]
    if len(ds) == 0:
        raise DataError(f"{data_dir}: split {split!r} has no documents for process {process_index}")
    return ds.map(lambda record: {"tokens": np.frombuffer(record, dtype).astype(np.int32)})


def _pack_and_batch(docs: grain.IterDataset, seq_len: int, batch_size: int) -> grain.IterDataset:
    # ConcatThenSplit splits documents across rows (nothing dropped) and emits
    # tokens_segment_ids / tokens_positions, which we rename for the model.
    ds = grain.experimental.ConcatThenSplitIterDataset(docs, length_struct={"tokens": seq_len})
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(lambda b: {_KEYS[k]: v for k, v in b.items()})


def _local_batch(global_batch: int, process_count: int) -> int:
    if global_batch % process_count:
        raise DataError(f"global_batch={global_batch} is not divisible by process_count={process_count}")
    return global_batch // process_count


class _TrainIterator(grain.DatasetIterator):
    """Pass-through around Grain's iterator that fixes two Grain 0.2.18 warts.

    1. Orbax (grain.checkpoint.CheckpointSave/Restore) stores get_state() as
       JSON, which turns tuples into lists. ConcatThenSplit marks "no remainder"
       with the tuple (-1, -1) and compares with `!=`, so a restored [-1, -1]
       drops a document and shifts every later batch. set_state restores tuples.
    2. The thread-prefetch iterator closes itself in __del__; at interpreter
       exit that runs after module globals are gone and prints tracebacks. We
       close and free it from an atexit hook, while modules still exist.
    """

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)
        atexit.register(_close_at_exit, weakref.ref(self))

    def __next__(self):
        return next(self._parent)

    def get_state(self):
        return self._parent.get_state()

    def set_state(self, state):
        self._parent.set_state(_lists_to_tuples(state))


def _close_at_exit(ref):
    if (it := ref()) is not None:
        it.close()
        it._parents = ()  # Grain's iterators are freed now, not during teardown.


def _lists_to_tuples(x):
    if isinstance(x, dict):
        return {k: _lists_to_tuples(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_lists_to_tuples(v) for v in x)
    return x


def train_iterator(
    data_dir: str,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Endless, shuffled, packed train batches; checkpointable (get/set_state, Orbax)."""
    local_batch = _local_batch(global_batch, process_count)
    docs = _documents(data_dir, "train", process_index, process_count)
    # Grain reshuffles epoch e with seed + e, so seed s+1 would replay the
    # epochs of seed s shifted by one; hash the seed to decorrelate nearby seeds.
    shuffle_seed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    # shuffle before repeat: each epoch is a full permutation, reshuffled per epoch.
    docs = docs.shuffle(seed=shuffle_seed).repeat()
    ds = _pack_and_batch(docs.to_iter_dataset(_READ), seq_len, local_batch)
    # One thread builds the next batches while the train step runs; its state
    # is that of the last batch handed out, so checkpoints stay exact.
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)
    return _TrainIterator(iter(ds))


def eval_batches(
    data_dir: str,
    *,
    seq_len: int,
    global_batch: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict]:
    """The first num_batches packed batches of the held-out split, in file order."""
    local_batch = _local_batch(global_batch, process_count)
    # repeat() so a held-out split smaller than num_batches still fills them.
    docs = _documents(data_dir, "heldout", process_index, process_count).repeat()
    it = iter(_pack_and_batch(docs.to_iter_dataset(_READ), seq_len, local_batch))
    return [next(it) for _ in range(num_batches)]


def tokens_per_batch_fingerprint(batch: dict) -> str:
    """Short sha256 of the batch's tokens (shape included): proves exact resume."""
    tokens = np.ascontiguousarray(batch["tokens"], dtype=np.int32)
    return hashlib.sha256(str(tokens.shape).encode() + tokens.tobytes()).hexdigest()[:16]
