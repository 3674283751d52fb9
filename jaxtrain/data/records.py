"""One split of a prepared dir, read lazily: records, per-document lengths and per-block token counts.

Nothing is read up front but the manifest, each shard's block index (8 bytes per 1,024 documents) and its
footer (`verify`). A shard's ArrayRecord reader opens on first use, and at most MAX_OPEN stay open (the
least recently used closes), so a host holds the record index of only the shards its rows come from.
Lengths are memory-mapped from each shard's `.lengths.npy` and checked block by block against the block
index as they are read. Dirs prepared before the block index existed get it summed from the lengths at
open; dirs older than the lengths index are measured by reading every record (docs/data.md). Shards in a bucket
are read through a sparse local copy, a block at a time (_SparseShard).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import threading

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from jaxtrain import storage
from jaxtrain.data import layout
from jaxtrain.errors import DataError

MAX_OPEN = 16  # shard readers kept open (each holds its chunk index: docs/performance.md): a window has 16 blocks
VERIFY_THREADS = 2
REMOTE_VERIFY_THREADS = 16
HASH_BELOW = 64 << 20  # a split of shards under this many bytes is hashed whole at open: cheap at that size


class Split:
    """Records [0, n_records) of one split, numbered across its shards in manifest order."""

    def __init__(self, data_dir: str, rows: list[dict], dtype: np.dtype, weighted: bool,
                 sizes: list[int] | None = None):
        self.data_dir = data_dir
        self.paths = [os.path.join(data_dir, r["file"]) for r in rows]
        self.sizes = sizes if sizes is not None else [storage.size(p) for p in self.paths]
        # A bucket's shards are read through sparse local copies, a block per request (_SparseShard): far
        # fewer requests than ArrayRecord's own gs:// reads, one per chunk of 16 records (docs/data.md), which
        # remain for gs:// dirs prepared before the block offsets; other buckets need them.
        self.sparse = storage.is_url(data_dir) and all("offsets" in r for r in rows)
        if storage.is_url(data_dir) and not self.sparse and not str(data_dir).startswith("gs://"):
            raise DataError(f"{data_dir}: prepared before shards recorded their block offsets, which reading "
                            f"from {str(data_dir).split('://')[0]}:// needs; prepare it again, or mount the bucket")
        self._cache = os.path.join(layout.remote_cache(data_dir), "shards") if self.sparse else None
        self._readers: collections.OrderedDict[int, ArrayRecordReader] = collections.OrderedDict()
        self._lock = threading.Lock()
        # The oldest manifests count no documents: the shard's own footer does.
        docs = np.array([r["docs"] if "docs" in r else self._reader(s).num_records() for s, r in enumerate(rows)],
                        np.int64)
        self.rows = [{**r, "docs": int(d)} for r, d in zip(rows, docs)]
        self.starts = np.concatenate([[0], np.cumsum(docs)])  # first record of each shard
        self.n_records = int(self.starts[-1])
        self.record_width = dtype.itemsize + (1 if weighted else 0)  # bytes per token (+ a uint8 loss weight)
        self.dtype, self.weighted = dtype, weighted
        self.block_size = int(rows[0].get("block_records", layout.BLOCK_RECORDS)) if rows else layout.BLOCK_RECORDS
        self._lengths: dict[int, np.ndarray] = {}  # shard -> memory-mapped lengths
        self._measured = None  # every record's length, for dirs without a lengths index
        if not all("lengths" in r for r in rows):
            self._measured = np.fromiter((len(r) // self.record_width for r in self.read(range(self.n_records))),
                                         np.int64, self.n_records)
        blocks, firsts = [], []
        for s, row in enumerate(self.rows):
            blocks.append(self._block_index(s, row))
            firsts.append(self.starts[s] + np.arange(len(blocks[-1]), dtype=np.int64) * self.block_size)
        self.block_tokens = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
        self.block_first = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)  # global record id
        self.block_records = np.minimum(self.block_first + self.block_size,
                                        np.repeat(self.starts[1:], [len(b) for b in blocks])) - self.block_first
        self._checked = np.zeros(len(self.block_tokens), bool)  # blocks whose lengths matched their count

    def verify(self) -> None:
        """Opens every shard once and closes it: a truncated file or a damaged index fails here, before a run
        touches its workdir. Cheap: a reader's index is an entry per chunk (layout.CHUNK_RECORDS records). A
        split under HASH_BELOW bytes is also checked against the manifest's sha256s (a flipped bit anywhere);
        in a larger one, damage inside a chunk is found when the order reaches it."""
        hashed = sum(self.sizes) < HASH_BELOW

        def check(s: int) -> None:
            if hashed and self.rows[s].get("sha256") and storage.sha256(self.paths[s]) != self.rows[s]["sha256"]:
                raise RuntimeError("its sha256 differs from the manifest's")
            reader = self._open(s)
            try:
                if (n := reader.num_records()) != self.rows[s]["docs"]:
                    raise DataError(f"{self.paths[s]}: holds {n} records, the manifest says {self.rows[s]['docs']}; "
                                    f"prepare the data again")
                # The first record's size against its length: a dtype of another width, or chat data read
                # without its loss weights, would otherwise be bytes reinterpreted (local dirs: the lengths
                # index is memory-mapped, not fetched).
                if n and not storage.is_url(self.data_dir) and self._measured is None:
                    got, want = len(reader.read([0])[0]), int(self._shard_lengths(s)[0]) * self.record_width
                    if got != want:
                        raise DataError(f"{self.paths[s]}: its first record has {got} bytes, the manifest's dtype "
                                        f"and lengths say {want} ({self.dtype.name}, "
                                        f"{'with' if self.weighted else 'without'} loss weights); prepare the data "
                                        f"again")
            finally:
                reader.close()

        threads = REMOTE_VERIFY_THREADS if storage.is_url(self.data_dir) else VERIFY_THREADS  # waiting on requests
        with concurrent.futures.ThreadPoolExecutor(min(threads, max(1, len(self.paths)))) as pool:
            list(pool.map(check, range(len(self.paths))))

    def __getstate__(self):  # Grain pickles the stream into its workers: no open files, no mapped memory
        state = dict(self.__dict__)
        state.update(_readers=collections.OrderedDict(), _lock=None, _lengths={})
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the index ------------------------------------------------------------------------------------
    def _block_index(self, s: int, row: dict) -> np.ndarray:
        n_blocks = -(-row["docs"] // self.block_size)
        if "blocks" in row:
            path = os.path.join(self.data_dir, row["blocks"])
            try:
                tokens = np.asarray(storage.load_npy(path), np.int64)
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: unreadable block index ({e}); prepare the data again") from None
            if len(tokens) != n_blocks or int(tokens.sum()) != row["tokens"]:
                raise DataError(f"{path}: does not match {row['file']} ({len(tokens)} blocks / {int(tokens.sum())} "
                                f"tokens, manifest {n_blocks} / {row['tokens']}); prepare the data again")
            return tokens
        tokens = layout.block_tokens(self._shard_lengths(s), self.block_size)
        if "tokens" in row and int(tokens.sum()) != row["tokens"]:
            raise DataError(f"{self._lengths_path(s)}: does not match {row['file']} ({int(tokens.sum())} tokens, "
                            f"manifest {row['tokens']}); prepare the data again")
        return tokens

    def _lengths_path(self, s: int) -> str:
        return os.path.join(self.data_dir, self.rows[s]["lengths"])

    def _shard_lengths(self, s: int) -> np.ndarray:
        if self._measured is not None:
            return self._measured[self.starts[s]:self.starts[s + 1]]
        if s not in self._lengths:
            path = self._lengths_path(s)
            try:
                lengths = storage.load_npy(path, mmap=True)
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: unreadable lengths index ({e}); prepare the data again") from None
            if lengths.shape != (self.rows[s]["docs"],):
                raise DataError(f"{path}: does not match {self.rows[s]['file']} ({len(lengths)} docs, manifest "
                                f"{self.rows[s]['docs']}); prepare the data again")
            self._lengths[s] = lengths
        return self._lengths[s]

    def block_lengths(self, block: int) -> np.ndarray:
        """Tokens of each record of one block, checked against the block index."""
        first = int(self.block_first[block])
        s = int(np.searchsorted(self.starts, first, side="right")) - 1
        at = first - int(self.starts[s])
        lengths = np.asarray(self._shard_lengths(s)[at:at + int(self.block_records[block])], np.int64)
        if not self._checked[block]:
            if int(lengths.sum()) != self.block_tokens[block]:
                raise DataError(f"{self._lengths_path(s)}: does not match {self.rows[s]['file']} (records "
                                f"{at}..{at + len(lengths) - 1}: {int(lengths.sum())} tokens, block index "
                                f"{int(self.block_tokens[block])}); prepare the data again")
            self._checked[block] = True
        return lengths

    def all_lengths(self) -> np.ndarray:
        """Every record's tokens (O(documents) memory: for tests and small tools, not the trainer)."""
        parts = [self.block_lengths(b) for b in range(len(self.block_tokens))]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    # -- the records ----------------------------------------------------------------------------------
    def _reader(self, s: int) -> ArrayRecordReader:
        if s in self._readers:
            self._readers.move_to_end(s)
        else:
            if len(self._readers) >= MAX_OPEN:
                self._readers.popitem(last=False)[1].close()
            self._readers[s] = self._open(s)
        return self._readers[s]

    def _open(self, s: int):
        if self.sparse:
            offsets = os.path.join(self.data_dir, self.rows[s]["offsets"])
            local = os.path.join(self._cache, f"{self.rows[s]['file']}.{os.getpid()}")  # Grain workers: one each
            return _SparseShard(self.paths[s], self.sizes[s], offsets, local, self.block_size)
        return _local_reader(self.paths[s])

    def read(self, records) -> list[bytes]:
        """The raw records, in the order asked. A damaged shard raises RuntimeError (the caller names it)."""
        records = np.asarray(records, np.int64)
        out: list = [None] * len(records)
        shard = np.searchsorted(self.starts, records, side="right") - 1
        with self._lock:
            for s in np.unique(shard).tolist():
                where = np.flatnonzero(shard == s)
                got = self._reader(s).read((records[where] - self.starts[s]).tolist())
                for i, record in zip(where.tolist(), got):
                    out[i] = record
        return out

    def close(self) -> None:
        with self._lock:
            while self._readers:
                self._readers.popitem()[1].close()


def _local_reader(path: str) -> ArrayRecordReader:
    return ArrayRecordReader(path, "readahead_buffer_size:0", file_reader_buffer_size=32768)


class _SparseShard:
    """A shard in a bucket, read through a local sparse file of its size: its head and footer at open, then
    each block (chunks.py) the first time one of its records is read, one range request each. Disk holds only
    the blocks read; close() deletes the file."""

    def __init__(self, url: str, size: int, offsets_url: str, local: str, block_records: int):
        self.url, self.local, self.block_records = url, local, block_records
        try:
            self.offsets = np.asarray(storage.load_npy(offsets_url), np.int64)
        except (OSError, ValueError) as e:
            raise DataError(f"{offsets_url}: unreadable block offsets ({e}); prepare the data again") from None
        if len(self.offsets) < 1 or not 0 < self.offsets[0] <= self.offsets[-1] <= size:
            raise DataError(f"{offsets_url}: does not match {url}; prepare the data again")
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as f:
            f.truncate(size)
            f.write(storage.read_bytes(url, 0, int(self.offsets[0])))
            f.seek(int(self.offsets[-1]))
            f.write(storage.read_bytes(url, int(self.offsets[-1]), size))
        self.have = np.zeros(len(self.offsets) - 1, bool)
        self._reader = _local_reader(local)

    def num_records(self) -> int:
        return self._reader.num_records()

    def read(self, ids: list[int]) -> list[bytes]:
        need = np.unique(np.asarray(ids, np.int64) // self.block_records)
        need = need[~self.have[need]]
        if len(need):
            with open(self.local, "r+b") as f:
                for b in need.tolist():
                    start, end = int(self.offsets[b]), int(self.offsets[b + 1])
                    f.seek(start)
                    f.write(storage.read_bytes(self.url, start, end))
            self.have[need] = True
            self._reader.close()  # its buffer may hold the zeros that were there before
            self._reader = _local_reader(self.local)
        return self._reader.read(ids)

    def close(self) -> None:
        self._reader.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local)
