"""Document sources for `prepare`: text, JSONL and Parquet files (local, or gs:// where gcsfs is installed),
and Hugging Face `datasets` / TFDS splits (`hf:...`, `tfds:...`, see dataset_sources.py).

A source is one file or one dataset split. `pieces()` cuts it into independently readable parts of about a
given size (byte ranges of line-oriented files, row ranges of Parquet and datasets, whole files otherwise),
which is what lets `prepare` tokenize a large corpus in parallel and resume it shard by shard.
`documents()` yields a piece's documents lazily as str; bad documents are skipped and counted in
`Source.skipped` (reason -> count), malformed JSONL lines too (the first few located in `Source.malformed_at`,
and SourceError instead when `Source.strict`), while a file that cannot be read at all raises SourceError.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
from collections.abc import Iterator

import numpy as np
from etils import epath

from jaxtrain.data import dataset_sources
from jaxtrain.data.dataset_sources import DATASET_PREFIXES, MISSING, RECORD
from jaxtrain.errors import SourceError
from jaxtrain.files import file_hash

KINDS = ("txt", "jsonl", "parquet")
# RECORD: the --field of chat data that is each whole JSONL record or dataset row (messages, or prompt and completion)
TEXT_SPLITS = ("file", "paragraph", "line")
_EXTENSIONS = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
_PARAGRAPH_BREAK = re.compile(rb"\r?\n(?:[ \t\r]*\n)+")  # one or more blank lines
MALFORMED = ("not_json", "not_an_object")  # skip reasons of JSONL lines that are not records at all
MALFORMED_SHOWN = 5  # located lines kept per source (and per shard while counting)


@dataclasses.dataclass
class Source:
    path: str
    kind: str
    field: str | None
    docs: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    size: int = 0  # bytes on disk (estimated text size for shard balancing)
    text_bytes: int = 0
    mtime_ns: int = 0  # with path and size: lets a rerun trust the recorded sha256 without reading the file
    dataset: object = None  # a dataset_sources.DatasetSource for kind "hf" / "tfds"
    strict: bool = False  # a malformed JSONL line raises SourceError instead of being skipped
    malformed_at: list = dataclasses.field(default_factory=list)  # "path: line N is not JSON (...)", the first few

    def row(self) -> dict:
        row = {"path": self.path, "kind": self.kind, "field": self.field, "docs": self.docs,
               "skipped": dict(sorted(self.skipped.items()))}
        return {**row, "malformed_at": self.malformed_at} if self.malformed_at else row

    def note_malformed(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        if len(self.malformed_at) < MALFORMED_SHOWN:
            self.malformed_at.append(where)

    def pieces(self, target_bytes: int, text_split: str = "file") -> list[tuple[int, int, int]]:
        """(start, stop, estimated bytes) parts of about target_bytes; stop -1 = to the end.
        Units: bytes for line-oriented files (a line belongs to the piece its first byte is in), rows for
        Parquet and datasets, and (0, -1) for files that must be read whole."""
        if self.kind in ("hf", "tfds"):
            return _row_ranges(self.dataset.num_rows, self.size, target_bytes)
        if self.kind == "parquet":
            return _row_ranges(_parquet_rows(self), self.size, target_bytes)
        line_oriented = self.kind == "jsonl" or (self.kind == "txt" and text_split == "line")
        if not line_oriented or self.path.endswith(".gz") or self.size <= target_bytes:
            return [(0, -1, self.size)]
        cuts = list(range(0, self.size, target_bytes)) + [self.size]
        return [(a, b if b < self.size else -1, b - a) for a, b in zip(cuts, cuts[1:])]


def _row_ranges(rows: int, size: int, target_bytes: int) -> list[tuple[int, int, int]]:
    n = max(1, min(rows, -(-size // max(target_bytes, 1))))
    cuts = np.linspace(0, rows, n + 1).round().astype(int).tolist()
    return [(a, b, size * (b - a) // max(rows, 1)) for a, b in zip(cuts, cuts[1:])]


def expand(patterns: list[str], fmt: str | None, field: str, *, split: str = "train",
           tfds_data_dir: str | None = None) -> list[Source]:
    """Paths, globs and dataset specs -> Sources in a stable (sorted per pattern) order; each pattern must
    match a file."""
    sources = []
    for pattern in patterns:
        if pattern.startswith(DATASET_PREFIXES):

            ds = dataset_sources.open_dataset(pattern, split=split, field=field, data_dir=tfds_data_dir)
            sources.append(Source(pattern, pattern.split(":", 1)[0], field, size=ds.size, dataset=ds))
            continue
        if any(c in pattern for c in "*?[") and "://" not in pattern:  # local: ** recurses
            paths = sorted(epath.Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        elif any(c in pattern for c in "*?["):
            if "**" in pattern:  # epath's glob lists one directory level per `*`; a bucket-wide ** has no bound
                raise SourceError(f"{pattern}: ** is supported for local paths only; list the levels with * "
                                  f"(e.g. gs://bucket/dir/*/*.jsonl)")
            # Glob relative to the longest wildcard-free prefix, so gs://bucket/dir/*.jsonl works too.
            head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
            root = head.rsplit("/", 1)[0] if "/" in head else "."
            rest = pattern[len(root) + 1 :] if "/" in head else pattern
            paths = sorted(p for p in epath.Path(root).glob(rest) if p.is_file()) if epath.Path(root).exists() else []
        else:
            p = epath.Path(pattern)
            paths = [p] if p.is_file() else []
        if not paths:
            raise SourceError(f"{pattern}: matches no file")
        for p in paths:
            kind = fmt or _kind_of(p)
            try:
                stat = p.stat()
            except OSError as e:
                raise SourceError(f"{p}: cannot read ({e.strerror or e})") from None
            # Local paths absolute, so a rerun from another cwd is recognised as the same input.
            name = str(p) if "://" in str(p) else os.path.abspath(p)
            mtime = getattr(stat, "mtime", 0) or 0
            sources.append(Source(name, kind, None if kind == "txt" else field, size=stat.length,
                                  mtime_ns=int(mtime * 1e9)))
    return sources


def file_sha256(path: str) -> str:
    try:
        return file_hash(path)
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e.strerror or e})") from None


def _kind_of(path: epath.Path) -> str:
    name = path.name
    for ext, kind in _EXTENSIONS.items():
        if name.endswith(ext):
            return kind
    raise SourceError(f"{path}: unknown extension; pass --format ({'|'.join(KINDS)})")


def documents(src: Source, text_split: str = "file", start: int = 0, stop: int = -1, *,
              records: bool = False) -> Iterator[str]:
    """Yields the documents of src's piece [start, stop) (see Source.pieces; the defaults read it all),
    counting skips (undecodable, empty, missing_field, not_text) on src. `records`: chat data, whose documents
    are the field's values as they are (a JSONL record with field RECORD, a dataset's messages column)."""
    if records:
        yield from _counted_records(src, documents_raw(src, start, stop))
        return
    try:
        if src.kind in ("hf", "tfds"):
            yield from _counted(src, src.dataset.values(start, src.dataset.num_rows if stop < 0 else stop))
        elif src.kind == "txt" and text_split == "line":
            yield from _counted(src, (piece for line in _lines(src, start, stop) for piece in line.splitlines()))
        elif src.kind == "txt":
            yield from _counted(src, _text_chunks(src, text_split))
        elif src.kind == "jsonl":
            yield from _counted(src, _jsonl_values(src, start, stop))
        elif src.kind == "parquet":
            yield from _counted(src, _parquet_values(src, start, stop))
        else:
            raise SourceError(f"{src.path}: unknown format {src.kind!r}")
    except (OSError, EOFError) as e:  # EOFError: a truncated .gz.
        raise SourceError(f"{src.path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def documents_raw(src: Source, start: int, stop: int) -> Iterator[object]:
    if src.kind not in ("jsonl", "hf", "tfds", "parquet"):
        raise SourceError(f"{src.path}: chat data comes from JSONL, Parquet or datasets, not {src.kind}")
    try:
        if src.kind in ("hf", "tfds"):
            yield from src.dataset.values(start, src.dataset.num_rows if stop < 0 else stop)
        elif src.kind == "jsonl":
            yield from _jsonl_values(src, start, stop)
        else:
            yield from _parquet_values(src, start, stop)
    except (OSError, EOFError) as e:
        raise SourceError(f"{src.path}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def _counted_records(src: Source, values: Iterator[object]) -> Iterator[object]:
    for v in values:
        if isinstance(v, _Malformed):
            src.note_malformed(v.reason, v.where)
        elif v is MISSING:
            src.skipped["missing_field"] += 1
        elif isinstance(v, bytes):
            src.skipped["undecodable"] += 1
        else:
            src.docs += 1
            src.text_bytes += len(json.dumps(v, ensure_ascii=False).encode())
            yield v


def _counted(src: Source, values: Iterator[object]) -> Iterator[str]:
    """Bytes are decoded here and anything that is not a non-empty str is skipped with its reason."""
    for v in values:
        if isinstance(v, _Malformed):
            src.note_malformed(v.reason, v.where)
            continue
        if isinstance(v, bytes):
            src.text_bytes += len(v)
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                src.skipped["undecodable"] += 1
                continue
        elif isinstance(v, str):
            src.text_bytes += len(v.encode("utf-8", "surrogatepass"))
        if v is MISSING:
            src.skipped["missing_field"] += 1
        elif not isinstance(v, str):
            src.skipped["not_text"] += 1
        elif not v.strip():
            src.skipped["empty"] += 1
        else:
            src.docs += 1
            yield v




def _text_chunks(src: Source, text_split: str) -> Iterator[bytes]:
    # Split as bytes and decode per document, so one bad byte costs one document, not the file.
    data = epath.Path(src.path).read_bytes()
    if text_split == "file":
        yield data
    elif text_split == "paragraph":
        # A run of blank lines is one break, not empty documents; an empty file still counts as one.
        yield from _PARAGRAPH_BREAK.split(data.strip(b"\r\n"))
    else:
        raise SourceError(f"{src.path}: unknown text_split {text_split!r} (one of {TEXT_SPLITS})")


def _lines(src: Source, start: int, stop: int) -> Iterator[bytes]:
    """The lines whose first byte lies in [start, stop) (stop -1 = the end), with their line ending."""
    return (line for _, line in _lines_at(src, start, stop))


def _lines_at(src: Source, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset of its first byte, line) for the lines of _lines (offsets are in the decompressed
    stream for .gz files)."""
    with epath.Path(src.path).open("rb") as raw:
        if src.path.endswith(".gz"):
            pos = 0
            for line in gzip.GzipFile(fileobj=raw):
                yield pos, line
                pos += len(line)
            return
        if start > 0:
            raw.seek(start - 1)
            raw.readline()  # the rest of the line that started before us belongs to the previous piece
        pos = raw.tell()
        while stop < 0 or pos < stop:
            line = raw.readline()
            if not line:
                return
            yield pos, line
            pos += len(line)


def _jsonl_values(src: Source, start: int = 0, stop: int = -1) -> Iterator[object]:
    for lineno, (pos, line) in enumerate(_lines_at(src, start, stop), 1):
        # Line numbers are exact in a file's first piece; later pieces name the line's byte offset instead.
        where = f"line {lineno}" if start == 0 else f"the line at byte {pos}"
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield line  # _counted counts it as undecodable.
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            bad = _Malformed("not_json", f"{src.path}: {where} is not JSON ({e.msg})")
        else:
            if isinstance(record, dict):
                yield record if src.field == RECORD else record.get(src.field, MISSING)
                continue
            bad = _Malformed("not_an_object", f"{src.path}: {where} is not a JSON object")
        if src.strict:
            raise SourceError(bad.where)
        yield bad


@dataclasses.dataclass(frozen=True)
class _Malformed:
    """A JSONL line that is not a record, passed on to be counted with where it is."""
    reason: str
    where: str


def _parquet_file(src: Source, f):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{src.path}: reading Parquet needs pyarrow (pip install 'jaxtrain[parquet]')") from None
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(f)
    except pa.ArrowException as e:
        raise SourceError(f"{src.path}: not a Parquet file ({e})") from None
    if src.field not in pf.schema_arrow.names:
        raise SourceError(f"{src.path}: no column {src.field!r} (has {pf.schema_arrow.names})")
    return pf


def _parquet_rows(src: Source) -> int:
    try:
        with epath.Path(src.path).open("rb") as f:
            return _parquet_file(src, f).metadata.num_rows
    except OSError as e:
        raise SourceError(f"{src.path}: cannot read ({e.strerror or e})") from None


def _parquet_values(src: Source, start: int = 0, stop: int = -1) -> Iterator[object]:
    import pyarrow as pa

    with epath.Path(src.path).open("rb") as f:
        pf = _parquet_file(src, f)
        stop = pf.metadata.num_rows if stop < 0 else stop
        first = 0  # row index of the current row group's first row
        try:
            for g in range(pf.num_row_groups):
                rows = pf.metadata.row_group(g).num_rows
                if first < stop and first + rows > start:  # only the row groups that overlap the piece
                    column = pf.read_row_group(g, columns=[src.field]).column(0)
                    lo, hi = max(start - first, 0), min(stop - first, rows)
                    yield from (MISSING if v is None else v for v in column.slice(lo, hi - lo).to_pylist())
                first += rows
        except pa.ArrowException as e:  # A corrupt page after a good start.
            raise SourceError(f"{src.path}: invalid Parquet data ({e})") from None
