"""Where each block of records lies in an ArrayRecord file, so a reader can fetch just those bytes.

An ArrayRecord file is a Riegeli file: 64 KiB blocks, each starting with a 24-byte block header, over a
sequence of chunks (a 40-byte header, then data), the first a signature chunk and the last ones the footer,
the postscript and padding. Its data chunks hold `chunk_records` records each, in order. `block_offsets`
walks the chunk headers of a local file once (prepare does, as it writes a shard) and returns the byte
offset where every block of `block_records` records starts, plus where the footer starts. With those, a
local sparse copy holding the file's head, its footer and the blocks a host needs opens and reads like
the whole file (records.py does this for s3://); any other record fails Riegeli's chunk hash, loudly.
"""

from __future__ import annotations

import os
import struct

import numpy as np

RIEGELI_BLOCK = 1 << 16
BLOCK_HEADER = 24
CHUNK_HEADER = 40
_DATA, _SIGNATURE = ord("r"), ord("s")


def _advance(pos: int, length: int) -> int:
    """The position `length` bytes of chunk content after `pos`, stepping over block headers."""
    while length > 0:
        if pos % RIEGELI_BLOCK == 0:
            pos += BLOCK_HEADER
        step = min(RIEGELI_BLOCK - pos % RIEGELI_BLOCK, length)
        pos, length = pos + step, length - step
    return pos


def _boundary(pos: int) -> int:
    """A chunk cannot begin inside a block header: the first possible chunk start at or after `pos`."""
    r = pos % RIEGELI_BLOCK
    return pos + BLOCK_HEADER - r if r < BLOCK_HEADER else pos


def _header(f, pos: int) -> bytes:
    out = b""
    while len(out) < CHUNK_HEADER:
        if pos % RIEGELI_BLOCK == 0:
            pos += BLOCK_HEADER
        f.seek(pos)
        part = f.read(min(RIEGELI_BLOCK - pos % RIEGELI_BLOCK, CHUNK_HEADER - len(out)))
        if not part:
            raise ValueError(f"truncated chunk header at byte {pos}")
        out, pos = out + part, pos + len(part)
    return out


def block_offsets(path: str, n_records: int, block_records: int, chunk_records: int) -> np.ndarray:
    """int64 [n_blocks + 1]: the byte where each block's first chunk starts, then where the last data chunk
    ends (the footer's start). ValueError if the file's chunks are not n_records in chunks of chunk_records."""
    n_chunks = -(-n_records // chunk_records)
    starts = []
    with open(path, "rb") as f:
        size, pos = os.fstat(f.fileno()).st_size, BLOCK_HEADER
        while len(starts) <= n_chunks and pos < size:
            _, data_size, _, type_and_records, _ = struct.unpack("<QQQQQ", _header(f, pos))
            kind, records = type_and_records & 0xFF, type_and_records >> 8
            if kind == _DATA or len(starts) == n_chunks:  # the data chunks, then the footer's start
                want = min(chunk_records, n_records - len(starts) * chunk_records)
                if len(starts) < n_chunks and (kind != _DATA or records != want):
                    raise ValueError(f"chunk {len(starts)} at byte {pos} holds {records} records, expected {want}")
                starts.append(pos)
            elif kind != _SIGNATURE and not starts:
                raise ValueError(f"unexpected chunk type {kind!r} at byte {pos}")
            end = max(_advance(pos, CHUNK_HEADER + data_size), _advance(pos, records))
            pos = _boundary(end)
    if len(starts) != n_chunks + 1:
        raise ValueError(f"found {len(starts) - 1} data chunks, expected {n_chunks}")
    per_block = block_records // chunk_records
    return np.array(starts[::per_block] + ([starts[-1]] if n_chunks % per_block else []), np.int64)
