"""Metric writers: strict JSON lines, and TensorBoard events that skip what JSON writes as null; profiler traces."""

import json
import math
import struct
import time

import numpy as np
import pytest

from jaxtrain.observe import metrics
from jaxtrain.observe import profiling


def test_jsonl_is_strict_json_and_nonfinite_becomes_null(tmp_path):
    w = metrics.JsonlWriter(tmp_path / "m.jsonl")
    w.write_scalars(3, {"loss": np.float32(2.5), "mfu": float("nan"), "tokens_per_sec": 10})
    w.close()
    line = (tmp_path / "m.jsonl").read_text().strip()
    record = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # no NaN tokens
    assert abs(record.pop("time") - time.time()) < 60
    assert record == {"step": 3, "loss": 2.5, "mfu": None, "tokens_per_sec": 10}


def _scalar_events(logdir):
    """(tag, step, value) from TFRecord-framed event files: u64 length, u32 crc, payload, u32 crc."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in logdir.glob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_writes_finite_scalars_only(tmp_path):
    w = metrics.TensorBoardWriter(tmp_path)
    w.write_scalars(1, {"loss": 2.0, "mfu": math.inf})
    w.close()
    assert _scalar_events(tmp_path) == [("loss", 1, 2.0)]


@pytest.mark.parametrize("spec", ["3,2", "0", "a,b", "1,2,3", "-1"])
def test_bad_profile_steps_name_the_field(tiny_config, spec):
    from jaxtrain import config as config_lib

    with pytest.raises(config_lib.ConfigError, match="^log.profile_steps: "):
        config_lib.validate(tiny_config(**{"log.profile_steps": spec}), 8)
    assert profiling.parse_steps("5") == (5, 5) and profiling.parse_steps("") is None


def test_cpu_peak_is_measured_once_per_dtype_and_cached(tmp_path, monkeypatch):
    """The CPU peak is a matmul in the run's compute dtype (bf16 runs near 2x f32 on AVX512-BF16 CPUs), measured
    once per machine and dtype; a corrupt cache file is measured over, not an error."""
    measured = []

    def fake_measure(n=4096, reps=5, dtype="float32"):
        measured.append(str(dtype))
        return {"float32": 1e11, "bfloat16": 2e11}[str(dtype)]

    monkeypatch.setattr(metrics, "measure_matmul_flops", fake_measure)
    assert metrics.peak_flops(tmp_path) == (1e11, "measured float32 matmul")
    assert metrics.peak_flops(tmp_path, dtype="bfloat16") == (2e11, "measured bfloat16 matmul")
    assert metrics.peak_flops(tmp_path, dtype="bfloat16") == (2e11, "measured bfloat16 matmul (cached)")
    assert metrics.peak_flops(tmp_path) == (1e11, "measured float32 matmul (cached)")
    assert measured == ["float32", "bfloat16"]
    (tmp_path / "cpu_peak.json").write_text('{"flops_by_key": [1, 2]')  # cut short
    assert metrics.peak_flops(tmp_path) == (1e11, "measured float32 matmul")
    assert measured == ["float32", "bfloat16", "float32"]
