"""Object storage (gs://, s3://) for prepared data dirs: reads and uploads with retries and one-line errors.

A local path passes straight through to the file system. A URL goes through fsspec (gcsfs, s3fs: `pip install
'jaxtrain[cloud]'`; credentials and endpoints are theirs: GOOGLE_APPLICATION_CREDENTIALS, AWS_* and, for an
emulator, STORAGE_EMULATOR_HOST / AWS_ENDPOINT_URL). A transient failure (no connection, a timeout, a 5xx or 429)
is retried with exponential backoff for up to RETRY_SECONDS (JAXTRAIN_STORAGE_RETRY_SECONDS); a permanent one (no
such object, access denied, no credentials) raises DataError naming the object, and a transient one that outlasts
the retries StorageUnavailable, which says the data is not at fault. Shards are read
through here too, a block per range request (records._SparseShard); only gs:// dirs prepared before the block
offsets are read by ArrayRecord's own GCS client (with its own retries).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import random
import sys
import threading
import time

import numpy as np

from jaxtrain.errors import DataError

RETRY_SECONDS = 120.0  # how long a transient outage is waited out: JAXTRAIN_STORAGE_RETRY_SECONDS overrides it
RETRY_ENV = "JAXTRAIN_STORAGE_RETRY_SECONDS"
FIRST_WAIT, MAX_WAIT = 0.5, 10.0  # seconds between tries: doubling, with jitter
SCHEMES = ("gs://", "s3://")
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)


def is_url(path) -> bool:
    return "://" in str(path)


def check_url(path, field: str = "path") -> None:
    """DataError unless `path` is local or a URL of a supported scheme."""
    if is_url(path) and not str(path).startswith(SCHEMES):
        raise DataError(f"{field}: {path}: unsupported URL scheme (jaxtrain reads {', '.join(SCHEMES)} or a local "
                        f"path)")


def _fs(url: str):
    """(fsspec file system, path within it) for a URL."""
    check_url(url)
    try:
        import fsspec
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise DataError(f"{url}: reading {url.split('://')[0]}:// needs {e.name} (pip install 'jaxtrain[cloud]')") \
            from None


class StorageUnavailable(DataError):
    """The endpoint stayed unreachable for the whole retry budget: the data is not at fault."""


def retry_seconds() -> float:
    """The retry budget: JAXTRAIN_STORAGE_RETRY_SECONDS, or RETRY_SECONDS."""
    value = os.environ.get(RETRY_ENV)
    try:
        return RETRY_SECONDS if value is None else max(0.0, float(value))
    except ValueError:
        raise DataError(f"{RETRY_ENV}: {value!r} is not a number of seconds") from None


# When the budget ran out on a bucket, the next requests to it within one more budget try once instead of
# waiting the budget again: a reader's prefetch issues many, and the first has already waited.
_gave_up: dict[str, float] = {}


def bucket_of(url) -> str:
    """The bucket a URL names, as a URL ("s3://b" of "s3://b/dir/x"); "" for a local path."""
    return "/".join(str(url).split("/")[:3]) if is_url(url) else ""


def retried(what: str, fn, *args, seconds: float | None = None):
    """fn(*args), retried while it fails transiently; DataError naming `what` when it fails for good, and
    StorageUnavailable when it failed transiently for the whole budget (`seconds`, default retry_seconds())."""
    seconds = retry_seconds() if seconds is None else seconds
    bucket = bucket_of(what)
    if time.monotonic() - _gave_up.get(bucket, -1e18) < seconds:
        seconds = 0.0  # one try: this bucket was unreachable a moment ago
    deadline = time.monotonic() + seconds
    wait = FIRST_WAIT
    while True:
        try:
            result = fn(*args)
            _gave_up.pop(bucket, None)
            return result
        except _PERMANENT as e:
            raise DataError(f"{what}: {_reason(e)}") from None
        except Exception as e:  # noqa: BLE001 - connection errors come in each client's own types
            if "Credentials" in type(e).__name__ or type(e).__name__.endswith("ValidationError"):  # no retry helps
                raise DataError(f"{what}: {_reason(e)}") from None
            if time.monotonic() + wait > deadline:
                _gave_up[bucket] = time.monotonic()
                raise StorageUnavailable(
                    f"{what}: storage unreachable ({_reason(e)}) after {seconds:g}s of retries ({RETRY_ENV}); the "
                    f"data is not damaged: rerun once the endpoint is back (a run resumes from its last "
                    f"checkpoint)") from None
            print(f"storage: {what}: {_reason(e)}; retrying in {wait:.1f}s", file=sys.stderr, flush=True)
            time.sleep(wait * random.uniform(0.8, 1.2))
            wait = min(2 * wait, MAX_WAIT)


def tensorstore_retries(seconds: float | None = None) -> dict:
    """Tensorstore's `*_request_retries` resource waiting out about the budget `retried` waits (its default waits
    up to 32 tries of 32 s: a checkpoint save into a bucket whose endpoint is down would hang for ~15 minutes)."""
    seconds = retry_seconds() if seconds is None else seconds
    tries, waited, wait = 1, 0.0, FIRST_WAIT
    while waited + wait <= seconds:
        tries, waited, wait = tries + 1, waited + wait, min(2 * wait, MAX_WAIT)
    return {"max_retries": tries, "initial_delay": f"{FIRST_WAIT}s", "max_delay": f"{MAX_WAIT}s"}


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# -- reading ------------------------------------------------------------------------------------------------------


def exists(path) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(str(path))
    return retried(str(path), fs.exists, p)


def size(path) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _fs(str(path))
    return int(retried(str(path), fs.size, p))


def sizes(directory, names: list[str]) -> list[int | None]:
    """The size of each file `directory/name` (None if missing); for a bucket, from one listing rather than a
    request per file (a corpus has thousands of shards)."""
    if not is_url(directory):
        paths = [os.path.join(directory, n) for n in names]
        return [os.path.getsize(p) if os.path.isfile(p) else None for p in paths]
    fs, root = _fs(str(directory))
    listed = retried(str(directory), functools.partial(fs.ls, root, detail=True))
    by_name = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in listed
               if e.get("type") == "file"}
    return [by_name.get(n) for n in names]


def read_bytes(path, start: int | None = None, end: int | None = None) -> bytes:
    """The object's bytes [start, end) (the whole object by default)."""
    if not is_url(path):
        with open(path, "rb") as f:
            f.seek(start or 0)
            return f.read() if end is None else f.read(end - (start or 0))
    fs, p = _fs(str(path))
    if start is None and end is None:
        return retried(str(path), fs.cat_file, p)
    return retried(str(path), functools.partial(fs.cat_file, p, start=start, end=end))  # s3fs: 2nd arg is a version


def sha256(path) -> str:
    """The object's sha256 hex (read whole: for small files)."""
    return hashlib.sha256(read_bytes(path)).hexdigest()


# numpy parses a .npy header with ast.literal_eval, and CPython 3.11.7's AST constructor is not thread-safe: two
# threads parsing at once raised "SystemError: AST constructor recursion depth mismatch" (the shard checks read
# their lengths indexes from a thread pool). One .npy load at a time (a download happens outside the lock).
_NPY_HEADER = threading.Lock()


def load_npy(path, mmap: bool = False):
    """A .npy file: memory-mapped if local and `mmap`, else (a URL) an array-like that reads only the slices
    asked for, one range request each."""
    if is_url(path) and mmap:
        return RemoteNpy(str(path))
    source = io.BytesIO(read_bytes(path)) if is_url(path) else path  # a download, outside the lock
    with _NPY_HEADER:
        return np.load(source, mmap_mode="r" if mmap else None)


class RemoteNpy:
    """A 1-D .npy object read by slices: `shape`, `dtype`, `len()` and `a[i:j]` (the only indexing the lengths
    index needs)."""

    def __init__(self, path: str):
        self.path = path
        head = io.BytesIO(read_bytes(path, 0, 4096))  # numpy's own header reader; ValueError if not a .npy
        version = np.lib.format.read_magic(head)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        with _NPY_HEADER:
            shape, fortran_order, self.dtype = read_header(head)
        if fortran_order or len(shape) != 1:
            raise ValueError("expected a 1-D array")
        self.shape, self._offset = tuple(shape), head.tell()

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # the whole array, one request
        return self[:].astype(dtype or self.dtype)

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("only contiguous slices")
        if stop <= start:
            return np.zeros(0, self.dtype)
        w = self.dtype.itemsize
        data = read_bytes(self.path, self._offset + start * w, self._offset + stop * w)
        return np.frombuffer(data, self.dtype)


def local_copy(path, into: str) -> str:
    """A local file with `path`'s bytes (the file itself if local), for readers that take only a file name."""
    if not is_url(path):
        return str(path)
    os.makedirs(into, exist_ok=True)
    local = os.path.join(into, os.path.basename(str(path)))
    with open(local + ".tmp", "wb") as f:
        f.write(read_bytes(path))
    os.replace(local + ".tmp", local)
    return local


# -- writing ------------------------------------------------------------------------------------------------------


def upload_dir(local_dir: str, url: str, last: str | None = None, print_fn=print) -> None:
    """Copies every file under local_dir to url/ (same relative names), `last` (a relative name) after all the
    others, so a reader never sees it before what it refers to. Each file is retried as a whole."""
    fs, root = _fs(url)
    names = sorted(os.path.relpath(os.path.join(d, f), local_dir)
                   for d, _, fs_names in os.walk(local_dir) for f in fs_names)
    if last in names:
        names.remove(last)
        names.append(last)
    total = sum(os.path.getsize(os.path.join(local_dir, n)) for n in names)
    start, done = time.perf_counter(), 0
    for i, name in enumerate(names):
        target = f"{root.rstrip('/')}/{name}"
        retried(f"{url.rstrip('/')}/{name}", fs.put_file, os.path.join(local_dir, name), target)
        done += os.path.getsize(os.path.join(local_dir, name))
        rate = done / 1e6 / max(time.perf_counter() - start, 1e-9)
        print_fn(f"upload: {i + 1}/{len(names)} files, {done / 1e6:.1f}/{total / 1e6:.1f} MB, {rate:.1f} MB/s "
                 f"-> {url}", flush=True)


def move_dir(src: str, dst: str) -> None:
    """Moves every object under the URL `src` to the same names under `dst`: copies, then deletes the originals
    (a bucket has no rename; fsspec's recursive one also copies the directory's own name, which S3 has no object
    for). Until it finishes, both names hold the files."""
    fs, src_root = _fs(src)
    src_root, dst_root = src_root.rstrip("/"), _fs(dst)[1].rstrip("/")
    names = [name[len(src_root) + 1:] for name in retried(src, fs.find, src_root)]
    for name in names:
        retried(f"{src}/{name}", fs.copy, f"{src_root}/{name}", f"{dst_root}/{name}")
    for name in names:
        retried(f"{src}/{name}", fs.rm_file, f"{src_root}/{name}")
