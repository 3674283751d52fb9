"""The supervisor's restart policy (with a scripted fake child) and the goodput arithmetic."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxtrain import errors
from jaxtrain.observe import goodput
from jaxtrain.tools import supervise

# Exits with the code scripted for its attempt: argv[1] is e.g. "75,1,KILL,0".
SCRIPTED = (
    "import os, signal, sys\n"
    "code = sys.argv[1].split(',')[int(os.environ['JAXTRAIN_ATTEMPT']) - 1]\n"
    "if code == 'KILL':\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.exit(int(code))\n"
)


def _run(codes, tmp_path, **budgets):
    lines = []
    rc = supervise.supervise([sys.executable, "-c", SCRIPTED, codes], backoff_s=0, workdir=tmp_path,
                             log=lines.append, **budgets)
    summary = json.loads((tmp_path / "supervisor.json").read_text())
    return rc, summary, "\n".join(lines)


def test_restarts_after_preemption_and_crashes_until_done(tmp_path):
    rc, summary, log = _run("75,1,75,KILL,124,4,0", tmp_path, max_crash_restarts=4, max_preempt_restarts=2)
    assert rc == 0
    assert [a["exit_code"] for a in summary["attempts"]] == [75, 1, 75, -9, 124, 4, 0]
    assert [a["kind"] for a in summary["attempts"]] == ["preempt", "crash", "preempt", "crash", "crash", "crash",
                                                        "done"]
    assert summary["restarts"] == {"preempt": 2, "crash": 4}
    assert "killed by SIGKILL" in log and "hung (step watchdog)" in log and "checkpoint write failed" in log


@pytest.mark.parametrize("code", [errors.EXIT_BAD_INPUT, errors.EXIT_NONFINITE])
def test_no_restart_after_bad_config_or_nonfinite_loss(tmp_path, code):
    rc, summary, _ = _run(f"{code},0", tmp_path)
    assert rc == code and len(summary["attempts"]) == 1
    assert summary["restarts"] == {"preempt": 0, "crash": 0}


@pytest.mark.parametrize("codes, budgets, rc, attempts, message", [
    ("1,1,1,0", {"max_crash_restarts": 2}, 1, 3, "crash restart budget exhausted (2 restarts)"),
    ("75,75,75,0", {"max_preempt_restarts": 1}, 75, 2, "preempt restart budget exhausted (1 restarts)"),
    ("KILL,0", {"max_crash_restarts": 0}, 128 + signal.SIGKILL, 1, "crash restart budget exhausted (0 restarts)"),
])
def test_gives_up_when_a_budget_is_spent(tmp_path, codes, budgets, rc, attempts, message):
    got, summary, log = _run(codes, tmp_path, **budgets)
    assert got == rc and len(summary["attempts"]) == attempts and message in log


def test_budgets_are_separate(tmp_path):
    rc, summary, _ = _run("75,75,1,75,0", tmp_path, max_crash_restarts=1, max_preempt_restarts=3)
    assert rc == 0 and summary["restarts"] == {"preempt": 3, "crash": 1}


CHILD_WAITS_FOR_SIGTERM = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
    "open(sys.argv[1], 'a').write(os.environ['JAXTRAIN_ATTEMPT'] + '\\n')\n"
    "time.sleep(60)\n"
    "sys.exit(1)\n"
)


def test_cli_forwards_sigterm_to_the_child_and_does_not_restart(tmp_path):
    started = tmp_path / "started.txt"
    sup = subprocess.Popen([sys.executable, "-m", "jaxtrain", "supervise", "--backoff_s", "0", "--workdir", str(tmp_path),
                            "--", sys.executable, "-c", CHILD_WAITS_FOR_SIGTERM, str(started)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        sup.send_signal(signal.SIGTERM)
        out, _ = sup.communicate(timeout=60)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == errors.EXIT_PREEMPTED, out
    assert "got SIGTERM; not restarting" in out
    assert started.read_text() == "1\n"  # one attempt, numbered 1
    assert json.loads((tmp_path / "supervisor.json").read_text())["attempts"][0]["exit_code"] == 75


# ----- goodput -----------------------------------------------------------------------------------------


def _records(*rows):
    return [dict(zip(("event", "step", "step_s"), row)) for row in rows]


def test_goodput_counts_recomputed_steps_as_badput():
    records = _records(
        ("start", 0), ("step", 10, 10.0), ("step", 20, 10.0), ("checkpoint", 20), ("step", 30, 10.0),  # crash
        ("start", 20), ("step", 30, 8.0), ("step", 40, 8.0), ("checkpoint", 40),
    )
    got = goodput.goodput(records, wall_s=60.0)
    assert got["productive_s"] == 36.0  # 10 + 10 from attempt 1, 8 + 8 from attempt 2
    assert got["lost_s"] == 10.0 and got["steps_lost"] == 10  # attempt 1's steps 21..30
    assert got["goodput"] == 0.6 and got["restarts"] == 1 and got["final_step"] == 40
    assert [(a["start_step"], a["last_step"], a["last_checkpoint"]) for a in got["attempts"]] == [(0, 30, 20),
                                                                                                 (20, 40, 40)]


def test_goodput_splits_a_record_that_straddles_the_resume_step_and_handles_rewinds():
    records = _records(
        ("start", 0), ("step", 10, 4.0), ("checkpoint", 5), ("step", 20, 4.0),  # resume at 5: half the first record
        ("start", 5), ("step", 15, 3.0), ("rewind", 12), ("step", 16, 1.0),  # NaN rollback to 12 inside the run
    )
    got = goodput.goodput(records, wall_s=20.0)
    # Kept: (0,5] 2.0 s, (5,12] 3.0 * 7/10 = 2.1 s, (12,16] 1.0 s.
    assert got["productive_s"] == pytest.approx(5.1)
    assert got["lost_s"] == pytest.approx(2.0 + 4.0 + 0.9) and got["steps_lost"] == 5 + 10 + 3
    assert got["restarts"] == 1 and got["final_step"] == 16


def test_recorder_lines_survive_a_torn_write_and_reading_starts_at_an_offset(tmp_path, monkeypatch):
    path = tmp_path / "goodput.jsonl"
    path.write_text(json.dumps({"event": "start", "step": 0}) + "\n")  # an earlier session's record
    offset = path.stat().st_size
    monkeypatch.setenv("JAXTRAIN_ATTEMPT", "3")
    rec = goodput.GoodputRecorder(path)
    rec.start(5)
    rec.steps(7, 1.5)
    rec.checkpoint(7)
    assert len(path.read_text().splitlines()) == 4  # on disk as soon as written
    with open(path, "a") as f:
        f.write('{"event": "step", "st')  # the line a SIGKILL cut
    goodput.GoodputRecorder(path, attempt=4).start(7)  # the next attempt
    records = goodput.read_records(path, offset)
    assert [(r["event"], r["step"], r["attempt"]) for r in records] == [("start", 5, 3), ("step", 7, 3),
                                                                        ("checkpoint", 7, 3), ("start", 7, 4)]
    assert records[1]["step_s"] == 1.5 and isinstance(records[0]["t"], float)


# Writes goodput records as a run would: attempt 1 does steps 1..20, checkpoints 10, crashes; attempt 2
# resumes at 10 and finishes 20.
RECORDING = (
    "import os, sys\n"
    "from jaxtrain.observe.goodput import GoodputRecorder\n"
    "rec = GoodputRecorder(os.path.join(sys.argv[1], 'goodput.jsonl'))\n"
    "if rec.attempt == 1:\n"
    "    rec.start(0); rec.steps(10, 1.0); rec.checkpoint(10); rec.steps(20, 1.0); sys.exit(1)\n"
    "rec.start(10); rec.steps(20, 1.0); rec.checkpoint(20)\n"
)


def test_supervisor_reports_goodput_of_this_session(tmp_path):
    (tmp_path / "goodput.jsonl").write_text(json.dumps({"event": "start", "step": 0}) + "\n")  # not this session
    lines = []
    rc = supervise.supervise([sys.executable, "-c", RECORDING, str(tmp_path)], backoff_s=0, workdir=tmp_path,
                             log=lines.append)
    gp = json.loads((tmp_path / "supervisor.json").read_text())["goodput"]
    assert rc == 0
    assert gp["productive_s"] == 2.0 and gp["lost_s"] == 1.0 and gp["steps_lost"] == 10 and gp["restarts"] == 1
    assert gp["goodput"] == pytest.approx(2.0 / gp["wall_s"])
    table = lines[-1]
    assert "0->20 (ckpt 10)" in table and "10->20 (ckpt 20)" in table and "10 steps recomputed" in table


@pytest.mark.parametrize("rc, kind, reason", [
    (0, "done", "finished"), (75, "preempt", "preempted"), (124, "crash", "hung"), (4, "crash", "checkpoint"),
    (-signal.SIGKILL, "crash", "killed by SIGKILL"), (1, "crash", "crashed (exit 1)"), (2, "fatal", "bad config"),
])
def test_classify(rc, kind, reason):
    got_kind, got_reason = supervise.classify(rc)
    assert got_kind == kind and reason in got_reason


def test_sigterm_during_backoff_ends_supervision_without_a_restart():
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM))
    previous = signal.getsignal(signal.SIGTERM)
    lines = []

    def log(line):
        lines.append(line)
        if "restart 1/3 in 60s" in line:  # the child has exited; the supervisor is backing off
            timer.start()

    t = time.monotonic()
    try:
        rc = supervise.supervise([sys.executable, "-c", "raise SystemExit(1)"], backoff_s=60, log=log)
    finally:
        timer.cancel()
    assert rc == 1 and time.monotonic() - t < 30
    assert "got SIGTERM; not restarting" in "\n".join(lines) and "crash 0/3" in lines[-1]
    assert signal.getsignal(signal.SIGTERM) is previous  # the supervisor's forwarding handler is gone


def test_cli_bad_input_is_one_line_and_exit_2_before_any_attempt(tmp_path):
    """Run as a user runs it (a process each): a negative budget, a command that is not found, a held workdir."""
    from jaxtrain import workdir as workdir_lib

    ok = ["--", sys.executable, "-c", "open('ran', 'w')"]
    for args, message in [(["--max_crash_restarts", "-1", *ok], "error: --max_crash_restarts: must be >= 0, got -1"),
                          (["--", "no-such-command-xyz"], "error: no-such-command-xyz: command not found")]:
        proc = subprocess.run([sys.executable, "-m", "jaxtrain", "supervise", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [message], proc.stderr[-2000:]
        assert os.listdir(tmp_path) == []  # no attempt ran, nothing written
    held = workdir_lib.Lock(tmp_path)
    held.acquire()
    try:
        proc = subprocess.run([sys.executable, "-m", "jaxtrain", "supervise", "--workdir", str(tmp_path), *ok],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    finally:
        held.release()
    (line,) = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert line.startswith(f"error: workdir: {tmp_path} is in use by another run (pid {os.getpid()} on ")
    assert not (tmp_path / "supervisor.json").exists() and not (tmp_path / "ran").exists()
