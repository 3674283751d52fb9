"""log.profile_steps: the trace, and the table of where the traced steps' time went (jaxtrain.observe.profiling)."""

from pathlib import Path

import jax
import pytest

from jaxtrain.observe import hlo as hlo_lib
from jaxtrain.observe import profiling
from jaxtrain.tools import profile as profile_cli


def test_overlapping_ops_split_the_wall_time_between_them():
    """A runs 0-10 us, B 5-15 and C 20-30 (twice 2 us inside C's span on its own thread): the overlap is shared."""
    events = [{"name": "A", "ts": 0, "dur": 10}, {"name": "B", "ts": 5, "dur": 10},
              {"name": "C", "ts": 20, "dur": 10}, {"name": "D", "ts": 22, "dur": 2}, {"name": "D", "ts": 26, "dur": 2}]
    times, counts = profiling.split_wall_time(events)
    assert times == {"A": 7.5, "B": 7.5, "C": 8.0, "D": 2.0}
    assert counts == {"A": 1, "B": 1, "C": 1, "D": 2}
    assert sum(times.values()) == 25  # 0-15 and 20-30: the busy wall time, each instant counted once


def test_profile_steps_writes_a_trace_and_the_table_of_its_ops(tiny_config, capsys):
    from jaxtrain import train

    cfg = tiny_config(**{"train.steps": 4, "log.profile_steps": "2,3"})
    printed = []
    train.run(cfg, print_fn=printed.append)
    logdir = Path(cfg.workdir) / "profile"
    traces = list(logdir.rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0  # TensorBoard's profile plugin
    assert f"profile of steps 2..3 written to {logdir}" in printed
    table = next(p for p in printed if "ms per step from the first op to the last" in p)
    assert table.startswith("2 step(s): ") and f"(all ops: {logdir / 'summary.txt'})" in table

    hlo = (logdir / profiling.HLO_FILE).read_text()
    module = hlo_lib.parse_hlo(hlo)
    s = profiling.summarize(profiling.latest_trace(logdir), hlo, steps=2)
    assert 0 < s["busy_ms"] <= s["span_ms"] * 1.001
    assert abs(sum(op["ms"] for op in s["ops"]) - s["busy_ms"]) < 1e-6
    assert abs(sum(k["ms"] for k in s["kinds"]) - s["busy_ms"]) < 1e-6
    assert all(op["op"] in module["by_name"] for op in s["ops"])  # ops of the compiled step, no Python frames
    assert all(module["by_name"][op["op"]]["op"] != "while" for op in s["ops"])  # loops are not ops of their own
    matmuls = [op for op in s["ops"] if op["kind"] == "matmul"]
    assert matmuls and all(op["gflops_per_s"] > 0 for op in matmuls)
    # Each step runs every matmul of the compiled step once per layer (the tiny model's are scanned) on each of the
    # 8 devices, whose ops this one process traces.
    total = sum(op["runs"] * op["flops"] for op in matmuls)
    assert total == pytest.approx(hlo_lib.dot_flops(module) * jax.device_count())

    profile_cli.main([str(logdir), "--top", "5"])  # steps from summary.txt
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (logdir / "summary.txt").read_text().splitlines()[0]
    assert len([line for line in out.splitlines()[out.splitlines().index(""):] if "%" in line]) == 5

    (logdir / profiling.HLO_FILE).unlink()  # a trace without its HLO, then a directory with no trace
    for bad, named in ((logdir, logdir / profiling.HLO_FILE), (logdir / "nope", logdir / "nope")):
        assert profile_cli.main([str(bad)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(named) in err[0], err


def test_each_op_reports_the_bytes_it_moved_and_their_rate(tmp_path):
    """x + 1 over a 1024 x 1024 f32 array reads 4 MiB and writes 4 MiB: in 2 ms a step (two runs of 1 ms),
    8,388,608 bytes a run at 8.39 GB/s."""
    import gzip
    import json

    import jax.numpy as jnp

    hlo = jax.jit(lambda x: x + 1).lower(jnp.zeros((1024, 1024), jnp.float32)).compile().as_text()
    (name,) = [n for n, i in hlo_lib.parse_hlo(hlo)["by_name"].items() if i["op"] == "fusion"]  # the add
    trace = tmp_path / "perfetto_trace.json.gz"
    events = [{"ph": "X", "name": name, "ts": ts, "dur": 1000} for ts in (0, 5000)]
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    (op,) = profiling.summarize(trace, hlo, steps=1)["ops"]
    assert op["op"] == name and op["runs"] == 2 and op["ms"] == pytest.approx(2.0)
    assert op["bytes"] == 2 * 1024 * 1024 * 4
    assert op["gbytes_per_s"] == pytest.approx(8.388608)
    assert f"{8.388608:6.1f}" in profiling.format_summary(profiling.summarize(trace, hlo, steps=1), top=1)
