"""jaxtrain.tools.report: synthetic workdirs with known figures, the CLI's errors, and one real tiny run."""

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import image as mpimg
from matplotlib.figure import Figure

from jaxtrain.tools import report

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"train": {"steps": 10, "batch_size": 8, "seq_len": 32}, "model": {}, "optim": {}}
T0 = 1_700_000_000.0  # record times: well before any file's mtime, so summary.json counts as written after


def train_record(step, loss, t=None, **extra):
    r = {"step": step, "loss": loss, "lr": 1e-3 * step, "grad_norm": 1.0, "tokens_per_sec": 100.0, "mfu": 0.1,
         "eta_s": 1.0, "data_wait_frac": 0.0, "skipped_steps": 0, **extra}
    if t is not None:
        r["time"] = t
    return r


def make_workdir(path, records, *, config=CONFIG, summary=None, run_info=None, goodput=None, torn_tail=False):
    path.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (path / "metrics.jsonl").write_text(text + ('{"step": 99, "lo' if torn_tail else ""))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if run_info is not None:
        (path / "run.json").write_text(json.dumps(run_info))
    if goodput is not None:
        (path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in goodput))
    return path


def complete_run(path, **overrides):
    """10 steps on 8 TPU v5p over two attempts of 1800 s and 900 s."""
    records = [train_record(s, 5.0 - 0.1 * s, T0 + s, tokens_per_sec=[100.0, 300.0][s % 2],
                            mfu=[0.2, None, 0.6][s % 3]) for s in range(1, 11)]
    records.insert(5, {"step": 5, "time": T0 + 5.5, "eval_loss": 4.6, "eval_loss/shakespeare": 5.1})
    records.append({"step": 10, "time": T0 + 10.5, "eval_loss": 4.2, "eval_loss/shakespeare": 4.9})
    run_info = {"status": "finished", "devices": {"platform": "tpu", "kind": "TPU v5p", "count": 8},
                "attempts": [{"start_unix": 1000.0, "end_unix": 2800.0, "status": "preempted", "start_step": 0,
                              "end_step": 6},
                             {"start_unix": 3000.0, "end_unix": 3900.0, "status": "finished", "start_step": 6,
                              "end_step": 10}]}
    kwargs = dict(summary={"finished": True, "step": 10, "resumed": True, "wall_s": 900.0,
                           "goodput": {"goodput": 0.8, "attempts": [{}, {}], "steps_lost": 1}},
                  run_info=run_info)
    return make_workdir(path, records, **{**kwargs, **overrides})


def parse_markdown(text):
    lines = text.strip().splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    assert set(lines[1]) <= set("|-:")
    return cells[0], cells[2:]


def assert_png(path):
    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)  # decodes the whole file
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100


def cli(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "jaxtrain", "report", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


# ===== Figures ============================================================================================

def test_row_figures_of_a_complete_run(tmp_path):
    row = report.load_run(complete_run(tmp_path / "a")).row(price=2.5)
    assert row["status"] == "finished"
    assert (row["steps"], row["total_steps"]) == (10, 10)
    assert row["tokens"] == 10 * 8 * 32
    assert row["final_loss"] == pytest.approx(4.0)
    assert (row["best_eval_loss"], row["final_eval_loss"]) == (4.2, 4.2)
    assert (row["wall_s"], row["wall_source"]) == (2700.0, "run.json")  # the attempts, not the gap between
    assert row["goodput"] == 0.8
    assert row["tokens_per_sec"] == pytest.approx(150.0)  # 5 intervals at 100, 5 at 300: 2 tokens / (1/100 + 1/300)
    assert row["mfu"] == pytest.approx(0.3)  # nulls skipped; harmonic mean of 0.2 and 0.6
    assert (row["devices"], row["device_kind"]) == (8, "TPU v5p")
    assert row["device_hours"] == pytest.approx(6.0)
    assert row["cost"] == pytest.approx(15.0)
    cells = report.format_row(row)
    assert [cells[k] for k in ("steps", "tokens", "wall_s", "goodput", "tokens_per_sec", "mfu", "devices",
                               "device_hours", "cost")] == \
        ["10/10", "2,560", "45m00s", "80.0%", "150", "30%", "8 x TPU v5p", "6.00", "$15.00"]
    assert report.load_run(tmp_path / "a").row()["cost"] is None  # no price, no cost


def test_resumed_run_keeps_the_later_record_and_drops_abandoned_steps(tmp_path):
    # Attempt 1 logged steps 1-6 (evals at 2, 4, 6) and died; attempt 2 resumed from the step-2 checkpoint
    # and is at step 5: its records win for steps 3-5, and attempt 1's step 6 and eval at 6 are not the run's.
    def attempt(steps, t, loss, evals):  # each train record followed by its step's eval, as the hooks write them
        out = []
        for s in steps:
            out.append(train_record(s, loss + s, t + s))
            if s in evals:
                out.append({"step": s, "time": t + s + 0.5, "eval_loss": evals[s]})
        return out
    first = attempt(range(1, 7), T0, 10.0, {2: 7.0, 4: 9.0, 6: 9.5})
    second = attempt(range(3, 6), T0 + 100, 20.0, {4: 8.0})
    run = report.load_run(make_workdir(tmp_path / "r", first + second, torn_tail=True))
    assert run.series("loss") == ([1, 2, 3, 4, 5], [11.0, 12.0, 23.0, 24.0, 25.0])
    assert run.series("eval_loss") == ([2, 4], [7.0, 8.0])
    row = run.row()
    assert (row["steps"], row["tokens"], row["final_loss"], row["status"]) == (5, 5 * 256, 25.0, "unknown")
    assert (row["wall_s"], row["wall_source"]) == (104.0, "metrics.jsonl")  # first to last record: nothing better
    assert row["devices"] is None and row["device_hours"] is None


def test_without_run_json_wall_comes_from_a_whole_run_summary(tmp_path):
    records = [train_record(s, 3.0, T0 + s) for s in (5, 10)]
    run = report.load_run(make_workdir(tmp_path / "old", records, summary={"finished": True, "step": 10,
                                                                           "resumed": False, "wall_s": 123.0}))
    row = run.row(price=3.0)
    assert (row["status"], row["steps"], row["wall_s"], row["wall_source"]) == ("finished", 10, 123.0, "summary.json")
    assert row["goodput"] is None and row["cost"] is None  # no device count, no cost
    assert report.format_row(row)["devices"] == "-"


def test_a_fresh_summary_gives_the_step_the_log_interval_missed(tmp_path):
    # Logged every 5 steps, stopped at 12 (train.stop_at): only summary.json knows step 12.
    records = [train_record(s, 3.0, T0 + s) for s in (5, 10)]
    path = make_workdir(tmp_path / "w", records, summary={"finished": False, "step": 12, "resumed": False,
                                                          "wall_s": 60.0})
    os.utime(path / "summary.json", (T0 + 10, T0 + 10))  # same second as the last record: still after it
    row = report.load_run(path).row()
    assert (row["status"], row["steps"], row["tokens"]) == ("stopped", 12, 12 * 256)


def test_number_formats():
    assert [report._count(n) for n in (768, 9_999, 12_288, 1_500_000_000, 2_000_000_000_000)] == \
        ["768", "9,999", "12.3K", "1.50B", "2.00T"]
    assert [report._duration(s) for s in (7.4, 185, 3725, 90000)] == ["7s", "3m05s", "1h02m", "25h00m"]
    assert [report._small(x) for x in (1234.5, 6.0, 0.00417)] == ["1,234", "6.00", "0.00417"]


def test_stale_summary_and_goodput_from_its_records(tmp_path):
    # Attempt 1: steps 0-4 (checkpoint at 2), killed; attempt 2 from step 2 to 6. summary.json is from
    # an earlier invocation (older than the records), and this one was resumed: goodput.jsonl decides.
    ledger = [{"event": "start", "t": 100.0, "step": 0}, {"event": "step", "t": 120.0, "step": 2, "step_s": 16.0},
              {"event": "checkpoint", "t": 121.0, "step": 2}, {"event": "step", "t": 140.0, "step": 4, "step_s": 16.0},
              {"event": "start", "t": 160.0, "step": 2}, {"event": "step", "t": 180.0, "step": 4, "step_s": 16.0},
              {"event": "step", "t": 200.0, "step": 6, "step_s": 16.0}]
    now = T0 + 1e6
    records = [train_record(s, 2.0, now + 100 * s) for s in (2, 4, 6)]
    path = make_workdir(tmp_path / "w", records, goodput=ledger,
                        summary={"finished": False, "step": 4, "resumed": True, "wall_s": 50.0,
                                 "goodput": {"goodput": 0.99}})
    os.utime(path / "summary.json", (now, now))
    row = report.load_run(path).row()
    assert (row["status"], row["steps"]) == ("unknown", 6)
    assert row["goodput"] == pytest.approx(48 / 100)  # 3 x 16 s kept (steps 2-4 redone) over 100 s
    assert (row["wall_s"], row["wall_source"]) == (80.0, "goodput.jsonl")  # 40 s + 40 s, not the gap


def test_attempts_without_an_end_count_up_to_their_last_record(tmp_path):
    records = [train_record(s, 2.0, t) for s, t in ((1, 1100.0), (2, 1500.0), (1, 2100.0), (2, 2600.0))]
    # Attempt 1 was SIGKILLed (no end written); attempt 2 runs.
    info = {"status": "running", "start_time": "1970-01-01T00:16:40+00:00", "end_time": None,
            "attempts": [{"start_unix": 1000.0, "end_unix": None, "status": "killed", "start_step": 0, "end_step": None},
                         {"start_unix": 2000.0, "end_unix": None, "status": "running", "start_step": 0,
                          "end_step": None}]}
    row = report.load_run(make_workdir(tmp_path / "w", records, run_info=info)).row()
    assert (row["status"], row["steps"], row["wall_s"]) == ("running", 2, 500.0 + 600.0)


def test_run_json_knows_a_resume_that_has_not_logged_yet(tmp_path):
    # Attempt 1 logged to step 8 and failed; attempt 2 resumed from the step-5 checkpoint and has logged
    # nothing yet. No config.json: run.json's copy of the config gives the tokens per step.
    info = {"status": "running", "config": {"train": {"steps": 20, "batch_size": 4, "seq_len": 16}},
            "attempts": [{"start_unix": T0, "end_unix": T0 + 9, "status": "failed", "start_step": 0, "end_step": 8},
                         {"start_unix": T0 + 20, "end_unix": None, "status": "running", "start_step": 5,
                          "end_step": None}]}
    records = [train_record(s, 2.0, T0 + s) for s in range(1, 9)]
    row = report.load_run(make_workdir(tmp_path / "w", records, config=None, run_info=info)).row()
    assert (row["status"], row["steps"], row["total_steps"], row["tokens"]) == ("running", 5, 20, 5 * 64)
    assert row["wall_s"] == 9.0  # attempt 2 has no record yet: no time counted for it
    # The brief form of an attempt, {"step": reached}, is read as well.
    info["attempts"] = [{"start_unix": T0, "end_unix": T0 + 30, "status": "stopped", "step": 12}]
    (tmp_path / "w" / "run.json").write_text(json.dumps(info))
    assert report.load_run(tmp_path / "w").row()["steps"] == 12


def test_default_names_tell_workdirs_apart(tmp_path):
    assert report.default_names([tmp_path / "a", tmp_path / "b"]) == ["a", "b"]
    assert report.default_names([tmp_path / "x" / "workdir", tmp_path / "y" / "workdir"]) == \
        ["x/workdir", "y/workdir"]


# ===== Outputs ============================================================================================

def test_write_report_files_match_rows(tmp_path):
    a = complete_run(tmp_path / "a")
    b = make_workdir(tmp_path / "b", [train_record(s, 4.0 - 0.2 * s, T0 + s, mfu=None) for s in range(1, 4)])
    result = report.write_report([a, b], tmp_path / "out", price=2.5, names=["big", "small"])
    rows = result["rows"]
    assert [r["name"] for r in rows] == ["big", "small"]
    for name in ("loss", "eval_loss", "lr", "tokens_per_sec", "mfu", "curves"):
        assert_png(result["paths"][name])

    header, body = parse_markdown((tmp_path / "out" / "summary.md").read_text())
    assert header == list(report.COLUMNS.values())
    assert body == [list(report.format_row(r).values()) for r in rows]
    assert body[1][header.index("cost (USD)")] == "-"

    parsed = list(csv.DictReader(io.StringIO((tmp_path / "out" / "summary.csv").read_text())))
    assert list(parsed[0]) == report.CSV_COLUMNS
    for got, row in zip(parsed, rows):
        for key in report.CSV_COLUMNS:
            want = row[key]
            assert got[key] == ("" if want is None else str(want)), key
            if isinstance(want, float):
                assert float(got[key]) == want  # raw numbers round-trip exactly


def test_metrics_no_run_has_are_not_drawn(tmp_path):
    w = make_workdir(tmp_path / "w", [train_record(s, 3.0, mfu=None) for s in range(1, 4)])
    result = report.write_report([w], tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == \
        ["curves.png", "loss.png", "lr.png", "summary.csv", "summary.md", "tokens_per_sec.png"]
    assert "cost" not in result["table"]  # no price: no cost column


def test_plot_curves_draws_on_a_given_figure(tmp_path):
    runs = report.load_runs([complete_run(tmp_path / "a")], names=["a"])
    fig = report.plot_curves(runs, Figure())
    assert [ax.get_ylabel() for ax in fig.axes] == ["train loss", "eval loss", "learning rate", "tokens/s", "MFU (%)"]
    eval_lines = fig.axes[1].get_lines()
    assert [(line.get_label(), line.get_linestyle()) for line in eval_lines] == [("a", "-"), ("a: shakespeare", "--")]
    assert list(fig.axes[4].get_lines()[0].get_ydata()) == pytest.approx([60.0, 20.0] * 3)  # steps 2, 3, 5, 6, 8, 9


def test_cli_prints_the_table_and_writes_the_files(tmp_path):
    a, b = complete_run(tmp_path / "a"), complete_run(tmp_path / "b")
    proc = cli(a, b, "--output", "rep", "--price_per_device_hour", "2.5", "--names", "one,two", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "rep" / "summary.md").read_text()
    assert proc.stdout.startswith(table)
    assert "$15.00" in table and "| one " in table and "| two " in table
    assert_png(tmp_path / "rep" / "loss.png")


def test_a_damaged_byte_in_metrics_jsonl_costs_its_line_only(tmp_path):
    run = complete_run(tmp_path / "a")
    metrics = Path(run) / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join(lines[:1] + [b'{"step": 2, "loss": \xff\xfe}\n'] + lines[1:]))
    proc = cli(run, "--output", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert report.load_run(run).train == report.load_run(complete_run(tmp_path / "b")).train


@pytest.mark.parametrize("case", ["missing_dir", "no_metrics", "names_count"])
def test_cli_bad_input_exits_2_before_writing(tmp_path, case):
    good = complete_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    args, named = {"missing_dir": ([good, tmp_path / "nope"], "nope"),
                   "no_metrics": ([good, tmp_path / "empty"], "empty/metrics.jsonl"),
                   "names_count": ([good, "--names", "a,b"], "--names")}[case]
    proc = cli(*args, "--output", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and named in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "out").exists()


# ===== What the trainer really writes =====================================================================

def test_report_of_a_real_tiny_run(tiny_config, tmp_path):
    from jaxtrain import train

    config = tiny_config(**{"train.steps": 3})
    summary = train.run(config, print_fn=lambda *a, **k: None)
    result = report.write_report([config.workdir], tmp_path / "out", price=1.0)
    row = result["rows"][0]
    assert (row["status"], row["steps"], row["total_steps"]) == ("finished", 3, 3)
    assert row["tokens"] == 3 * 8 * 32
    records = [json.loads(line) for line in (Path(config.workdir) / "metrics.jsonl").read_text().splitlines()]
    assert row["final_loss"] == [r for r in records if "loss" in r][-1]["loss"]
    assert row["final_eval_loss"] == summary["eval"][-1][1]
    assert row["tokens_per_sec"] > 0 and row["mfu"] > 0
    assert row["goodput"] == summary["goodput"]["goodput"]
    for name in ("loss", "eval_loss", "lr", "tokens_per_sec", "mfu"):
        assert_png(result["paths"][name])
    info_path = Path(config.workdir) / "run.json"
    if info_path.exists():  # written by train.run from the run.json change on
        info = json.loads(info_path.read_text())
        assert info["status"] == "finished" and info["devices"]["count"] == 8 and len(info["attempts"]) == 1
        assert info["attempts"][0].get("end_step", info["attempts"][0].get("step")) == 3
        assert (row["devices"], row["device_kind"]) == (8, info["devices"]["kind"])
        assert row["wall_source"] == "run.json"
        assert row["wall_s"] == pytest.approx(sum(a["end_unix"] - a["start_unix"] for a in info["attempts"]))
        assert row["cost"] == pytest.approx(8 * row["wall_s"] / 3600)
    else:
        assert (row["wall_s"], row["wall_source"]) == (summary["wall_s"], "summary.json")
        assert row["devices"] is None and row["cost"] is None


# ===== Restarts ===========================================================================================

def phases_record(attempt, t, step, tier=None, compiled=None, **phases):
    return {"event": "phases", "attempt": attempt, "t": t, "step": step, "phases": phases, "compile": compiled,
            "restore_tier": tier}


def test_restarts_are_broken_into_phases(tmp_path):
    ledger = [{"event": "start", "attempt": 1, "t": T0, "step": 0},
              phases_record(1, T0, 0, compiled="compiled", process_start=3.0, setup=1.0, compile=20.0),
              {"event": "step", "attempt": 1, "t": T0 + 5, "step": 4, "step_s": 4.0},
              {"event": "start", "attempt": 2, "t": T0 + 20, "step": 4},
              phases_record(2, T0 + 20, 4, tier="local_dir", compiled="cache", detection=0.5, restart_wait=1.0,
                            process_start=3.0, distributed_init=0.25, setup=1.0, restore=0.5, data_restore=0.01,
                            compile=2.0),
              {"event": "step", "attempt": 2, "t": T0 + 20.75, "step": 5, "step_s": 0.75}]
    w = make_workdir(tmp_path / "w", [train_record(s, 3.0, T0 + s) for s in range(1, 6)], goodput=ledger)
    result = report.write_report([w], tmp_path / "out")
    assert_png(result["paths"]["recovery"])
    text = (tmp_path / "out" / "recovery.md").read_text()
    assert text == result["recovery"]
    header, body = parse_markdown(text)
    assert len(body) == 1  # the first start is no restart
    row = dict(zip(header, body[0]))
    assert (row["attempt"], row["from step"]) == ("2", "4")
    assert row["restore"] == "0.50 (local_dir)" and row["compile"] == "2.00 (cache)"
    assert row["detection"] == "0.50" and row["total"] == "8.26" and row["first step"] == "0.75"

    proc = cli(w, "--output", tmp_path / "cli", cwd=tmp_path)
    assert proc.returncode == 0 and "restarts (seconds per phase)" in proc.stdout and "(local_dir)" in proc.stdout


def test_no_restart_no_recovery_files(tmp_path):
    ledger = [{"event": "start", "attempt": None, "t": T0, "step": 0}, phases_record(None, T0, 0, setup=1.0)]
    w = make_workdir(tmp_path / "w", [train_record(s, 3.0, T0 + s) for s in range(1, 3)], goodput=ledger)
    result = report.write_report([w], tmp_path / "out")
    assert result["recovery"] == "" and "recovery" not in result["paths"]
