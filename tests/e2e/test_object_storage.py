"""Data and checkpoints in buckets, against local emulators (tests/emulators.py): `prepare` into gs:// and s3://,
training and exact resume from gs:// and s3:// data (sparse shard copies) with the checkpoints in the same bucket,
a damaged s3:// checkpoint moved aside, reads, uploads and a checkpoint save that outlast an outage, and a
missing object named in one line."""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read when gcsfs is imported

import emulators  # noqa: E402
from data.test_data_pipeline import tiny_prepared_dir  # noqa: E402

from jaxtrain import storage  # noqa: E402
from jaxtrain.data import pipeline  # noqa: E402
from jaxtrain.errors import DataError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs")
    server = emulators.GCS(root)
    server.start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    import gcsfs
    gcsfs.GCSFileSystem.clear_instance_cache()  # an instance keeps the endpoint it was made with
    yield server
    server.stop()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3():
    server = emulators.S3()
    server.start()
    yield server
    server.stop()


def jaxtrain(*args, env=None, cwd=None):
    return subprocess.run([sys.executable, "-m", "jaxtrain", *map(str, args)], capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, **(env or {})}, cwd=cwd)


def bucket_files(fs, root):
    return {p[len(root) + 1:]: fs.cat_file(p) for p in fs.find(root)}


def local_files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


def losses(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture
def gcs_in_memory():
    server = emulators.GCS()
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_prepare_into_buckets_then_train_and_resume_from_gcs_with_checkpoints_there(gcs_in_memory, s3,
                                                                                    tiny_data_dir, tmp_path):
    import gcsfs
    import s3fs

    gcs = gcs_in_memory

    # prepare: the (already prepared) staging dir is uploaded as it is, manifest last; a rerun finds it there.
    prepare = ["prepare", "--output", None, "--vocab_size", 512, "--staging", tiny_data_dir]
    for url, env, fs in [("gs://bucket/kjv", gcs.env(), gcsfs.GCSFileSystem(endpoint_url=gcs.url, token="anon",
                                                                             skip_instance_cache=True)),
                         ("s3://bucket/kjv", s3.env(), s3fs.S3FileSystem(endpoint_url=s3.url, key="test",
                                                                           secret="test"))]:
        prepare[2] = url
        first = jaxtrain(*prepare, env=env)
        assert first.returncode == 0, first.stderr[-2000:]
        assert bucket_files(fs, "bucket/kjv") == local_files(tiny_data_dir)
        again = jaxtrain(*prepare, env=env)
        assert again.returncode == 0 and "already holds this data" in again.stdout, again.stderr[-2000:]

    # The same run, all local and from the bucket (stopped at step 3, resumed): the same losses, and the bucket
    # run's checkpoints are in the bucket, not its workdir.
    run = ["train", "--config", REPO / "configs/tiny.py", "--config.train.steps=6", "--config.checkpoint.every_steps=3",
           "--config.eval.every_steps=3"]
    local = jaxtrain(*run, f"--config.workdir={tmp_path / 'local'}", f"--config.data.dir={tiny_data_dir}")
    assert local.returncode == 0, local.stderr[-2000:]
    remote = [*run, f"--config.workdir={tmp_path / 'remote'}", "--config.data.dir=gs://bucket/kjv",
              "--config.checkpoint.dir=gs://bucket/ckpt"]
    stopped = jaxtrain(*remote, "--config.train.stop_at=3", env=gcs.env())
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    resumed = jaxtrain(*remote, env=gcs.env())
    assert resumed.returncode == 0 and "resumed from checkpoint at step 3" in resumed.stdout, resumed.stderr[-2000:]
    assert losses(tmp_path / "remote") == losses(tmp_path / "local") and len(losses(tmp_path / "local")) == 6
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs.url, token="anon", skip_instance_cache=True)
    assert {p.rsplit("/", 1)[-1] for p in fs.ls("bucket/ckpt")} >= {"3", "6"}
    assert not (tmp_path / "remote" / "checkpoints").exists()

    # From s3://, whose shards are read through sparse local copies (a range request per block), with the
    # checkpoints there too (tensorstore's s3 driver, through orbax_s3): the same.
    from_s3 = [*run, f"--config.workdir={tmp_path / 's3'}", "--config.data.dir=s3://bucket/kjv",
               "--config.checkpoint.dir=s3://bucket/ckpt"]
    env = {**s3.env(), "HOME": str(tmp_path / "home")}  # the copies go under ~/.cache/jaxtrain/remote
    stopped = jaxtrain(*from_s3, "--config.train.stop_at=3", env=env)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    resumed = jaxtrain(*from_s3, env=env)
    assert resumed.returncode == 0 and "resumed from checkpoint at step 3" in resumed.stdout, resumed.stderr[-2000:]
    assert losses(tmp_path / "s3") == losses(tmp_path / "local")
    fs = s3fs.S3FileSystem(endpoint_url=s3.url, key="test", secret="test", skip_instance_cache=True)
    assert {p.rsplit("/", 1)[-1] for p in fs.ls("bucket/ckpt")} >= {"3", "6"}
    assert fs.exists("bucket/ckpt/6/commit_success.txt") and not (tmp_path / "s3" / "checkpoints").exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A data dir made by prepare (so with block offsets): 5,000 short documents in 2 shards, 5 blocks."""
    from jaxtrain.data import prepare

    tmp = tmp_path_factory.mktemp("prepared")
    rng = np.random.default_rng(1)
    words = ["in", "the", "beginning", "was", "word", "and", "light", "water", "earth", "day"]
    (tmp / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 12)))}) + "\n" for _ in range(5000)))
    prepare.prepare_sources(str(tmp / "d"), [str(tmp / "docs.jsonl")], vocab_size=300, heldout_docs=5,
                            num_shards=2, workers=1, print_fn=lambda *a, **k: None)
    return str(tmp / "d")


def same_rows(want, got, starts, seq_len=64):
    for i in starts:
        a, b = want.row(i, seq_len), got.row(i, seq_len)
        assert all((a[k] == b[k]).all() for k in ("tokens", "segment_ids")), i


def test_gcs_reads_uploads_and_saves_outlast_an_outage_and_a_missing_object_is_named(gcs, prepared, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # A dir from before the block offsets: ArrayRecord's own gs:// reads.
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, rng.integers(2, 9)).tolist() for _ in range(300)]
    old = tiny_prepared_dir(tmp_path / "old", docs, block_records=4, shards=3)
    storage.upload_dir(old, "gs://bucket/reads/old", last="manifest.json", print_fn=lambda *a, **k: None)
    same_rows(pipeline.PackedStream(old, "train", seed=3), pipeline.PackedStream("gs://bucket/reads/old", "train",
                                                                                   seed=3), range(0, 1500, 37))

    # A prepared dir: sparse copies, a block per request; the emulator goes down for ~3 s as the next rows need
    # new blocks, and the reads wait it out.
    storage.upload_dir(prepared, "gs://bucket/reads/d", last="manifest.json", print_fn=lambda *a, **k: None)
    want = pipeline.PackedStream(prepared, "train", seed=3)
    got = pipeline.PackedStream("gs://bucket/reads/d", "train", seed=3)
    assert got.records.sparse and not pipeline.PackedStream("gs://bucket/reads/old", "train", seed=0).records.sparse
    step = want.epoch_tokens // 7
    same_rows(want, got, range(0, 3 * step, step))
    got.records.close()
    gcs.stop()
    threading.Timer(3, gcs.start).start()
    with pytest.raises(OSError):
        urllib.request.urlopen(gcs.url, timeout=1)
    same_rows(want, got, range(3 * step, 20 * step, step))  # gcsfs's own retries, then ours (storage.retried)

    # An upload that starts while the emulator is down finishes once it is back, every file whole.
    gcs.stop()
    threading.Timer(3, gcs.start).start()
    storage.upload_dir(prepared, "gs://bucket/reads/again", last="manifest.json", print_fn=lambda *a, **k: None)
    assert all(storage.read_bytes(f"gs://bucket/reads/again/{name}") == data
               for name, data in local_files(prepared).items())

    # So does a checkpoint save (gcsfs for the metadata, tensorstore for the arrays: each retries), and the
    # step restores whole.
    from test_checkpoint_faults import abstract, make_state

    from jaxtrain import checkpoint

    ckpt = checkpoint.Checkpointer("gs://bucket/ckpt-outage", keep=2)
    ckpt.save(1, make_state(1), {"pos": 1})
    ckpt.wait()
    gcs.stop()
    threading.Timer(3, gcs.start).start()
    ckpt.save(2, make_state(2), {"pos": 2})
    ckpt.close()
    step, state, data = checkpoint.Checkpointer("gs://bucket/ckpt-outage", keep=2).restore_latest(
        abstract(make_state(2)))
    assert (step, data) == (2, {"pos": 2})
    assert [np.asarray(a).tobytes() for a in jax.tree.leaves(state)] == [  # bitwise: w is random bits, NaNs too
        np.asarray(b).tobytes() for b in jax.tree.leaves(make_state(2))]

    with pytest.raises(DataError, match="gs://bucket/reads/d/nothing.npy: FileNotFoundError"):
        storage.read_bytes("gs://bucket/reads/d/nothing.npy")
    with pytest.raises(DataError, match=r"gs://bucket/nowhere/manifest.json: missing"):
        pipeline.PackedStream("gs://bucket/nowhere", "train", seed=0)


def test_retries_back_off_until_the_deadline_and_permanent_errors_fail_at_once(monkeypatch):
    monkeypatch.setattr(storage, "FIRST_WAIT", 0.01)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert storage.retried("gs://b/x", flaky) == "ok" and len(calls) == 3

    def down():
        calls.append(1)
        raise TimeoutError("timed out")

    # An outage that outlasts the budget (JAXTRAIN_STORAGE_RETRY_SECONDS) is the storage's, not the data's; the
    # next request to that bucket then tries once, instead of waiting the budget out again.
    monkeypatch.setenv(storage.RETRY_ENV, "0.1")
    calls.clear()
    with pytest.raises(storage.StorageUnavailable, match=r"^gs://b/y: storage unreachable \(TimeoutError: timed "
                                                         r"out\) after 0.1s of retries .* the data is not damaged"):
        storage.retried("gs://b/y", down)
    assert len(calls) > 1
    calls.clear()
    with pytest.raises(storage.StorageUnavailable):
        storage.retried("gs://b/w", down)
    assert len(calls) == 1
    assert storage.retried("gs://b/v", lambda: "ok") == "ok"  # back: the full budget again
    calls.clear()
    assert storage.retried("gs://b/x", flaky) == "ok" and len(calls) == 3
    monkeypatch.setenv(storage.RETRY_ENV, "soon")
    with pytest.raises(DataError, match="JAXTRAIN_STORAGE_RETRY_SECONDS: 'soon' is not a number"):
        storage.retried("gs://b/x", flaky)
    monkeypatch.delenv(storage.RETRY_ENV)

    def missing():
        calls.append(1)
        raise FileNotFoundError("no such object")

    calls.clear()
    with pytest.raises(DataError, match="^gs://b/z: FileNotFoundError: no such object$"):
        storage.retried("gs://b/z", missing)
    assert len(calls) == 1


def test_s3_shards_read_through_sparse_copies_match_local_and_old_dirs_are_refused(s3, prepared, tmp_path,
                                                                                   monkeypatch):
    for k, v in {**s3.env(), "HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(k, v)
    storage.upload_dir(prepared, "s3://bucket/sparse/d", last="manifest.json", print_fn=lambda *a, **k: None)
    want = pipeline.PackedStream(prepared, "train", seed=1)
    got = pipeline.PackedStream("s3://bucket/sparse/d", "train", seed=1)
    assert got.records.n_records == want.records.n_records > 2 * 1024  # several blocks per shard
    same_rows(want, got, range(0, 20 * want.epoch_tokens // 7, want.epoch_tokens // 7))  # every window, 3 epochs
    assert len(list((tmp_path / "home").rglob("*.array_record.*"))) == 2  # a local copy per open shard
    got.records.close()
    assert not list((tmp_path / "home").rglob("*.array_record.*"))

    old = tiny_prepared_dir(tmp_path / "old", [[1, 2, 3]] * 10, block_records=4)  # no block offsets
    storage.upload_dir(old, "s3://bucket/sparse/old", last="manifest.json", print_fn=lambda *a, **k: None)
    with pytest.raises(DataError, match="s3://bucket/sparse/old: prepared before shards recorded their block "
                                        "offsets"):
        pipeline.PackedStream("s3://bucket/sparse/old", "train", seed=0)


def test_s3_checkpoints_commit_by_marker_and_a_damaged_step_is_moved_aside_not_lost(s3, tmp_path, monkeypatch):
    import s3fs
    from test_checkpoint_faults import abstract, make_state

    from jaxtrain import checkpoint
    from orbax.checkpoint._src.serialization import tensorstore_utils

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)  # a URL taken for a relative path would show up here as an "s3:" dir
    s3fs.S3FileSystem.clear_instance_cache()  # epath's instance must see this endpoint
    fs = s3fs.S3FileSystem(endpoint_url=s3.url, key="test", secret="test", skip_instance_cache=True)
    steps = lambda: (fs.invalidate_cache(), sorted({p.split("/")[2] for p in fs.find("bucket/faults")}))[1]
    # A bucket that does not exist is the config's error: saving would have created it, silently.
    from jaxtrain.compat import orbax_s3
    from jaxtrain.errors import ConfigError

    orbax_s3.install()  # as every entry point does (an earlier test in this process may not have run)

    with pytest.raises(ConfigError, match=r"^checkpoint\.dir: s3://missing/ckpt: bucket s3://missing does not "
                                          r"exist .* jaxtrain does not create buckets"):
        checkpoint.check_paths("s3://missing/ckpt", field="checkpoint.dir")
    assert not fs.exists("missing")
    checkpoint.check_paths("s3://bucket/faults", field="checkpoint.dir")
    ckpt = checkpoint.Checkpointer("s3://bucket/faults", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, make_state(step), {"pos": step})
    ckpt.close()
    assert steps() == ["2", "3"] and fs.exists("bucket/faults/3/commit_success.txt")
    monkeypatch.delenv(storage.RETRY_ENV, raising=False)
    # Every other path still gets Orbax's own spec (gs:// with the retry budget: 16 tries waits out about 120 s).
    assert tensorstore_utils.build_kvstore_tspec("gs://b/x", use_ocdbt=False) == {
        "driver": "gcs", "bucket": "b", "path": "x",
        "gcs_request_retries": {"max_retries": 16, "initial_delay": "0.5s", "max_delay": "10.0s"}}
    assert tensorstore_utils.build_kvstore_tspec("/x/y", use_ocdbt=False) == {"driver": "file", "path": "/x/y"}

    # A step whose save died before its commit marker is not a checkpoint.
    for p in fs.find("bucket/faults/3"):
        if not p.endswith("/commit_success.txt"):
            fs.copy(p, p.replace("faults/3/", "faults/4/", 1))
    assert checkpoint.Checkpointer("s3://bucket/faults", keep=2).latest_step() == 3

    # One flipped bit in step 3's array data: reported, moved aside whole, and step 2 restored.
    needle = np.asarray(make_state(3)["params"]["w"])[0, :8].tobytes()
    damaged = [p for p in fs.find("bucket/faults/3/state") if needle in fs.cat_file(p)]
    assert len(damaged) == 1
    blob = bytearray(fs.cat_file(damaged[0]))
    blob[blob.find(needle) + 13] ^= 0x10
    fs.pipe_file(damaged[0], bytes(blob))
    before = sorted(p[len("bucket/faults/3/"):] for p in fs.find("bucket/faults/3"))
    logs = []
    ckpt = checkpoint.Checkpointer("s3://bucket/faults", keep=2, log=logs.append)
    step, state, data = ckpt.restore_latest(abstract(make_state(3)))
    assert (step, data, int(state["step"])) == (2, {"pos": 2}, 2)
    moved = [s for s in steps() if s.startswith("3.corrupt-")]
    assert len(logs) == 1 and "s3://bucket/faults is unusable: checksum mismatch in params/w" in logs[0]
    assert len(moved) == 1 and moved[0] in logs[0] and "3" not in steps()
    assert sorted(p[len(f"bucket/faults/{moved[0]}/"):] for p in fs.find(f"bucket/faults/{moved[0]}")) == before

    # Saving goes on; garbage collection keeps the latest 2 and never touches the moved-aside copy.
    ckpt.save(3, make_state(3), {"pos": 3})
    ckpt.save(5, make_state(5), {"pos": 5})
    ckpt.close()
    assert steps() == ["3", moved[0], "5"] and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_an_endpoint_that_goes_away_mid_run_ends_in_one_line_within_the_retry_budget(tiny_data_dir, tmp_path):
    """The S3 endpoint stops while a run trains: with its checkpoints there the run exits 4 (a failed save), with
    its data there exit 2 (storage unreachable, not damaged data). Each within the budget (plus the clients' own
    short retries), each error one line naming the URL, no traceback; tensorstore's default retries would hang
    a save for about 15 minutes."""
    import s3fs

    # Both cases at once, each with its own endpoint: most of their time is the clients waiting out retries.
    cases = {"checkpoint": (4, "error: saving step "), "data": (2, "error: s3://bucket/kjv/")}
    runs = {}
    try:
        for where in cases:
            server = emulators.S3()
            server.start()
            fs = s3fs.S3FileSystem(endpoint_url=server.url, key="test", secret="test", skip_instance_cache=True)
            data = tiny_data_dir
            if where == "data":
                fs.put(tiny_data_dir + "/", "bucket/kjv/", recursive=True)
                data = "s3://bucket/kjv"
            workdir = tmp_path / where
            runs[where] = server, workdir, subprocess.Popen(
                [sys.executable, "-m", "jaxtrain", "train", "--config", REPO / "configs/tiny.py",
                 f"--config.workdir={workdir}", "--config.train.steps=5000", "--config.checkpoint.every_steps=20",
                 "--config.eval.every_steps=0", f"--config.data.dir={data}",
                 *(["--config.checkpoint.dir=s3://bucket/ckpt"] if where == "checkpoint" else [])],
                env={**os.environ, **server.env(), storage.RETRY_ENV: "2", "HOME": str(tmp_path / f"home_{where}")},
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        training = set(cases)
        while training:  # each endpoint stops once its run has trained 25 steps
            for where in sorted(training):
                server, workdir, run = runs[where]
                if (workdir / "metrics.jsonl").exists() and len(losses(workdir)) >= 25:
                    server.stop()
                    training.discard(where)
                else:
                    assert run.poll() is None, run.stderr.read()[-2000:]
            time.sleep(0.02)
    finally:
        for server, _, run in runs.values():
            server.stop()
    for where, (want_rc, want) in cases.items():
        _, workdir, run = runs[where]
        err = run.communicate(timeout=300)[1]
        lines = err.splitlines()
        assert run.returncode == want_rc and "Traceback" not in err, (where, err[-3000:])
        assert lines[-1].startswith(want) and "s3://bucket/" in lines[-1], err[-3000:]
        assert all(line.startswith("storage: s3://bucket/") and "retrying in" in line for line in lines[:-1]), err
        assert len(losses(workdir)) < 5000
