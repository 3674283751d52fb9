"""Tests of dataset_sources: `hf:` and `tfds:` specs -> DatasetSource, read offline from local files only."""

import json
import os
import pickle
import subprocess
import sys

import pytest

from jaxtrain.data import dataset_sources
from jaxtrain.data.dataset_sources import is_dataset_spec, open_dataset
from jaxtrain.data.sources import MISSING, SourceError

TEXTS = ["In the beginning was the word.", "Second — with ünïcode.", "Third one.", "Fourth.", "Fifth and last."]
TFDS_NAME = "jaxtrain_tiny_texts"  # the snake_case name TFDS derives from the builder class below
TFDS_TRAIN = [f"train document {i}: {'ü' * (i % 3)}" for i in range(30)]
TFDS_TEST = ["held out one", "held out two"]


@pytest.fixture(autouse=True)
def hf_offline(tmp_path, monkeypatch):
    # Never the hub, never the user's ~/.cache: the Arrow cache goes to this test's tmp dir.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


@pytest.fixture
def jsonl_dir(tmp_path):
    """Two JSONL files: TEXTS split over them, plus a null text and a record without the field."""
    d = tmp_path / "jsonl"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": t, "n": i} for i, t in enumerate(TEXTS[:3])] + [{"text": None, "n": 3}])
    write_jsonl(d / "b.jsonl", [{"n": 4}] + [{"text": t, "n": 5 + i} for i, t in enumerate(TEXTS[3:])])
    return d


JSONL_VALUES = TEXTS[:3] + [MISSING, MISSING] + TEXTS[3:]


def test_is_dataset_spec():
    assert is_dataset_spec("hf:json:x.jsonl") and is_dataset_spec("tfds:mnist")
    assert not is_dataset_spec("docs/*.jsonl") and not is_dataset_spec("gs://b/x.jsonl")


# ---------------------------------------------------------------------------------------------- Hugging Face


def test_hf_json_glob_reads_rows_in_order_and_slices(jsonl_dir):
    src = open_dataset(f"hf:json:{jsonl_dir}/*.jsonl")
    assert (src.spec, src.split, src.field, src.data_dir) == (f"hf:json:{jsonl_dir}/*.jsonl", "train", "text", None)
    assert src.num_rows == len(JSONL_VALUES) and src.size > 0
    assert list(src.values(0, src.num_rows)) == JSONL_VALUES
    assert list(src.values(2, 6)) == JSONL_VALUES[2:6]
    assert list(src.values(4, 4)) == []
    with pytest.raises(ValueError, match="out of range"):
        list(src.values(0, src.num_rows + 1))
    # Another column as is: the caller, not the source, decides that an int is not a document.
    assert list(open_dataset(f"hf:json:{jsonl_dir}/*.jsonl", field="n").values(0, 3)) == [0, 1, 2]


def test_hf_source_pickles_without_its_reader_and_reads_after(jsonl_dir):
    src = open_dataset(f"hf:json:{jsonl_dir}/*.jsonl")
    assert list(src.values(0, 1)) == TEXTS[:1]  # opens the reader here
    copy = pickle.loads(pickle.dumps(src))
    assert copy._reader is None and copy == src
    assert list(copy.values(1, copy.num_rows)) == JSONL_VALUES[1:]


def test_hf_identity_is_stable_and_follows_content(jsonl_dir, tmp_path, monkeypatch):
    spec = f"hf:json:{jsonl_dir}/*.jsonl"
    first = open_dataset(spec).identity
    assert open_dataset(spec).identity == first
    # A fresh cache dir (another machine, a wiped cache) is still the same input: no cache paths in identity.
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "other_cache"))
    assert open_dataset(spec).identity == first
    json.dumps(first)  # recorded in the manifest as is
    assert str(tmp_path / "hf_cache") not in json.dumps(first)

    write_jsonl(jsonl_dir / "b.jsonl", [{"text": "changed"}])
    changed = open_dataset(spec)
    assert changed.identity != first
    assert list(changed.values(0, changed.num_rows)) == TEXTS[:3] + [MISSING, "changed"]
    assert open_dataset(spec, split="train", field="n").identity != changed.identity


@pytest.mark.parametrize("builder", ["json", "csv", "parquet", "text"])
def test_hf_packaged_builders_read_local_files(tmp_path, builder):
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    path = tmp_path / f"docs.{builder if builder != 'text' else 'txt'}"
    table = pa.table({"text": TEXTS, "id": list(range(len(TEXTS)))})
    if builder == "json":
        write_jsonl(path, table.to_pylist())
    elif builder == "csv":
        pyarrow.csv.write_csv(table, path)
    elif builder == "parquet":
        pyarrow.parquet.write_table(table, path)
    else:
        path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")  # the text builder: one row per line
    src = open_dataset(f"hf:{builder}:{path}")
    assert list(src.values(0, src.num_rows)) == TEXTS


def test_hf_plain_dir_of_data_files_has_splits_by_file_name(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    write_jsonl(d / "train.jsonl", [{"text": t} for t in TEXTS[:3]])
    write_jsonl(d / "test.jsonl", [{"text": t} for t in TEXTS[3:]])
    assert list(open_dataset(f"hf:{d}").values(0, 3)) == TEXTS[:3]
    assert list(open_dataset(f"hf:json:{d}", split="test").values(0, 2)) == TEXTS[3:]  # a builder given a dir
    src = open_dataset(f"hf:{d}", split="test")
    assert list(src.values(0, src.num_rows)) == TEXTS[3:]
    with pytest.raises(SourceError, match=r"no split 'validation' \(has \['train', 'test'\]\)"):
        open_dataset(f"hf:{d}", split="validation")


def test_hf_save_to_disk_dataset_and_dataset_dict(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(dataset_sources, "_BATCH", 2)  # several read batches even for these few rows

    rows = TEXTS + [None]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    src = open_dataset(f"hf:{tmp_path / 'ds'}")
    assert list(src.values(0, src.num_rows)) == TEXTS + [MISSING]
    assert src.size == sum(f.stat().st_size for f in (tmp_path / "ds").glob("*.arrow"))

    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": TEXTS[:2]}),
        "test": datasets.Dataset.from_dict({"text": TEXTS[2:]}),
    }).save_to_disk(str(tmp_path / "dd"), num_shards={"train": 1, "test": 3})  # test: rows across 3 files
    test = pickle.loads(pickle.dumps(open_dataset(f"hf:{tmp_path / 'dd'}", split="test")))
    assert list(test.values(0, test.num_rows)) == TEXTS[2:]
    assert list(test.values(1, 3)) == TEXTS[3:5]
    assert len(test.paths) == 3 and test.size == sum(os.path.getsize(p) for p in test.paths)
    train = open_dataset(f"hf:{tmp_path / 'dd'}")
    assert list(train.values(0, train.num_rows)) == TEXTS[:2]
    assert train.identity != test.identity
    assert open_dataset(f"hf:{tmp_path / 'dd'}", split="test").identity == test.identity
    with pytest.raises(SourceError, match=r"no split 'dev' \(has \['train', 'test'\]\)"):
        open_dataset(f"hf:{tmp_path / 'dd'}", split="dev")


def test_hf_errors_are_one_line_and_name_the_spec(jsonl_dir, tmp_path):
    glob_spec = f"hf:json:{jsonl_dir}/*.jsonl"
    cases = [
        (f"hf:nosuchbuilder:{jsonl_dir}/a.jsonl", {}, "unknown hf builder 'nosuchbuilder'"),
        (f"hf:{tmp_path}/missing", {}, "no such file or directory"),
        (f"hf:{jsonl_dir}/a.jsonl", {}, "a file; name the builder that reads it, e.g. hf:json:"),
        (f"hf:json:{tmp_path}/*.nothing", {}, "matches no file"),
        (glob_spec, {"split": "test"}, r"no split 'test' \(has \['train'\]\)"),
        (glob_spec, {"field": "body"}, r"no column 'body' \(has \['text', 'n'\]\)"),
        (f"hf:{tmp_path}/empty", {}, "cannot load"),
        ("nope:x", {}, "unknown dataset prefix"),
    ]
    (tmp_path / "empty").mkdir()
    for spec, kwargs, message in cases:
        with pytest.raises(SourceError, match=message) as e:
            open_dataset(spec, **kwargs)
        assert str(e.value).startswith(f"{spec}: ") and "\n" not in str(e.value)


def test_missing_libraries_say_what_to_install(monkeypatch, jsonl_dir):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(SourceError, match=r"^hf:json:x: .*pip install 'jaxtrain\[hf\]'"):
        open_dataset("hf:json:x")
    with pytest.raises(SourceError, match=r"^tfds:mnist: .*pip install 'jaxtrain\[tfds\]'"):
        open_dataset("tfds:mnist")


# ---------------------------------------------------------------------------------------------- TFDS


@pytest.fixture(scope="module")
def tfds_data(tmp_path_factory):
    """A tiny TFDS dataset (config 'plain', version 1.0.0) prepared as array_record from a local JSON file."""
    import numpy as np
    import tensorflow_datasets as tfds

    root = tmp_path_factory.mktemp("tfds")
    (root / "texts.json").write_text(json.dumps({"train": TFDS_TRAIN, "test": TFDS_TEST}), encoding="utf-8")

    class JaxtrainTinyTexts(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="plain")]
        SOURCE = str(root / "texts.json")  # read locally: nothing to download

        def _info(self):
            # DatasetInfo directly: dataset_info_from_configs wants metadata files next to the class's module.
            # disable_shuffling keeps the generated order, so rows can be compared with the source list.
            return tfds.core.DatasetInfo(builder=self, disable_shuffling=True, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "id": np.int64}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

        def _generate_examples(self, split):
            with open(self.SOURCE, encoding="utf-8") as f:
                texts = json.load(f)[split]
            for i, text in enumerate(texts):
                yield i, {"text": text, "id": i}

    data_dir = root / "data"
    JaxtrainTinyTexts(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir), str(data_dir / TFDS_NAME / "plain" / "1.0.0")


# Runs in a fresh interpreter that never imports this test module, so the builder class does not exist there:
# reading must work from the prepared files alone. Also checks which libraries each kind of read imports.
READER_SCRIPT = """
import json, pickle, sys
from jaxtrain.data import dataset_sources
from jaxtrain.data import layout
from jaxtrain.tools import prepare as prepare_cli
assert "datasets" not in sys.modules and "tensorflow_datasets" not in sys.modules, "import must stay cheap"
hf = pickle.loads(open(sys.argv[2], "rb").read())
hf_values = list(hf.values(0, hf.num_rows))
assert "datasets" not in sys.modules, "reading an opened hf source needs only pyarrow"
out = {"hf": hf_values}
for key, spec, kwargs in json.loads(sys.argv[1]):
    src = dataset_sources.open_dataset(spec, **kwargs)
    out[key] = [v.decode() for v in src.values(0, src.num_rows)]
    out[key + ":pickled"] = [v.decode() for v in pickle.loads(pickle.dumps(src)).values(0, src.num_rows)]
print(json.dumps(out))
"""


def test_tfds_reads_prepared_files_without_the_builder_class(tfds_data, tmp_path):
    data_dir, builder_dir = tfds_data
    import datasets

    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "hf.pkl").write_bytes(pickle.dumps(open_dataset(f"hf:{tmp_path / 'ds'}")))
    cases = [
        ("versioned", f"tfds:{TFDS_NAME}/plain:1.0.0", {"data_dir": data_dir}),
        ("latest", f"tfds:{TFDS_NAME}/plain", {"data_dir": data_dir}),
        ("dir", f"tfds:{builder_dir}", {}),
        ("test", f"tfds:{builder_dir}", {"split": "test"}),
        ("sliced", f"tfds:{TFDS_NAME}/plain:1.0.0", {"data_dir": data_dir, "split": "train[:10%]+test[1:]"}),
    ]
    result = subprocess.run([sys.executable, "-c", READER_SCRIPT, json.dumps(cases), str(tmp_path / "hf.pkl")],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TFDS_DATA_DIR": str(tmp_path / "no_default")})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["hf"] == TEXTS
    for key, expected in [("versioned", TFDS_TRAIN), ("latest", TFDS_TRAIN), ("dir", TFDS_TRAIN),
                          ("test", TFDS_TEST), ("sliced", TFDS_TRAIN[:3] + TFDS_TEST[1:])]:
        assert out[key] == expected, key
        assert out[key + ":pickled"] == expected, key


def test_tfds_source_fields_slices_and_identity(tfds_data, monkeypatch):
    data_dir, builder_dir = tfds_data
    monkeypatch.setattr(dataset_sources, "_BATCH", 2)  # reads cross batch boundaries
    src = open_dataset(f"tfds:{TFDS_NAME}/plain:1.0.0", data_dir=data_dir, split="train[10:20]")
    assert (src.split, src.field, src.data_dir, src.num_rows) == ("train[10:20]", "text", data_dir, 10)
    assert [v.decode() for v in src.values(2, 5)] == TFDS_TRAIN[12:15]
    assert 0 < src.size < open_dataset(f"tfds:{builder_dir}").size  # a slice weighs its share of the shard
    # A non-text feature comes through as is (the caller counts it as not text).
    assert [int(v) for v in open_dataset(f"tfds:{builder_dir}", field="id").values(0, 4)] == [0, 1, 2, 3]

    ident = open_dataset(f"tfds:{builder_dir}").identity
    assert open_dataset(f"tfds:{TFDS_NAME}/plain:1.0.0", data_dir=data_dir).identity == ident
    monkeypatch.chdir(os.path.dirname(data_dir))  # a relative data_dir means the same dataset
    assert open_dataset(f"tfds:{TFDS_NAME}/plain:1.0.0", data_dir=os.path.basename(data_dir)).identity == ident
    assert ident["name"] == TFDS_NAME and ident["config"] == "plain" and ident["version"] == "1.0.0"
    assert open_dataset(f"tfds:{builder_dir}", split="test").identity != ident
    assert open_dataset(f"tfds:{builder_dir}", split="train[:50%]").identity != ident
    json.dumps(ident)


def test_tfds_errors_are_one_line_and_name_the_spec(tfds_data, tmp_path):
    data_dir, builder_dir = tfds_data
    spec = f"tfds:{TFDS_NAME}/plain:1.0.0"
    cases = [
        (spec, {"data_dir": data_dir, "split": "validation"}, r"Unknown split 'validation'.*'train'"),
        (spec, {"data_dir": data_dir, "split": "train[abc]"}, "split 'train\\[abc\\]'"),
        (spec, {"data_dir": data_dir, "field": "body"}, r"no feature 'body' \(has \['id', 'text'\]\)"),
        (f"tfds:{TFDS_NAME}/plain:2.0.0", {"data_dir": data_dir}, r"not prepared in .*\(found plain/1.0.0\)"),
        (spec, {"data_dir": str(tmp_path)}, "not prepared in"),
        (f"tfds:{tmp_path}/missing", {}, "no such directory"),
        (f"tfds:{os.path.dirname(builder_dir)}", {}, "not a prepared TFDS builder dir"),
    ]
    for spec, kwargs, message in cases:
        with pytest.raises(SourceError, match=message) as e:
            open_dataset(spec, **kwargs)
        assert str(e.value).startswith(f"{spec}: ") and "\n" not in str(e.value)


def test_tfds_refuses_a_dataset_without_array_record_files(tfds_data, tmp_path):
    import shutil

    _, builder_dir = tfds_data
    # Writing real TFRecord files needs TensorFlow; what is checked is the format the dataset info declares.
    copy = tmp_path / "tfrecord_copy"
    shutil.copytree(builder_dir, copy)
    info = json.loads((copy / "dataset_info.json").read_text())
    info["fileFormat"] = "tfrecord"
    (copy / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(SourceError, match=r"^tfds:.*: prepared as tfrecord; reading needs array_record"):
        open_dataset(f"tfds:{copy}")



# ---------------------------------------------------------------------------------------------- through prepare


def test_prepare_hf_input_in_parallel_round_trips_and_trains(jsonl_dir, tmp_path, tiny_config, capsys):
    from test_prepare_sources import read_back

    from jaxtrain import train
    from jaxtrain.data import layout
    from jaxtrain.tools import prepare as prepare_cli

    out = tmp_path / "prepared"
    args = ["--input", f"hf:json:{jsonl_dir}/*.jsonl", "--output", str(out), "--vocab_size", "300",
            "--heldout_docs", "1", "--num_shards", "2", "--workers", "2"]
    assert prepare_cli.main(args) == 0
    assert read_back(out) == sorted(TEXTS)
    m = layout.load_manifest(out)
    assert len(m["splits"]["train"]) == 2 and m["split"] == "train"
    assert m["sources"][0]["skipped"] == {"missing_field": 2} and m["sources"][0]["kind"] == "hf"
    assert "skipped 2 (missing_field 2)" in capsys.readouterr().out
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare_cli.main(args) == 0  # the same dataset again: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before

    cfg = tiny_config(**{"data.dir": str(out), "data.vocab_size": 300, "train.steps": 2, "optim.warmup_steps": 0,
                         "train.seq_len": 8, "train.batch_size": 8, "eval.batches": 1})
    assert train.run(cfg, print_fn=lambda *a: None)["step"] == 2


def test_prepare_tfds_input_round_trips(tfds_data, tmp_path):
    from test_prepare_sources import read_back

    from jaxtrain.tools import prepare as prepare_cli

    data_dir, builder_dir = tfds_data
    common = ["--vocab_size", "300", "--heldout_docs", "3", "--num_shards", "3"]
    assert prepare_cli.main(["--input", f"tfds:{TFDS_NAME}/plain:1.0.0", "--tfds_data_dir", data_dir,
                         "--output", str(tmp_path / "by_name"), *common]) == 0
    assert read_back(tmp_path / "by_name") == sorted(TFDS_TRAIN)
    assert prepare_cli.main(["--input", f"tfds:{builder_dir}", "--split", "test", "--output", str(tmp_path / "test"),
                         "--workers", "2", "--vocab_size", "300", "--heldout_docs", "1"]) == 0
    assert read_back(tmp_path / "test") == sorted(TFDS_TEST)
    assert prepare_cli.main(["--input", f"tfds:{TFDS_NAME}/plain:9.9.9", "--tfds_data_dir", data_dir,
                         "--output", str(tmp_path / "missing"), *common]) == 2
    assert not (tmp_path / "missing").exists()
