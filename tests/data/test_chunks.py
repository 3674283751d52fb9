"""chunks.block_offsets: a sparse copy holding a file's head, its footer and one block's byte range reads
exactly that block's records, for every block, across chunk and Riegeli block boundaries."""

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from jaxtrain.data import chunks


@pytest.mark.parametrize("n, max_len, chunk, block", [
    (5000, 50, 16, 1024),  # many chunks per Riegeli block
    (2048, 40, 16, 1024),  # whole blocks only
    (300, 3000, 16, 64),  # chunks spanning Riegeli blocks
    (40, 100000, 16, 32),  # records spanning several Riegeli blocks
    (37, 5, 1, 2),  # one record per chunk, a short last block
    (0, 5, 16, 1024),  # empty
])
def test_each_blocks_byte_range_alone_reads_its_records(tmp_path, n, max_len, chunk, block):
    rng = np.random.default_rng(n)
    records = [rng.integers(0, 255, rng.integers(1, max_len)).astype(np.uint8).tobytes() for _ in range(n)]
    path = str(tmp_path / "x.array_record")
    writer = ArrayRecordWriter(path, f"group_size:{chunk}")
    for r in records:
        writer.write(r)
    writer.close()
    raw = open(path, "rb").read()
    offsets = chunks.block_offsets(path, n, block, chunk)
    assert len(offsets) == -(-n // block) + 1 and np.all(np.diff(offsets) > 0) and offsets[-1] < len(raw)
    for b in range(len(offsets) - 1):
        sparse = tmp_path / f"sparse{b}"
        with open(sparse, "wb") as f:
            f.truncate(len(raw))
            f.write(raw[:offsets[0]])
            f.seek(offsets[-1])
            f.write(raw[offsets[-1]:])
            f.seek(offsets[b])
            f.write(raw[offsets[b]:offsets[b + 1]])
        reader = ArrayRecordReader(str(sparse), "readahead_buffer_size:0")
        ids = rng.permutation(np.arange(b * block, min(n, (b + 1) * block))).tolist()
        assert reader.num_records() == n and reader.read(ids) == [records[i] for i in ids]
        if len(offsets) > 2:  # a record of a block not copied fails Riegeli's hash, it never reads as zeros
            other = ((b + 1) % (len(offsets) - 1)) * block
            with pytest.raises(Exception, match="[Cc]orrupt|hash"):
                reader.read([other])
        reader.close()


def test_a_file_with_other_chunking_is_refused(tmp_path):
    path = str(tmp_path / "x.array_record")
    writer = ArrayRecordWriter(path, "group_size:8")
    for i in range(100):
        writer.write(bytes([i]))
    writer.close()
    with pytest.raises(ValueError, match="holds 8 records, expected 16"):
        chunks.block_offsets(path, 100, 1024, 16)
