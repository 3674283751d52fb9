"""run.json, secret redaction everywhere a run logs, and the MLflow / W&B writers against local stores."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from helpers import read_jsonl
from jaxtrain import config as config_lib
from jaxtrain import train
from jaxtrain.observe import metrics
from jaxtrain.observe import tracking
from jaxtrain import files

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-Value-42"
DB_PASSWORD = "hunter2-db"


def quiet_run(cfg, **kwargs):
    return train.run(cfg, print_fn=lambda *a, **k: None, **kwargs)


def test_redact_keys_that_look_secret_and_url_passwords():
    data = {"wandb_api_key": "abc", "hf_token": "t", "dbPassword": "p", "client_secret": "s", "credentials": ["c"],
            "max_new_tokens": 40, "keep": 3, "tokens_per_sec": 1.0, "empty_token": "",
            "uri": f"postgresql://me:{DB_PASSWORD}@db:5432/mlflow", "plain": "http://host:8080/path",
            "nested": [{"secret": 1}, "mysql://u:pw@h/x and https://a:b@c"]}
    out = tracking.redact(data)
    r = tracking.REDACTED
    assert out == {"wandb_api_key": r, "hf_token": r, "dbPassword": r, "client_secret": r, "credentials": r,
                   "max_new_tokens": 40, "keep": 3, "tokens_per_sec": 1.0, "empty_token": "",
                   "uri": f"postgresql://me:{r}@db:5432/mlflow", "plain": "http://host:8080/path",
                   "nested": [{"secret": r}, f"mysql://u:{r}@h/x and https://a:{r}@c"]}
    assert data["wandb_api_key"] == "abc"  # a copy: the config itself is untouched


def test_redact_argv_hides_secret_flags_in_both_forms_and_url_passwords():
    r = tracking.REDACTED
    argv = ["prog", f"--config.log.wandb_api_key={SECRET}", "--api_key", SECRET, "--token", "--config.train.steps=3",
            f"--config.log.run_name=postgresql://me:{DB_PASSWORD}@db/x", "--config.log.wandb_api_key="]
    assert tracking.redact_argv(argv) == ["prog", f"--config.log.wandb_api_key={r}", "--api_key", r, "--token",
                                          "--config.train.steps=3", f"--config.log.run_name=postgresql://me:{r}@db/x",
                                          "--config.log.wandb_api_key="]


@pytest.mark.parametrize("field, value, message", [
    ("log.experiment", f"postgresql://me:{DB_PASSWORD}@db/x", "W&B names cannot contain / :"),
    ("log.wandb_entity", "team#1", "W&B names cannot contain #"),
    ("log.run_name", "r" * 129, "129 characters; trackers take at most 128"),
])
def test_tracker_names_are_checked_at_config_time_without_echoing_a_secret(tiny_config, field, value, message):
    with pytest.raises(config_lib.ConfigError, match=f"^{field}: {message}") as e:
        config_lib.validate(tiny_config(**{"log.trackers": "mlflow,wandb", field: value}), 8, 1)
    assert DB_PASSWORD not in str(e.value)


@pytest.mark.slow
def test_no_secret_from_the_command_line_reaches_any_byte_a_tracked_run_writes(tiny_config, tmp_path):
    """A user's command line: the W&B key as a flag and a database password inside the run name. W&B records the
    command line and MLflow's database the names; every file in the workdir is read as bytes."""
    workdir = tmp_path / "run"
    cfg = tiny_config(workdir)
    proc = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", "configs/tiny.py",
                           f"--config.workdir={workdir}", f"--config.data.dir={cfg.data.dir}", "--config.train.steps=2",
                           "--config.log.trackers=mlflow,wandb", f"--config.log.wandb_api_key={SECRET}",
                           f"--config.log.run_name=postgresql://alice:{DB_PASSWORD}@db/runs"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(Path(workdir, "wandb").rglob("*.wandb")) and Path(workdir, "mlflow.db").is_file()
    secrets = (SECRET.encode(), DB_PASSWORD.encode())
    leaks = [str(p) for p in workdir.rglob("*") if p.is_file() and any(s in p.read_bytes() for s in secrets)]
    assert leaks == [] and not any(s.decode() in proc.stdout + proc.stderr for s in secrets)
    from mlflow import MlflowClient

    ids = json.loads((workdir / "trackers.json").read_text())
    name = MlflowClient(tracking_uri=ids["mlflow"]["uri"]).get_run(ids["mlflow"]["run_id"]).info.run_name
    assert name == f"postgresql://alice:{tracking.REDACTED}@db/runs"


def test_unknown_tracker_and_bad_wandb_mode_are_config_errors(tiny_config):
    with pytest.raises(config_lib.ConfigError, match=r"^log.trackers: unknown tracker 'neptune'"):
        config_lib.validate(tiny_config(**{"log.trackers": "mlflow,neptune"}), 8, 1)
    with pytest.raises(config_lib.ConfigError, match=r"^log.wandb_mode: unknown value 'cloud'"):
        config_lib.validate(tiny_config(**{"log.wandb_mode": "cloud"}), 8, 1)


def _wandb_history(workdir) -> list[dict]:
    """Scalar rows from the offline run's .wandb file: a LevelDB-style log of Record protobufs
    (7-byte header, 32 KiB blocks, each chunk = crc32 u32, length u16, type u8 (1 full, 2 first, 3 middle, 4 last))."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(workdir, "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, chunk, rows = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_run_json_trackers_and_redaction_over_a_resumed_run(tiny_config, tmp_path):
    from mlflow import MlflowClient

    cfg = tiny_config(**{"train.steps": 3, "eval.every_steps": 3, "log.trackers": "mlflow,wandb",
                         "log.wandb_api_key": SECRET, "log.run_name": "tracked"})
    workdir = Path(cfg.workdir)
    quiet_run(cfg)

    record = json.loads((workdir / "run.json").read_text())
    assert record["config"]["log"]["wandb_api_key"] == tracking.REDACTED
    assert record["config"]["optim"] == dict(cfg.optim)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # a test run from an exported tree has no git
        assert record["git"]["commit"] == head.stdout.strip() and isinstance(record["git"]["dirty"], bool)
    assert record["packages"]["jax"] == jax.__version__ and record["packages"]["python"]
    assert record["devices"] == {"platform": "cpu", "count": 8, "kind": jax.devices()[0].device_kind}
    assert (record["processes"], record["seed"], record["status"]) == (1, cfg.train.seed, "finished")
    assert record["start_unix"] < record["end_unix"] and record["end_time"].endswith("+00:00")
    assert [(a["start_step"], a["end_step"], a["status"]) for a in record["attempts"]] == [(0, 3, "finished")]

    # MLflow (sqlite in the workdir): the same numbers as metrics.jsonl, and the redacted config as params.
    ids = json.loads((workdir / "trackers.json").read_text())
    client = MlflowClient(tracking_uri=ids["mlflow"]["uri"])
    run_id = ids["mlflow"]["run_id"]
    jsonl = read_jsonl(workdir / "metrics.jsonl")
    want_loss = {r["step"]: r["loss"] for r in jsonl if "loss" in r}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "loss")} == pytest.approx(want_loss)
    want_eval = {r["step"]: r["eval_loss"] for r in jsonl if "eval_loss" in r}
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval_loss")} == pytest.approx(want_eval)
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tracked"
    assert mlflow_run.data.params["optim.lr"] == str(cfg.optim.lr)
    assert mlflow_run.data.params["log.wandb_api_key"] == tracking.REDACTED

    # W&B offline store: the same losses.
    assert {r["_step"]: r["loss"] for r in _wandb_history(workdir) if "loss" in r} == pytest.approx(want_loss)

    # Resume to step 5: the same MLflow run goes on; run.json keeps the first start and adds an attempt.
    cfg.train.steps = 5
    quiet_run(cfg)
    again = json.loads((workdir / "run.json").read_text())
    assert json.loads((workdir / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5]
    assert again["start_unix"] == record["start_unix"] and again["end_unix"] > record["end_unix"]
    assert [(a["start_step"], a["end_step"], a["status"]) for a in again["attempts"]] == [
        (0, 3, "finished"), (3, 5, "finished")]

    # The secret is in no file the run wrote: config.json, run.json, TensorBoard, MLflow's db, W&B's files.
    leaks = [str(p) for p in workdir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []


class _Boom(metrics.MetricWriter):
    def write_scalars(self, step, scalars):
        if step == 5:
            raise RuntimeError("writer broke\nsecond line")


def test_run_json_records_a_failure_and_a_stop(tiny_config):
    cfg = tiny_config(**{"train.steps": 6, "train.stop_at": 3, "log.mlflow_uri": f"postgresql://u:{DB_PASSWORD}@h/db"})
    quiet_run(cfg)
    record = json.loads(Path(cfg.workdir, "run.json").read_text())
    assert record["status"] == "stopped" and record["attempts"][-1]["end_step"] == 3
    assert DB_PASSWORD not in Path(cfg.workdir, "run.json").read_text()
    assert DB_PASSWORD not in Path(cfg.workdir, "config.json").read_text()

    cfg.train.stop_at = 0
    with pytest.raises(RuntimeError, match="writer broke"):
        quiet_run(cfg, writers=[_Boom()])
    record = json.loads(Path(cfg.workdir, "run.json").read_text())
    assert record["status"] == "failed" and record["end_time"] is not None
    assert record["attempts"][-1] == {**record["attempts"][-1], "status": "failed", "start_step": 3,
                                      "end_step": 5, "error": "RuntimeError: writer broke"}
    assert [a["status"] for a in record["attempts"]] == ["stopped", "failed"]


def test_an_invocation_killed_without_an_end_is_marked_killed(tmp_path):
    rec = tracking.RunRecord(tmp_path, {"log": {}}, devices={}, processes=1, seed=0)
    rec.start(0)  # never ended: as after SIGKILL
    rec2 = tracking.RunRecord(tmp_path, {"log": {}}, devices={}, processes=1, seed=0)
    rec2.start(4)
    rec2.end("finished", 9)
    data = json.loads((tmp_path / "run.json").read_text())
    assert [(a["status"], a["start_step"]) for a in data["attempts"]] == [("killed", 0), ("finished", 4)]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_json_files_are_replaced_whole_while_others_read_them(tmp_path):
    """run.json and a run's config.json are rewritten while other processes read them (a multi-host run's peers
    check config.json as process 0 writes it): a reader sees the old or the new file, never an empty or half one."""
    import threading

    path = tmp_path / "config.json"
    files.write_json(path, {"n": 0, "pad": "x" * 200_000})
    seen, bad, done = [], [], threading.Event()

    def read():
        while not done.is_set():
            text = path.read_text()
            try:
                seen.append(json.loads(text)["n"])
            except ValueError:
                bad.append(len(text))

    reader = threading.Thread(target=read)
    reader.start()
    for n in range(1, 200):
        files.write_json(path, {"n": n, "pad": "x" * 200_000})
    done.set()
    reader.join()
    assert not bad, f"{len(bad)} partial reads, e.g. {bad[:3]} bytes"
    assert len(set(seen)) > 1  # the reader did overlap the writes
    assert json.loads(path.read_text())["n"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary files left
