"""Documents from dataset catalogs for `prepare --input`: Hugging Face `datasets` and TFDS.

Specs:
  hf:DIR                  a `save_to_disk` dir (Dataset or DatasetDict), or a dir of data files `load_dataset` reads
  hf:BUILDER:GLOB         local data files read by a packaged builder: hf:json:'docs/*.jsonl', hf:parquet:..., csv, text
  tfds:NAME[/CONFIG][:VERSION]   a TFDS dataset prepared (file_format=array_record) in `data_dir`
  tfds:BUILDER_DIR        a prepared builder dir, e.g. ~/tensorflow_datasets/my_corpus/1.0.0

`open_dataset` resolves and validates a spec in the calling process and returns a small picklable
`DatasetSource`; worker processes call `values(start, stop)` on it, which reopens exactly what was resolved
(the split's Arrow files for hf, the builder dir for tfds), so a worker needs neither the HF cache lookup nor
the TFDS builder class. `datasets` and `tensorflow_datasets` are imported only when a spec needs them.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Iterator

from etils import epath

from jaxtrain.files import file_hash
from jaxtrain.errors import SourceError

DATASET_PREFIXES = ("hf:", "tfds:")
MISSING = object()  # a record without the text field (counted as missing_field)
RECORD = "*"  # the field of chat data that is each whole record (JSONL line, dataset row)
HF_BUILDERS_HINT = ("json", "parquet", "csv", "text", "arrow")
_BATCH = 1024  # rows decoded per read: amortises Arrow/ArrayRecord call overhead, bounds memory


def is_dataset_spec(spec: str) -> bool:
    return spec.startswith(DATASET_PREFIXES)


@dataclasses.dataclass
class DatasetSource:
    spec: str
    split: str
    field: str
    data_dir: str | None
    num_rows: int
    size: int
    identity: dict
    # What open_dataset resolved, so every process reads the same data without resolving the spec again:
    # hf: the split's Arrow files in row order; tfds: the prepared builder dir.
    paths: tuple[str, ...] = ()
    _reader: object = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_reader"] = None  # open file handles do not travel; the receiving process reopens lazily
        return state

    def values(self, start: int, stop: int) -> Iterator[object]:
        """Raw values of rows [start, stop) in order: str/bytes as stored, MISSING for an absent/null field."""
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"{self.spec}: rows [{start}, {stop}) out of range [0, {self.num_rows})")
        if self._reader is None:
            if self.spec.startswith("hf:"):
                self._reader = _ArrowColumnReader(self.paths, self.field)
            else:
                self._reader = _TfdsFieldReader(self.paths[0], self.split, self.field)
        return self._reader.values(start, stop)


def open_dataset(spec: str, *, split: str = "train", field: str = "text", data_dir: str | None = None) -> DatasetSource:
    """Resolves spec and checks split and field up front; every failure is a one-line SourceError."""
    if spec.startswith("hf:"):
        return _open_hf(spec, spec[len("hf:") :], split, field)
    if spec.startswith("tfds:"):
        return _open_tfds(spec, spec[len("tfds:") :], split, field, data_dir)
    raise SourceError(f"{spec}: unknown dataset prefix (expected one of {', '.join(DATASET_PREFIXES)})")


# ---------------------------------------------------------------------------------------------- Hugging Face


def _open_hf(spec: str, rest: str, split: str, field: str) -> DatasetSource:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{spec}: reading hf: datasets needs `datasets` (pip install 'jaxtrain[hf]')") from None
    # Tests and users point the cache away from ~/.cache; read the env now, not at `datasets` import time.
    cache_dir = os.environ.get("HF_DATASETS_CACHE") or None
    builder_name, target = _split_hf_builder(rest)
    try:
        if builder_name is None:
            path = os.path.abspath(os.path.expanduser(target))
            if not os.path.exists(path):
                raise SourceError(f"{spec}: no such file or directory (hub datasets are not read directly: "
                                  "save_to_disk one and use hf:DIR, or use hf:BUILDER:GLOB)")
            if os.path.isfile(path):
                raise SourceError(f"{spec}: a file; name the builder that reads it, e.g. hf:json:{target}")
            if os.path.isfile(os.path.join(path, datasets.config.DATASETDICT_JSON_FILENAME)):
                ds, origin = _load_saved_dict_split(spec, datasets, path, split), path
            elif os.path.isfile(os.path.join(path, datasets.config.DATASET_STATE_JSON_FILENAME)):
                ds, origin = _load_saved_dataset(spec, datasets, path, split), path
            else:
                ds, origin = _build_split(spec, datasets, split, cache_dir, path=path), path
        else:
            known = sorted(datasets.packaged_modules._PACKAGED_DATASETS_MODULES)
            if builder_name not in known:
                raise SourceError(f"{spec}: unknown hf builder {builder_name!r} "
                                  f"(one of {', '.join(HF_BUILDERS_HINT)}, ...; or hf:DIR)")
            pattern = os.path.abspath(os.path.expanduser(target))
            if os.path.isdir(pattern):
                ds = _build_split(spec, datasets, split, cache_dir, path=builder_name, data_dir=pattern)
            elif glob.glob(pattern, recursive=True):
                ds = _build_split(spec, datasets, split, cache_dir, path=builder_name, data_files=pattern)
            else:
                raise SourceError(f"{spec}: {target} matches no file")
            origin = f"{builder_name}:{pattern}"
    except SourceError:
        raise
    except Exception as e:  # `datasets` raises many types (FileNotFoundError, DatasetGenerationError, ...).
        raise SourceError(f"{spec}: cannot load ({_one_line(e)})") from None

    if field != RECORD and field not in ds.column_names:
        raise SourceError(f"{spec}: no column {field!r} (has {ds.column_names})")
    if ds._indices is not None:  # rows would not be the Arrow files' rows; save_to_disk/load_dataset never do this
        raise SourceError(f"{spec}: dataset has an indices mapping; save it with flatten_indices() first")
    paths = tuple(f["filename"] for f in ds.cache_files)
    if not paths:
        raise SourceError(f"{spec}: dataset is in memory only (unset HF_DATASETS_IN_MEMORY_MAX_SIZE)")
    files = [[os.path.getsize(p), file_hash(p)] for p in paths]
    # Hash the Arrow files themselves (what workers read), not their paths: HF cache paths differ between
    # machines and cache dirs, while the bytes are the same whenever the content is.
    identity = {"kind": "hf", "source": origin, "split": split, "field": field, "files": files}
    return DatasetSource(spec=spec, split=split, field=field, data_dir=None, num_rows=ds.num_rows,
                         size=sum(size for size, _ in files), identity=identity, paths=paths)


def _split_hf_builder(rest: str) -> tuple[str | None, str]:
    """'json:docs/*.jsonl' -> ('json', 'docs/*.jsonl'); a plain path -> (None, path)."""
    name, sep, target = rest.partition(":")
    if sep and re.fullmatch(r"[A-Za-z_][\w-]*", name) and not os.path.exists(rest):
        return name, target
    return None, rest


def _load_saved_dict_split(spec: str, datasets, path: str, split: str):
    with open(os.path.join(path, datasets.config.DATASETDICT_JSON_FILENAME)) as f:
        splits = json.load(f)["splits"]
    if split not in splits:
        raise SourceError(f"{spec}: no split {split!r} (has {splits})")
    # Only the chosen split's subdir: loading the whole DatasetDict would map every split's files.
    return datasets.load_from_disk(os.path.join(path, split), keep_in_memory=False)


def _load_saved_dataset(spec: str, datasets, path: str, split: str):
    ds = datasets.load_from_disk(path, keep_in_memory=False)
    # A saved Dataset is one split; accept the default name or the split it remembers.
    if split not in ("train", str(ds.split)):
        raise SourceError(f"{spec}: a single saved Dataset (split {str(ds.split)!r}); no split {split!r}")
    return ds


def _build_split(spec: str, datasets, split: str, cache_dir: str | None, **builder_kwargs):
    builder = datasets.load_dataset_builder(cache_dir=cache_dir, **builder_kwargs)
    # Packaged builders know their splits from the data files: check before converting anything to Arrow.
    data_files = builder.config.data_files
    if data_files is not None and split not in [str(s) for s in data_files]:
        raise SourceError(f"{spec}: no split {split!r} (has {[str(s) for s in data_files]})")
    builder.download_and_prepare()
    if split not in builder.info.splits:
        raise SourceError(f"{spec}: no split {split!r} (has {list(builder.info.splits)})")
    return builder.as_dataset(split=split, in_memory=False)


class _ArrowColumnReader:
    """The field's column of Arrow IPC stream files (HF's on-disk format), memory-mapped: no `datasets` needed.
    Field RECORD: every column, each row a dict."""

    def __init__(self, paths: tuple[str, ...], field: str):
        import pyarrow as pa

        tables = [pa.ipc.open_stream(pa.memory_map(p)).read_all() for p in paths]
        self.rows = pa.concat_tables(tables) if field == RECORD else None
        self.column = None if field == RECORD else pa.concat_tables([t.select([field]) for t in tables]).column(0)

    def values(self, start: int, stop: int) -> Iterator[object]:
        if self.rows is not None:
            for batch in self.rows.slice(start, stop - start).to_batches(max_chunksize=_BATCH):
                yield from batch.to_pylist()
            return
        for chunk in self.column.slice(start, stop - start).chunks:
            for offset in range(0, len(chunk), _BATCH):
                for v in chunk.slice(offset, _BATCH).to_pylist():
                    yield MISSING if v is None else v


# ---------------------------------------------------------------------------------------------- TFDS


def _open_tfds(spec: str, rest: str, split: str, field: str, data_dir: str | None) -> DatasetSource:
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise SourceError(f"{spec}: reading tfds: datasets needs `tensorflow_datasets` "
                          "(pip install 'jaxtrain[tfds]')") from None
    from tensorflow_datasets.core import read_only_builder

    if not rest:
        raise SourceError(f"{spec}: empty dataset name")
    expanded = os.path.expanduser(rest)
    try:
        if "://" in rest or rest.startswith(("/", ".", "~")) or epath.Path(expanded).is_dir():
            builder_dir = epath.Path(expanded if "://" in rest else os.path.abspath(expanded))
            if not builder_dir.is_dir():
                raise SourceError(f"{spec}: no such directory")
            if not (builder_dir / "dataset_info.json").exists():
                raise SourceError(f"{spec}: not a prepared TFDS builder dir (no dataset_info.json; "
                                  "expected DATA_DIR/NAME[/CONFIG]/VERSION)")
            builder = tfds.builder_from_directory(builder_dir)
        else:
            # From the prepared files only, never the builder class: `tfds.builder` would import (and could
            # try to run) generation code, which a reader process may not have.
            # An absolute data_dir, so builder_dir (in identity, and reopened by workers) does not depend on cwd.
            local = data_dir and "://" not in data_dir
            search_dir = os.path.abspath(os.path.expanduser(data_dir)) if local else data_dir
            try:
                builder = read_only_builder.builder_from_files(rest, data_dir=search_dir)
            except tfds.core.DatasetNotFoundError:
                where = data_dir or "TFDS's default data_dir ($TFDS_DATA_DIR or ~/tensorflow_datasets)"
                found = _prepared_under(search_dir, rest)
                raise SourceError(f"{spec}: not prepared in {where}"
                                  + (f" (found {', '.join(found)})" if found else "")) from None
    except SourceError:
        raise
    except Exception as e:  # Unparsable names, unreadable or inconsistent metadata.
        raise SourceError(f"{spec}: cannot load ({_one_line(e)})") from None

    info = builder.info
    if tfds.core.file_adapters.FileFormat.ARRAY_RECORD not in info.available_file_formats():
        formats = sorted(f.value for f in info.available_file_formats()) or ["unknown"]
        raise SourceError(f"{spec}: prepared as {'/'.join(formats)}; reading needs array_record "
                          "(download_and_prepare with file_format='array_record')")
    features = info.features
    names = sorted(features.keys()) if isinstance(features, tfds.features.FeaturesDict) else []
    if field == RECORD:
        raise SourceError(f"{spec}: a tfds: input gives chat data from one feature; name it with --field")
    if field not in names:
        raise SourceError(f"{spec}: no feature {field!r} (has {names})")
    try:
        reader = _TfdsFieldReader(os.fspath(builder.data_dir), split, field, builder=builder)
    except Exception as e:  # Unknown split names, bad slice syntax, missing shard files.
        raise SourceError(f"{spec}: split {split!r}: {_one_line(e)}") from None

    split_info = info.splits[split]
    files, size = [], 0.0
    for fi in split_info.file_instructions:
        file_size = epath.Path(fi.filename).stat().length
        # A slice reads only part of a shard; scale, so sharding balances on what is actually read.
        size += file_size * fi.take / max(fi.examples_in_shard, 1)
        files.append([os.path.basename(fi.filename), file_size, fi.skip, fi.take])
    identity = {"kind": "tfds", "builder_dir": os.fspath(builder.data_dir), "name": info.name,
                "config": info.config_name or None, "version": str(info.version), "split": split, "field": field,
                "dataset_info_sha256": file_hash(epath.Path(builder.data_dir) / "dataset_info.json"), "files": files}
    source = DatasetSource(spec=spec, split=split, field=field, data_dir=data_dir, num_rows=len(reader.source),
                           size=int(size), identity=identity, paths=(os.fspath(builder.data_dir),))
    source._reader = reader  # already open here; a pickled copy reopens
    return source


def _prepared_under(data_dir: str | None, name: str) -> list[str]:
    """CONFIG/VERSION dirs prepared for the name's dataset, to say what does exist."""
    if not data_dir:
        return []
    root = epath.Path(data_dir) / name.split(":")[0].split("/")[0]
    if not root.is_dir():
        return []
    # VERSION or CONFIG/VERSION; epath's glob has no `**`.
    infos = [*root.glob("*/dataset_info.json"), *root.glob("*/*/dataset_info.json")]
    return sorted(os.fspath(p.parent.relative_to(root)) for p in infos)


class _TfdsFieldReader:
    """One feature of a prepared TFDS split via an ArrayRecord data source; works without TensorFlow."""

    def __init__(self, builder_dir: str, split: str, field: str, builder=None):
        import tensorflow_datasets as tfds

        builder = builder or tfds.builder_from_directory(builder_dir)
        self.field = field
        self.source = builder.as_data_source(split=split, file_format="array_record",
                                             deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
        feature = builder.info.features[field]
        info = feature.get_serialized_info()
        # A scalar string (Text without encoder, or Tensor(shape=())) is one bytes value in the tf.Example: read
        # it from the proto directly, skipping TFDS's generic numpy decoding, which costs far more per record.
        self.plain_bytes = (type(feature) in (tfds.features.Text, tfds.features.Tensor)
                            and getattr(info, "shape", None) == () and getattr(info, "np_dtype", None) == object)
        if self.plain_bytes:
            from tensorflow_datasets.proto import tf_example_pb2

            self.parse = tf_example_pb2.Example.FromString
        else:
            # Parse and decode only this feature: a sibling image or audio feature would cost far more.
            self.decoder = tfds.features.FeaturesDict({field: feature})

    def values(self, start: int, stop: int) -> Iterator[object]:
        for lo in range(start, stop, _BATCH):
            for raw in self.source.__getitems__(list(range(lo, min(lo + _BATCH, stop)))):
                if self.plain_bytes:
                    feature = self.parse(raw).features.feature.get(self.field)
                    yield feature.bytes_list.value[0] if feature is not None and feature.bytes_list.value else MISSING
                else:
                    v = self.decoder.deserialize_example_np(raw).get(self.field, MISSING)
                    yield MISSING if v is None else v


# ---------------------------------------------------------------------------------------------- helpers


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
