"""`jaxtrain supervise [--max_crash_restarts 3] [--max_preempt_restarts 100] [--backoff_s 1]
[--workdir DIR] -- <train command ...>`

Runs the training command until it finishes. Exit 75 (preempted, state saved) restarts it against the
preemption budget; a crash, a death by signal, a hang (124) or a failed checkpoint write (4) restarts it
against the crash budget, with a doubling backoff; a bad config (2) or a non-finite loss (3) would fail
the same way again, so those are returned at once. SIGTERM/SIGINT sent to the supervisor go to the child
(which saves and exits 75) and end supervision. The child sees JAXTRAIN_ATTEMPT=1, 2, ..., its launch time
and the previous attempt's exit time (for the phases of each restart in goodput.jsonl).

The child runs in its own session so a terminal's Ctrl-C reaches it once, through the supervisor. At the
end a table of attempts and the goodput (from WORKDIR/goodput.jsonl) are printed, and written to
WORKDIR/supervisor.json with --workdir.
"""

from __future__ import annotations


import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxtrain import errors, files
from jaxtrain import workdir as workdir_lib
from jaxtrain.observe import goodput as goodput_lib
from jaxtrain.tools import common

MAX_BACKOFF_S = 300.0


def classify(rc: int) -> tuple[str, str]:
    """(kind, reason) of a child's exit status; kind is done, fatal, preempt or crash."""
    known = {
        errors.EXIT_OK: ("done", "finished"),
        errors.EXIT_BAD_INPUT: ("fatal", "bad config or input"),
        errors.EXIT_NONFINITE: ("fatal", "non-finite loss"),
        errors.EXIT_PREEMPTED: ("preempt", "preempted, state saved"),
        errors.EXIT_HUNG: ("crash", "hung (step watchdog)"),
        errors.EXIT_CHECKPOINT: ("crash", "checkpoint write failed"),
    }
    if rc in known:
        return known[rc]
    if rc < 0:
        try:
            return "crash", f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return "crash", f"killed by signal {-rc}"
    return "crash", f"crashed (exit {rc})"


def supervise(cmd: list[str], *, max_crash_restarts: int = 3, max_preempt_restarts: int = 100,
              backoff_s: float = 1.0, workdir: str | os.PathLike | None = None, env: dict | None = None,
              log=print) -> int:
    """Returns the last child's exit code (128 + N for a death by signal N, as a shell reports it). With `workdir`,
    holds its lock (jaxtrain.workdir) throughout and hands it to each child: ConfigError if another run has it."""
    lock = None
    if workdir:
        files.make_dir(workdir, "workdir")
        lock = workdir_lib.Lock(workdir)
        lock.acquire()
        env = {**(os.environ if env is None else env), **lock.inheritable_env()}
    t0 = time.monotonic()
    ledger = Path(workdir) / "goodput.jsonl" if workdir else None
    offset = ledger.stat().st_size if ledger and ledger.exists() else 0  # earlier sessions are not ours
    budgets = {"preempt": max_preempt_restarts, "crash": max_crash_restarts}
    restarts = {"preempt": 0, "crash": 0}
    attempts: list[dict] = []
    stopping = threading.Event()
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        received.append(signum)
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    rc = 0
    exited_at = None
    try:
        while True:  # every exit path below checks `stopping`
            n = len(attempts) + 1
            started = time.monotonic()
            # The child's "phases" record (jaxtrain.observe.goodput) dates its launch and its predecessor's exit.
            timing = {goodput_lib.LAUNCHED_AT_ENV: repr(time.time()),
                      **({goodput_lib.PREVIOUS_EXIT_AT_ENV: repr(exited_at)} if exited_at else {})}
            child = subprocess.Popen(cmd, env={**(os.environ if env is None else env), "JAXTRAIN_ATTEMPT": str(n),
                                               **timing},
                                     start_new_session=True, pass_fds=(lock.fd,) if lock else ())
            if received:  # a signal that arrived before the child existed
                child.send_signal(received[-1])
            rc = child.wait()
            exited_at = time.time()
            kind, reason = classify(rc)
            attempts.append({"attempt": n, "exit_code": rc, "kind": kind, "reason": reason,
                             "duration_s": round(time.monotonic() - started, 3), "exited_unix": round(exited_at, 3)})
            log(f"supervise: attempt {n} exited {rc}: {reason}")
            if kind in ("done", "fatal"):
                break
            if restarts[kind] >= budgets[kind]:
                log(f"supervise: {kind} restart budget exhausted ({budgets[kind]} restarts); giving up, exit {rc}")
                break
            delay = backoff_s if kind == "preempt" else min(backoff_s * 2 ** restarts[kind], MAX_BACKOFF_S)
            if not stopping.is_set():
                log(f"supervise: {kind} restart {restarts[kind] + 1}/{budgets[kind]} in {delay:g}s")
            if stopping.wait(delay):  # a signal to us: the child got it too, and is not brought back
                log(f"supervise: got {signal.Signals(received[0]).name}; not restarting")
                break
            restarts[kind] += 1
    finally:
        if child is not None and child.poll() is None:  # we are failing ourselves: leave no orphan
            child.kill()
            child.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if lock:
            lock.release()

    wall_s = time.monotonic() - t0
    gp = goodput_lib.goodput(goodput_lib.read_records(ledger, offset), wall_s) if ledger else None
    summary = {"command": list(cmd), "exit_code": rc, "attempts": attempts, "restarts": restarts,
               "budgets": budgets, "wall_s": round(wall_s, 3), "goodput": gp}
    log(format_summary(summary))
    if workdir:
        (Path(workdir) / "supervisor.json").write_text(json.dumps(summary, indent=1) + "\n")
    return rc if rc >= 0 else 128 - rc


def format_summary(summary: dict) -> str:
    gp = summary["goodput"]
    runs = {a["attempt"]: a for a in gp["attempts"]} if gp else {}
    lines = [f"{'attempt':>7}  {'exit':>4}  {'time':>8}  {'steps':<20}  reason"]
    for a in summary["attempts"]:
        run = runs.get(a["attempt"])
        steps = "-"
        if run:
            ckpt = run["last_checkpoint"]
            steps = f"{run['start_step']}->{run['last_step']}" + ("" if ckpt is None else f" (ckpt {ckpt})")
        lines.append(f"{a['attempt']:>7}  {a['exit_code']:>4}  {a['duration_s']:>7.1f}s  {steps:<20}  {a['reason']}")
    r, b = summary["restarts"], summary["budgets"]
    lines.append(f"restarts: preempt {r['preempt']}/{b['preempt']}, crash {r['crash']}/{b['crash']}; "
                 f"wall {summary['wall_s']:.1f}s")
    if not gp or not gp["attempts"]:
        lines.append("goodput: no records (the run writes WORKDIR/goodput.jsonl; pass --workdir)")
    else:
        lines.append(f"goodput: {100 * gp['goodput']:.1f}% (productive {gp['productive_s']:.1f}s of "
                     f"{gp['wall_s']:.1f}s wall; {gp['steps_lost']} steps recomputed, {gp['lost_s']:.1f}s lost)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: jaxtrain supervise [options] -- <train command ...>", file=sys.stderr)
        return errors.EXIT_BAD_INPUT
    split = argv.index("--")
    parser = common.Parser(prog="jaxtrain supervise")
    parser.add_argument("--max_crash_restarts", type=int, default=3)
    parser.add_argument("--max_preempt_restarts", type=int, default=100)
    parser.add_argument("--backoff_s", type=float, default=1.0)
    parser.add_argument("--workdir", default=None, help="the run's workdir: reads goodput.jsonl, writes supervisor.json")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if not cmd:
        parser.error("no command after --")
    for flag in ("max_crash_restarts", "max_preempt_restarts", "backoff_s"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag}: must be >= 0, got {getattr(args, flag)}")
    if shutil.which(cmd[0]) is None:
        parser.error(f"{cmd[0]}: command not found")
    return common.run(lambda _: supervise(
        cmd, max_crash_restarts=args.max_crash_restarts, max_preempt_restarts=args.max_preempt_restarts,
        backoff_s=args.backoff_s, workdir=args.workdir, log=lambda line: print(line, flush=True)))

