"""Randomised fault campaign: does every run recover, and end bit-identical to one that was never hurt?

    python scripts/chaos.py [--trials 10] [--seed 0] [--steps 300] [--out DIR]

A reference run of configs/tiny.py trains uninterrupted. Each trial runs the same config under `jaxtrain
supervise` and injects one of FAULTS at random: SIGKILL or SIGTERM at a random step; SIGKILL during a save;
SIGKILL, then damage to the newest checkpoint (corrupt:<kind>), its two newest step dirs swapped and the newest
copied to a later step (swap_steps), the dead run's workdir lock left (stale_lock) or a training shard damaged
(damaged_shard: the restart must exit 2 naming it, without a retry, then the shard is repaired); a second run
on the live workdir (concurrent: it must exit 2 within seconds, the first finish untouched); or the checkpoint
bucket's endpoint (a local GCS emulator) down for 0.5-12 s as a save starts (bucket_outage: the save waits it out
or the run exits 4 with one line, no traceback, and the supervisor's restart resumes); a bit flipped in the newest
checkpoint of the local tier (local:flip_bit: the restore must name it and fall back to checkpoint.dir); the
node-local dir (local_mode=node) deleted after a kill, as on a replaced machine (local:lost_dir: one process has
no peer, so it restores from checkpoint.dir; tests/e2e/test_local_replicas.py has the two-process case); a SIGKILL
while a node-local save is being written (local:kill_in_save: that step never commits, and the restart restores an
older verified one and sweeps the partial write away); or a
straggler (two processes, gloo; one stopped by SIGSTOP/SIGCONT bursts, not killed: process 0 must name it and the
run finish). docs/reliability.md says what each must do.

A trial *recovered* if the supervised run finished; it is *bit-identical* if its final state checksum (summary.json,
every array of params and optimizer state) equals the reference's; a *silent corruption* finished without complaint
but differs. Recovery time runs from the fault to the restarted trainer training again (its goodput "start"
record). Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import socket
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORRUPTIONS = ("flip_bit", "truncate", "missing_manifest", "missing_commit_marker", "broken_data_json")
AFTER_KILL = ("swap_steps", "stale_lock", "damaged_shard")  # like corrupt:*: kill, change files, restart
FAULTS = ("sigkill", "sigterm", "kill_in_save", *(f"corrupt:{c}" for c in CORRUPTIONS), *AFTER_KILL, "concurrent",
          "bucket_outage", "local:flip_bit", "local:lost_dir", "local:kill_in_save", "straggler")
STRAGGLER_EVERY = 5  # faults.straggler_every_steps in straggler trials: named after 3 slow reports in a row
STRAGGLER_LINE = re.compile(r"^straggler: host (\S+) \(process (\d+)\) step [\d.e+-]+s, [\d.]+x the median", re.M)
OUTAGE_BUDGET_S = 3  # JAXTRAIN_STORAGE_RETRY_SECONDS in bucket_outage trials: longer outages fail the save


def train_cmd(workdir: Path, args, data_dir: str | None = None, checkpoint_dir: str | None = None,
              extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "jaxtrain.main", "--config", str(REPO / "configs/tiny.py"),
            f"--config.workdir={workdir}", f"--config.train.steps={args.steps}",
            f"--config.data.dir={data_dir or args.data_dir}",
            f"--config.checkpoint.every_steps={args.every}", "--config.eval.every_steps=0",
            "--config.faults.step_timeout_s=120", *([f"--config.checkpoint.dir={checkpoint_dir}"] if checkpoint_dir
                                                    else []), *extra]


def local_tier(workdir: Path, every: int = 5, node: bool = False) -> tuple[str, ...]:
    """Overrides for a local tier beside `workdir` keeping one step: a bad copy there falls back to checkpoint.dir.
    `node`: node-local (each process's own subdirectory)."""
    return (f"--config.checkpoint.local_dir={workdir}-local", f"--config.checkpoint.local_every_steps={every}",
            "--config.checkpoint.local_keep=1", *(["--config.checkpoint.local_mode=node"] if node else []))


def last_step(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0) if '"loss"' in line else 0)
        except json.JSONDecodeError:  # the record being written
            pass
    return max(steps, default=0)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def wait_until(predicate, proc, timeout=300, poll=0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def newest_checkpoint(workdir: Path, root: Path | None = None) -> Path | None:
    root = root or workdir / "checkpoints"
    steps = [p for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(steps, key=lambda p: int(p.name), default=None)


def corrupt(step_dir: Path, kind: str, rng: random.Random) -> str:
    state = step_dir / "state"
    if kind == "flip_bit":  # one bit in the largest array-data file
        path = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        blob = bytearray(path.read_bytes())
        at = rng.randrange(len(blob) // 2, len(blob))
        blob[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(blob))
        return f"flipped a bit of {path.relative_to(step_dir)} at byte {at}"
    if kind == "truncate":
        path = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return f"truncated {path.relative_to(step_dir)}"
    if kind == "missing_manifest":
        (state / "manifest.ocdbt").unlink()
        return "deleted state/manifest.ocdbt"
    if kind == "missing_commit_marker":
        (step_dir / "commit_success.txt").unlink()
        return "deleted commit_success.txt"
    (step_dir / "data" / "metadata").write_text('{"next_token": ')
    return "broke data/metadata JSON"


def swap_steps(workdir: Path, args) -> str:
    root = workdir / "checkpoints"
    a, b = sorted((p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))[-2:]
    later = root / str(int(b.name) + 2 * args.every)
    shutil.copytree(b, later)
    b.rename(root / "swap")
    a.rename(b)
    (root / "swap").rename(a)
    return f"swapped steps {a.name} and {b.name}, copied {a.name}'s true checkpoint to {later.name}"


def damage_shard(data_dir: Path) -> Path:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    shard = data_dir / manifest["splits"]["train"][0]["file"]
    blob = bytearray(shard.read_bytes())
    for i in range(1000, len(blob), 997):
        blob[i] ^= 0xFF
    shard.write_bytes(bytes(blob))
    return shard


def supervise(workdir: Path, args, data_dir: str | None = None, checkpoint_dir: str | None = None,
              env: dict | None = None, extra: tuple[str, ...] = (), holds_workdir: bool = True) -> subprocess.Popen:
    """`jaxtrain supervise` of a trainer; `holds_workdir`: the supervisor locks the workdir (process 0's does)."""
    return subprocess.Popen([sys.executable, "-m", "jaxtrain", "supervise",
                             *(["--workdir", str(workdir)] if holds_workdir else []),
                             "--backoff_s", "0.2", "--", *train_cmd(workdir, args, data_dir, checkpoint_dir, extra)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(port: int, process: int, processes: int = 2) -> dict:
    """One process of a local multi-process run (gloo over jax.distributed, one CPU device each)."""
    return {"JAXTRAIN_COORDINATOR": f"127.0.0.1:{port}", "JAXTRAIN_NUM_PROCESSES": str(processes),
            "JAXTRAIN_PROCESS_ID": str(process), "JAX_PLATFORMS": "cpu"}


def stragglers_named(output: str) -> list[tuple[str, int]]:
    """(host, process) of every straggler process 0 logged (jaxtrain.hooks.Stragglers), in order."""
    return [(m.group(1), int(m.group(2))) for m in STRAGGLER_LINE.finditer(output)]


def after_a_step(path: Path, timeout: float = 2.0) -> bool:
    """Waits until `path` (a process's data fingerprints, a line a step, written as its step's last hook) grows:
    that process is then between steps, in its own work. A stop there delays its share of the next step; stopped
    while it waits for a step's results, a host looks like a slow device, which every host waits for alike and
    which is not told apart (docs/reliability.md, Stragglers)."""
    size = path.stat().st_size if path.exists() else 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size != size:
            return True
        time.sleep(0.0002)
    return False


def straggler(workdir: Path, args, rng: random.Random):
    """Two supervised processes; process 1's trainer is stopped for `stop` s in every `period` s (SIGSTOP just after
    a step, then SIGCONT) until the run ends. Returns (process 0's supervisor, process 1's, note)."""
    port = free_port()
    extra = (f"--config.faults.straggler_every_steps={STRAGGLER_EVERY}", "--config.log.fingerprints=True")
    sups = [supervise(workdir, args, env=process_env(port, i), extra=extra, holds_workdir=i == 0) for i in range(2)]
    period = rng.uniform(0.5, 1.0)
    stop = period * rng.uniform(0.7, 0.9)  # a few steps run between stops; some stops miss (after_a_step)

    def bursts():
        while sups[1].poll() is None:
            time.sleep(period - stop)
            pids = children(sups[1].pid)
            if not pids:
                continue
            with contextlib.suppress(ProcessLookupError):
                after_a_step(workdir / "data_fingerprints.1.jsonl")
                os.kill(pids[0], signal.SIGSTOP)
                time.sleep(stop)
                os.kill(pids[0], signal.SIGCONT)

    threading.Thread(target=bursts, daemon=True).start()
    return sups[0], sups[1], f"process 1 stopped {stop:.2f}s of every {period:.2f}s"


def bucket_outage(n: int, workdir: Path, args, rng: random.Random):
    """A supervised run checkpointing into a local GCS emulator that goes down for a random 0.5-12 s just after
    a save starts. Returns (supervisor, emulator, time the endpoint came back or None, note)."""
    sys.path.insert(0, str(REPO / "tests"))
    import emulators  # noqa: PLC0415 - the tests' local object stores

    gcs = emulators.GCS(Path(args.out) / f"gcs{n:02d}")  # its objects on disk: they outlast the outage
    gcs.start()
    env = {**gcs.env(), "JAXTRAIN_STORAGE_RETRY_SECONDS": str(OUTAGE_BUDGET_S)}
    sup = supervise(workdir, args, checkpoint_dir="gs://bucket/ckpt", env=env)
    save = args.every * rng.randrange(2, args.steps // args.every)  # an older checkpoint exists
    down = rng.uniform(0.5, 4 * OUTAGE_BUDGET_S)
    if not wait_until(lambda: last_step(workdir) >= save + 1, sup):
        return sup, gcs, None, "the run ended first"
    at = last_step(workdir)
    gcs.stop()
    time.sleep(down)
    gcs.start()
    return sup, gcs, time.time(), f"endpoint down {down:.1f}s at step {at} (save of step {save})"


def reference(args) -> str:
    workdir = Path(args.out) / "reference"
    subprocess.run(train_cmd(workdir, args), check=True, cwd=REPO, capture_output=True)
    return json.loads((workdir / "summary.json").read_text())["state_checksum"]


def trial(n: int, fault: str, args, rng: random.Random, reference_checksum: str) -> dict:
    workdir = Path(args.out) / f"trial{n:02d}-{fault.replace(':', '-')}"
    result = {"trial": n, "fault": fault, "injected": False, "recovered": False, "identical": False, "note": ""}
    data_dir = None
    if fault == "damaged_shard":  # a private copy of the data, damaged below
        data_dir = str(Path(args.out) / f"data{n:02d}")
        shutil.copytree(args.data_dir, data_dir)
    node = fault in ("local:lost_dir", "local:kill_in_save")
    extra = local_tier(workdir, node=node) if fault.startswith("local:") else ()
    local = Path(f"{workdir}-local")
    local_steps = local / "process-0" if node else local
    if fault == "local:kill_in_save":
        sup = supervise(workdir, args, extra=extra)
        target = rng.randrange(args.every + 1, args.steps - args.every)
        if wait_until(lambda: last_step(workdir) >= target and bool(partial_saves(local_steps)), sup, poll=0.0005) \
                and (pids := children(sup.pid)):
            partial = partial_saves(local_steps)
            os.kill(pids[0], signal.SIGKILL)  # its writer thread is between creating <step>.tmp-<pid> and the rename
            t_fault, killed_save = time.time(), min(int(name.split(".")[0]) for name in partial)
            # A save that committed between the look and the kill was not hit: no fault injected.
            result["injected"] = not (local_steps / str(killed_save)).exists()
            result["note"] = f"at step {last_step(workdir)}, during the node-local save of {partial}" + (
                "" if result["injected"] else " (it committed before the kill: missed)")
    elif fault.startswith(("corrupt:", "local:")) or fault in AFTER_KILL:
        # Train unsupervised past two checkpoints, kill, change the files, then resume under supervision.
        proc = subprocess.Popen(train_cmd(workdir, args, data_dir, extra=extra), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        target = rng.randrange(3 * args.every + 1, args.steps - (args.every if extra else 1))

        def ready():  # local:*: the local tier's one step is the newest, so its damage must fall back to the dir
            newest = [newest_checkpoint(workdir, root) for root in (local_steps, workdir / "checkpoints")]
            return last_step(workdir) >= target and (not extra or (
                newest[0] is not None and int(newest[0].name) > int(newest[1].name if newest[1] else 0)))

        if wait_until(ready, proc):
            proc.kill()
            proc.wait()
            time.sleep(0.5)  # no save can still be finishing: the process is gone
            note = f"killed at {last_step(workdir)}; "
            if fault == "swap_steps":
                note += swap_steps(workdir, args)
            elif fault == "stale_lock":
                note += f"its lock left behind naming pid {json.loads((workdir / '.lock').read_text())['pid']}"
            elif fault == "damaged_shard":
                shard = damage_shard(Path(data_dir))
                first = supervise(workdir, args, data_dir)
                out = first.communicate(timeout=300)[0]
                if first.returncode != 2 or str(shard) not in out or "crash 0/" not in out:
                    note += f"damaged shard NOT refused: supervisor exit {first.returncode}: {out[-300:]!r}; "
                else:
                    note += f"damaged {shard.name}: exit 2 naming it, no retry; repaired; "
                    shutil.copyfile(Path(args.data_dir) / shard.name, shard)
            elif fault == "local:lost_dir":
                note += f"deleted the node-local dir (newest step {newest_checkpoint(workdir, local_steps).name})"
                shutil.rmtree(local)
            else:
                step_dir = newest_checkpoint(workdir, local if fault.startswith("local:") else None)
                note += f"step {step_dir.name}{' (local tier)' if extra else ''}: " + corrupt(
                    step_dir, fault.split(":")[1], rng)
            result["note"] = note
            result["injected"], t_fault = "NOT refused" not in note, time.time()
        proc.wait()
        sup = supervise(workdir, args, data_dir, extra=extra)
    elif fault == "straggler":
        sup, other, result["note"] = straggler(workdir, args, rng)
        result["injected"], result["comparable"] = True, False  # 2 processes: another reduction order
    elif fault == "bucket_outage":
        sup, gcs, t_fault, result["note"] = bucket_outage(n, workdir, args, rng)
        result["injected"] = t_fault is not None
    elif fault == "concurrent":
        sup = supervise(workdir, args)
        target = rng.randrange(5, args.steps - 5)
        if wait_until(lambda: last_step(workdir) >= target, sup) and (pids := children(sup.pid)):
            # The old job is paused, not ended, while the second starts: a tiny run would otherwise finish (and
            # release the workdir) within the second's start-up. A stopped process still holds its lock.
            os.kill(pids[0], signal.SIGSTOP)
            at, t0 = last_step(workdir), time.time()
            try:
                second = subprocess.run(train_cmd(workdir, args), cwd=REPO, capture_output=True, text=True,
                                        timeout=300)
            finally:
                os.kill(pids[0], signal.SIGCONT)
            took = time.time() - t0
            refused = second.returncode == 2 and "is in use by another run" in second.stderr
            result["note"] = (f"second run at step {at}: exit {second.returncode} after {took:.1f}s"
                              + ("" if refused else f": {second.stderr[-300:]!r}"))
            result["injected"], result["recovery_s"] = refused, round(took, 2)
    else:
        sup = supervise(workdir, args)
        if fault == "kill_in_save":  # the first save after a random step, so an older checkpoint exists
            ckpts, target = workdir / "checkpoints", rng.randrange(args.every + 1, args.steps - args.every)
            ready = lambda: last_step(workdir) >= target and any("tmp" in p.name for p in ckpts.iterdir())  # noqa: E731
            poll = 0.0005
        else:
            target = rng.randrange(5, args.steps - 5)
            ready, poll = (lambda: last_step(workdir) >= target), 0.01
        if wait_until(ready, sup, poll=poll):
            pids = children(sup.pid)
            if pids:
                os.kill(pids[0], signal.SIGTERM if fault == "sigterm" else signal.SIGKILL)
                result["injected"], t_fault = True, time.time()
                result["note"] = f"at step {last_step(workdir)}" + (
                    f", during the save of {[p.name for p in ckpts.iterdir() if 'tmp' in p.name]}"
                    if fault == "kill_in_save" else "")
    out = sup.communicate(timeout=900)[0]
    unexpected = False
    if fault == "straggler":
        other.communicate(timeout=120)
        named = stragglers_named(out)
        result["note"] += (f"; process 0 named {sorted(set(named))} {len(named)} time(s)" if named else
                           "; process 0 named no straggler") + (
            f", process 1 exit {other.returncode}" if other.returncode else "")
        unexpected = other.returncode != 0 or {p for _, p in named} != {1}  # named, perhaps more than once
    if fault == "local:flip_bit":  # a flip in bytes no array reads changes nothing: restored from it, identical
        fell_back = f"in {local} is unusable" in out and restart_tier(workdir) == "dir"
        result["note"] += ("; named, fell back to checkpoint.dir" if fell_back else
                           f"; not detected, restored from the {restart_tier(workdir)} tier")
    if fault == "local:lost_dir":
        result["note"] += f"; restored from the {restart_tier(workdir)} tier"
    if fault == "local:kill_in_save" and result["injected"]:
        restored, left = restart_step(workdir), partial_saves(local_steps)
        result["note"] += (f"; restored step {restored} from the {restart_tier(workdir)} tier"
                           + (f"; partial writes left: {left}" if left else "; the partial write swept away"))
        unexpected = restored is None or restored >= killed_save or bool(left)  # the partial step never commits
    if fault == "bucket_outage":
        gcs.stop()
        failed = [line for line in out.splitlines() if line.startswith("error: ")]
        result["note"] += (f"; {len(failed)} failed save(s), restarted: {failed[0][:90]}..." if failed
                           else "; the save waited it out")
        unexpected = "Traceback" in out or any(not line.startswith("error: saving step ") for line in failed)
        if unexpected:
            result["note"] += f" | UNEXPECTED OUTPUT: {out[-600:]!r}"
    summary_path = workdir / "summary.json"
    if sup.returncode == 0 and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        result["recovered"] = bool(summary["finished"]) and not unexpected
        result["identical"] = summary["state_checksum"] == reference_checksum
    else:
        result["note"] += f" | supervisor exit {sup.returncode}: {out[-300:]!r}"
    if result["injected"] and fault not in ("concurrent", "straggler"):
        starts = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines()
                  if '"start"' in line]
        later = [r["t"] for r in starts if r["t"] > t_fault]
        result["recovery_s"] = round(later[0] - t_fault, 2) if later else None
    sup_json = workdir / "supervisor.json"
    if sup_json.exists():
        result["goodput"] = json.loads(sup_json.read_text()).get("goodput", {}).get("goodput")
    return result


def partial_saves(local_steps: Path) -> list[str]:
    """The node-local step dirs being written (or left by a killed save): `<step>.tmp-<pid>`."""
    try:
        return sorted(n for n in os.listdir(local_steps) if ".tmp-" in n)
    except FileNotFoundError:
        return []


def restart_step(workdir: Path) -> int | None:
    """The step the workdir's last (re)start restored (goodput.jsonl's "phases" record)."""
    phases = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines() if '"phases"' in line]
    return phases[-1].get("step") if phases else None


def restart_tier(workdir: Path) -> str | None:
    """The restore tier of the workdir's last (re)start (goodput.jsonl's "phases" record)."""
    phases = [json.loads(line) for line in (workdir / "goodput.jsonl").read_text().splitlines() if '"phases"' in line]
    return phases[-1].get("restore_tier") if phases else None


def silent(r: dict) -> bool:
    """Finished without complaint, but not as the reference (straggler trials, 2 processes, are not compared)."""
    return r["recovered"] and r.get("comparable", True) and not r["identical"]


def table(results: list[dict]) -> str:
    rows = ["| fault | injected | recovered | bit-identical | silent corruptions | mean recovery s |",
            "|---|---|---|---|---|---|"]
    kinds = sorted({r["fault"] for r in results})
    for kind in [*kinds, "all"]:
        rs = [r for r in results if kind in ("all", r["fault"])]
        injected = [r for r in rs if r["injected"]]
        rec = [r["recovery_s"] for r in injected if r.get("recovery_s") is not None]
        compared = [r for r in injected if r.get("comparable", True)]
        identical = str(sum(r["identical"] for r in compared)) if compared else "n/a"
        rows.append(f"| {'**all**' if kind == 'all' else kind} | {len(injected)} | "
                    f"{sum(r['recovered'] for r in injected)} | {identical} | {sum(map(silent, rs))} | "
                    + (f"{statistics.mean(rec):.1f} |" if rec else "- |"))
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=len(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="checkpoint.every_steps")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ",".join(FAULTS))
    parser.add_argument("--out", default="", help="campaign directory (default: a new temp dir)")
    parser.add_argument("--data_dir", default=str(Path.home() / ".cache/jaxtrain/data/kjv_v512_h200"))
    args = parser.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="jaxtrain-chaos-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    kinds = args.faults.split(",")
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}")
    # Each kind equally often (up to one), in a seeded order.
    plan = [kinds[i % len(kinds)] for i in range(args.trials)]
    rng.shuffle(plan)

    t = time.perf_counter()
    ref = reference(args)
    print(f"reference run: state checksum {ref} ({time.perf_counter() - t:.0f}s); campaign in {args.out}", flush=True)
    results = []
    for n, fault in enumerate(plan):
        r = trial(n, fault, args, rng, ref)
        results.append(r)
        print(f"trial {n:2d} {fault:32s} injected={r['injected']!s:5} recovered={r['recovered']!s:5} "
              f"identical={r['identical']!s:5} recovery_s={r.get('recovery_s')} {r['note']}", flush=True)
    print()
    print(table(results))
    corruptions = sum(map(silent, results))
    injected = [r for r in results if r["injected"]]
    print(json.dumps({"faults": len(injected), "recovered": sum(r["recovered"] for r in injected),
                      "identical": sum(r["identical"] for r in injected), "silent_corruptions": corruptions}))
    return 0 if corruptions == 0 and all(r["recovered"] and (r["identical"] or not r.get("comparable", True))
                                         for r in injected) else 1


if __name__ == "__main__":
    sys.exit(main())
