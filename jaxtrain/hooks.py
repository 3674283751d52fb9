"""Things that happen between steps. The loop calls every hook after every step; each decides itself
whether it has work. Add a feature by adding a hook, not a branch in the loop. `build` makes a run's hooks
from its config."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import socket
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import faults
from jaxtrain import step as step_lib
from jaxtrain.data import pipeline as data_pipeline
from jaxtrain.errors import CheckpointError, NonFiniteLoss, Preempted
from jaxtrain.fields import Group
from jaxtrain.observe import goodput, profiling
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.parallel import distributed

# The config's `eval` group (EvalHook): held-out loss every `every_steps` (0 = only at the end), `batches` batches
# each, and at step 0 when `at_start`. `sets` (optional): more validation sets, "name=DIR,name2=DIR2", each the
# held-out split of a prepared dir tokenized with `data.dir`'s tokenizer, reported as eval_loss/<name>; eval_loss
# stays data.dir's.
EVAL_CONFIG = dict(every_steps=50, batches=4, at_start=True, sets="")


def check_eval_config(e) -> None:
    g = Group(e, "eval")
    g.positive_int("every_steps", allow_zero=True)
    g.positive_int("batches")
    data_pipeline.check_eval_sets(e.sets)


class Clock:
    """Wall time of the run minus time spent paused (eval, checkpoint writes), for honest tokens/s.
    `on_pause` (e.g. the step watchdog's `paused`) is entered for every pause as well. `data_wait_s`
    counts the time the loop waited for the input pipeline, `device_wait_s` (`waiting()`) the time it waited for
    the steps' results: the device's time and the slower peers', not this host's (StragglerHook)."""

    def __init__(self, on_pause=contextlib.nullcontext):
        self.start = time.perf_counter()
        self.paused_s = 0.0
        self.data_wait_s = 0.0
        self.device_wait_s = 0.0
        self.on_pause = on_pause

    @contextlib.contextmanager
    def waiting(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.device_wait_s += time.perf_counter() - t

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            with self.on_pause():
                yield
        finally:
            self.paused_s += time.perf_counter() - t

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.paused_s


class Hook:
    """`batch` is this process's numpy batch; `metrics` are device arrays (fetching them syncs).
    `rewind(step)` tells the hook that training continues from an earlier `step` (NaN rollback)."""

    def __call__(self, step: int, state, metrics, batch) -> None: ...
    def end(self, step: int, state) -> None: ...
    def rewind(self, step: int) -> None: ...


class Rollback(Exception):
    """faults.nan_policy=rollback: the loop restores the last checkpoint and skips the data up to `step`."""

    def __init__(self, step: int):
        super().__init__(f"non-finite loss or gradient at step {step}")
        self.step = step


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LogHook(Hook):
    """Every `every` steps: one progress line and one metrics record. The record has every metric the step
    reports under a name with a '/' (the MoE's, an objective's); `progress` puts some of them on the line: name ->
    (scale, format of the scaled value), e.g. {"dpo/accuracy": (100.0, "pref acc {:.1f}%")}."""

    def __init__(self, *, every: int, total_steps: int, start_step: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops: float, writer, clock: Clock, print_fn=print,
                 progress: dict[str, tuple[float, str]] | None = None):
        self.every, self.total, self.tokens_per_step = every, total_steps, tokens_per_step
        self.flops_per_token, self.peak = flops_per_token, peak_flops
        self.writer, self.clock, self.print = writer, clock, print_fn
        self.progress = progress or {}
        self.rewind(start_step)

    def rewind(self, step):
        self.pending = []
        self.last_step, self.last_time, self.last_wait = step, self.clock.train_seconds(), self.clock.data_wait_s

    def __call__(self, step, state, metrics, batch):
        self.pending.append(metrics)
        if step % self.every and step != self.total:
            return
        with self.clock.waiting():
            fetched = jax.device_get(self.pending)
        self.pending = []
        now = self.clock.train_seconds()
        steps_done = step - self.last_step
        secs = max(now - self.last_time, 1e-9)
        tok_s = steps_done * self.tokens_per_step / secs
        mfu = tok_s * self.flops_per_token / self.peak
        eta = (self.total - step) * secs / steps_done
        finite = [m for m in fetched if m["finite"]] or fetched  # skipped steps don't enter the mean
        record = {"loss": float(np.mean([m["loss"] for m in finite])), "lr": float(fetched[-1]["lr"]),
                  "grad_norm": float(fetched[-1]["grad_norm"]), "tokens_per_sec": tok_s, "mfu": mfu,
                  "eta_s": eta, "data_wait_frac": (self.clock.data_wait_s - self.last_wait) / secs,
                  "skipped_steps": len(fetched) - sum(bool(m["finite"]) for m in fetched)}
        record.update({k: float(np.mean([m[k] for m in finite])) for k in finite[0] if "/" in k})
        self.writer.write_scalars(step, record)
        extra = (f" | moe drop {100 * record['moe/dropped_fraction']:.1f}% load min {record['moe/min_load']:.2f} "
                 f"max {record['moe/max_load']:.2f}"
                 if "moe/max_load" in record else "")
        if shown := [fmt.format(scale * record[k]) for k, (scale, fmt) in self.progress.items() if k in record]:
            extra += " | " + " ".join(shown)
        self.print(f"step {step:>{len(str(self.total))}}/{self.total} | loss {record['loss']:.4f} | "
                   f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | {tok_s:,.0f} tok/s | "
                   f"MFU {100 * mfu:.1f}%{extra} | ETA {_duration(eta)}")
        self.last_step, self.last_time, self.last_wait = step, now, self.clock.data_wait_s


class ExpertLoadHook(Hook):
    """A mixture of experts' per-expert load, every `every` steps: one line of `path` (JSON) with the step and each
    layer's experts' shares of its assignments over the steps since the last line, as multiples of an even share
    (1 = balanced; model order, the prediction modules' layers last). Summed on the device, by every process (the
    loads are global arrays); fetched and written by process 0 (`write`)."""

    def __init__(self, path: Path, every: int, start_step: int, write: bool = True):
        self.path, self.every, self.write = path, every, write
        self.rewind(start_step)

    def rewind(self, step):
        self.total = None

    def __call__(self, step, state, metrics, batch):
        load = metrics.get(step_lib.EXPERT_LOAD)
        if load is None:
            return
        load = jnp.where(metrics["finite"], load, 0)  # on the device: a skipped step's routing does not count
        self.total = load if self.total is None else self.total + load
        if step % self.every:
            return
        if self.write:
            load = np.asarray(jax.device_get(self.total), np.float64)
            shares = load * load.shape[-1] / np.maximum(load.sum(axis=-1, keepdims=True), 1.0)
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "load": np.round(shares, 4).tolist()}) + "\n")
        self.total = None


class NonFiniteGuard(Hook):
    """Applies faults.nan_policy. The step itself never applies a non-finite update (device-side select);
    this hook decides what the run does next. It reads the previous step's flag, which is already
    computed, so it never stalls the pipeline; the flag is a replicated output, so every process
    decides the same. Rollback gives up after `max_rollbacks` in a row without a new checkpoint."""

    def __init__(self, policy: str, print_fn=print, max_rollbacks: int = 3):
        self.policy, self.print, self.max_rollbacks = policy, print_fn, max_rollbacks
        self.previous, self.skipped, self.rollbacks = None, 0, 0

    def check(self):
        if self.previous is None:
            return
        step, metrics = self.previous
        self.previous = None
        if bool(metrics["finite"]):
            return
        what = f"non-finite loss or gradient at step {step} (its update was not applied)"
        if self.policy == "skip":
            self.skipped += 1
            self.print(f"warning: {what}; skipped ({self.skipped} so far)")
        elif self.policy == "rollback" and self.rollbacks < self.max_rollbacks:
            self.rollbacks += 1
            raise Rollback(step)
        else:
            hint = "lower optim.lr or check the data" if self.policy == "halt" else \
                f"{self.max_rollbacks} rollbacks in a row did not help"
            raise NonFiniteLoss(f"{what}; faults.nan_policy={self.policy}: {hint}")

    def __call__(self, step, state, metrics, batch):
        self.check()
        self.previous = (step, metrics)

    def end(self, step, state):
        self.check()

    def rewind(self, step):
        self.previous = None

    def checkpoint_committed(self):
        self.rollbacks = 0


class EvalHook(Hook):
    """Held-out losses every `every` steps (and at the end); 0 = only at the end. `evaluate(state)` returns
    {"eval_loss": the primary loss, "eval_loss/<name>": one per extra eval set (eval.sets)}, and any other
    held-out metrics (written and printed, not kept in the history)."""

    def __init__(self, *, every: int, total_steps: int, evaluate, writer, clock: Clock, print_fn=print,
                 earlier: list[dict] | tuple = ()):
        """`earlier`: metrics records of the evals before a resume ({"step", "eval_loss", "eval_loss/<set>"})."""
        self.every, self.total, self.evaluate = every, total_steps, evaluate
        self.writer, self.clock, self.print = writer, clock, print_fn
        self.history: list[tuple[int, float]] = []  # (step, eval_loss)
        self.set_history: dict[str, list[tuple[int, float]]] = {}  # eval set name -> [(step, its loss)]
        for record in earlier:
            self._record(record["step"], {k: v for k, v in record.items() if k.startswith("eval_loss")})

    def _record(self, step, losses):
        if "eval_loss" in losses:
            self.history.append((step, losses["eval_loss"]))
        for metric, loss in losses.items():
            if metric.startswith("eval_loss/"):
                self.set_history.setdefault(metric.removeprefix("eval_loss/"), []).append((step, loss))

    def run(self, step, state):
        with self.clock.paused():
            losses = self.evaluate(state)
        if not losses:  # nothing to evaluate on (an RL objective's prompts have no eval batches yet)
            return
        self._record(step, losses)
        self.writer.write_scalars(step, losses)
        self.print(f"eval @ step {step}: " + " | ".join(f"{metric} {loss:.4f}" for metric, loss in losses.items()))

    def __call__(self, step, state, metrics, batch):
        if (self.every and step % self.every == 0) or step == self.total:
            self.run(step, state)

    def rewind(self, step):  # a rollback: the evals past `step` are of weights now thrown away
        self.history = [(s, loss) for s, loss in self.history if s <= step]
        self.set_history = {name: [(s, loss) for s, loss in h if s <= step] for name, h in self.set_history.items()}


class CheckpointHook(Hook):
    """Saves when the checkpointer's policy says so (every N steps / M minutes, the same answer on every
    process) and where the run ends normally (last step or `train.stop_at`). After an error nothing new
    is saved: the state may be half-donated. A failed write raises CheckpointError (exit 4) with
    `on_write_error="stop"`, or is reported and retried at the next save with "continue"."""

    def __init__(self, *, checkpointer, data_iterator, clock: Clock, start_step: int, on_write_error: str = "stop",
                 print_fn=print, on_commit=lambda step: None):
        self.ckpt, self.data, self.clock = checkpointer, data_iterator, clock
        self.on_write_error, self.print, self.on_commit = on_write_error, print_fn, on_commit
        self.last_saved = start_step

    def _guarded(self, fn, *args):
        try:
            with self.clock.paused():
                fn(*args)
        except CheckpointError as e:
            if self.on_write_error == "stop":
                raise
            self.print(f"warning: {e}; checkpoint.on_write_error=continue: training on, the next save retries")
            return False
        return True

    def save(self, step, state, force=False):
        """`force`: save even if this step was saved already (it may have gone to the local tier only)."""
        if (force or step != self.last_saved) and self._guarded(self.ckpt.save, step, state, self.data.get_state()):
            self.last_saved = step
            self.on_commit(step)

    def __call__(self, step, state, metrics, batch):
        if self.ckpt.should_save(step):
            self.save(step, state)

    def end(self, step, state):
        self.save(step, state)
        self.wait()

    def wait(self):
        self._guarded(self.ckpt.wait)

    def rewind(self, step):
        self.last_saved = step


class PreemptionHook(Hook):
    """After SIGTERM reaches any process, all of them agree on this step, save it and stop (exit 75)."""

    def __init__(self, guard, checkpoint_hook: CheckpointHook, print_fn=print):
        self.guard, self.ckpt, self.print = guard, checkpoint_hook, print_fn

    def __call__(self, step, state, metrics, batch):
        if self.guard.should_stop(step):
            # Waiting first lets the checkpointer see whether this step already committed to the persistent
            # directory (then the forced save is a no-op) or only to the local tier (then it is saved again).
            self.ckpt.wait()
            self.ckpt.save(step, state, force=True)
            self.ckpt.wait()
            since = self.guard.since_signal()  # None on processes the signal did not reach
            timing = f" {since:.1f}s after SIGTERM (faults.preempt_grace_s={self.guard.grace_s:g})" if since else ""
            self.print(f"preempted: saved step {step}{timing}")
            if since and since > self.guard.grace_s:
                self.print("warning: the save took longer than the grace period; raise faults.preempt_grace_s "
                           "or save less often so fewer steps are at risk")
            raise Preempted(step)


class GoodputHook(Hook):
    """Feeds jaxtrain.observe.goodput's record (process 0): productive step time every `every` steps."""

    def __init__(self, recorder, *, every: int, clock: Clock, start_step: int):
        self.recorder, self.every, self.clock = recorder, every, clock
        self.recorder.start(start_step)
        self.last_step, self.last_time = start_step, clock.train_seconds()

    def _record(self, step):
        now = self.clock.train_seconds()
        if step > self.last_step:
            self.recorder.steps(step, now - self.last_time)
        self.last_step, self.last_time = step, now

    def __call__(self, step, state, metrics, batch):
        if step % self.every == 0:
            self._record(step)

    def end(self, step, state):
        self._record(step)

    def rewind(self, step):
        self.recorder.rewind(step)
        self.last_step, self.last_time = step, self.clock.train_seconds()


class WatchdogHook(Hook):
    """Pets the step watchdog after every step; it is stopped at the end."""

    def __init__(self, watchdog):
        self.watchdog = watchdog

    def __call__(self, step, state, metrics, batch):
        self.watchdog.pet()

    def end(self, step, state):
        self.watchdog.stop()


def own_step_times(reports: dict[int, tuple[float, float]]) -> dict[int, float]:
    """Each process's own step time, from its (wall seconds, seconds waiting for results) per step: its wall time
    less what it waited beyond the process that waited least. In a synchronous step every process takes the same
    wall time, and the one the others wait for waits least (for the device alone)."""
    least = min(wait for _, wait in reports.values())
    return {p: wall - wait + least for p, (wall, wait) in reports.items()}


class Stragglers:
    """Process 0's record of the step times that every process reports (StragglerHook). A process is a straggler
    once its own step time was over `factor` times the median of the others' in each of the last `rounds`
    reports; `add` returns the lines to log when one becomes a straggler or stops being one."""

    def __init__(self, factor: float, rounds: int = 3):
        self.factor, self.rounds = factor, rounds
        self.history: list[tuple[int, dict[int, float]]] = []  # (step, process -> its own time / others' median)
        self.flagged: set[int] = set()

    @staticmethod
    def ratios(own: dict[int, float]) -> dict[int, float]:
        if len(own) < 2:
            return {}
        return {p: t / max(statistics.median(o for q, o in own.items() if q != p), 1e-9) for p, t in own.items()}

    def add(self, step: int, reports: dict[int, tuple[float, float]], hosts: dict[int, str]) -> list[str]:
        own = own_step_times(reports)
        ratios = self.ratios(own)
        self.history = (self.history + [(step, ratios)])[-self.rounds:]
        full = len(self.history) == self.rounds
        lines = []
        for p in sorted(ratios):
            over = [r.get(p, 0.0) > self.factor for _, r in self.history]
            if p not in self.flagged and full and all(over):
                self.flagged.add(p)
                lines.append(f"straggler: host {hosts.get(p, '?')} (process {p}) step {own[p]:.3g}s, "
                             f"{ratios[p]:.1f}x the median of the others, over the last {self.rounds} reports "
                             f"(steps {self.history[0][0]}..{step})")
            elif p in self.flagged and not over[-1]:
                self.flagged.discard(p)
                lines.append(f"straggler: host {hosts.get(p, '?')} (process {p}) is back under {self.factor:g}x the "
                             f"median of the others at step {step} ({ratios[p]:.1f}x)")
        return lines


class StragglerHook(Hook):
    """Every `every` steps (0: never) each process reports its step time, the wall time less the time it waited
    for the results (Clock.device_wait_s), to jax.distributed's key-value store `store` (host RPCs, no device work).
    Process 0 reads the round before, complete by then (the steps since need every process), and logs stragglers
    (Stragglers). The step watchdog's dump calls `peer_report`: the processes stuck in the same step say
    so, and those that do not within `hang_wait_s` are named as the likely cause."""

    PREFIX = "jaxtrain/step_time/"

    def __init__(self, store, *, process: int, processes: int, every: int, factor: float, clock: Clock,
                 start_step: int, print_fn=print, host: str | None = None, hang_wait_s: float = 3.0):
        self.store, self.process, self.processes, self.every = store, process, processes, every
        self.clock, self.print, self.hang_wait_s = clock, print_fn, hang_wait_s
        self.tracker = Stragglers(factor)
        self.hosts: dict[int, str] = {}
        self.read: list[int] = []  # rounds read and kept for the watchdog (the newest two; process 0)
        self.store.set(f"jaxtrain/host/{process}", host or socket.gethostname())
        self.rewind(start_step)

    def rewind(self, step):
        self.step, self.published = step, None
        self.last = (step, self.clock.train_seconds(), self.clock.device_wait_s)
        self.unread: list[int] = []  # rounds published, not yet read (process 0)

    def __call__(self, step, state, metrics, batch):
        self.step = step
        if not self.every or step % self.every:
            return
        last_step, last_wall, last_wait = self.last
        wall, wait = self.clock.train_seconds(), self.clock.device_wait_s
        self.last = (step, wall, wait)
        if step <= last_step:
            return
        n = step - last_step
        self.store.set(f"{self.PREFIX}{step}/{self.process}", f"{(wall - last_wall) / n!r} {(wait - last_wait) / n!r}")
        self.published = step
        if self.process == 0:
            if self.unread:
                self._read(self.unread.pop())
            self.unread.append(step)

    def _round(self, step: int) -> dict[int, tuple[float, float]]:
        return {int(p): tuple(float(x) for x in value.split())
                for p, value in self.store.dir(f"{self.PREFIX}{step}/").items()}

    def _host_names(self) -> dict[int, str]:
        if len(self.hosts) < self.processes:
            self.hosts = {int(p): h for p, h in self.store.dir("jaxtrain/host/").items()}
        return self.hosts

    def _read(self, step: int) -> None:
        for line in self.tracker.add(step, self._round(step), self._host_names()):
            self.print(line)
        self.read = [r for r in self.read if r != step] + [step]  # after a rewind a round may come again
        if len(self.read) > 2:
            self.store.delete(f"{self.PREFIX}{self.read.pop(0)}/")

    def peer_report(self) -> list[str]:
        """Lines for the watchdog's dump (run on its thread while the loop hangs)."""
        self.store.set(f"jaxtrain/hung/{self.process}", str(self.step))
        deadline = time.monotonic() + self.hang_wait_s
        while len(stuck := self.store.dir("jaxtrain/hung/")) < self.processes and time.monotonic() < deadline:
            time.sleep(0.2)
        hosts = self._host_names()
        missing = [p for p in range(self.processes) if str(p) not in stuck]
        if missing:
            named = ", ".join(f"process {p} on {hosts.get(p, '?')}" for p in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            lines = [f"peers: not stuck with this one (no watchdog report within {self.hang_wait_s:g} s), the likely "
                     f"cause: {named}{more}"]
        else:
            lines = [f"peers: all {self.processes} processes are stuck (last steps: "
                     f"{sorted(set(stuck.values()), key=int)})"]
        if self.published is not None and len(reports := self._round(self.published)) > 1:
            own = own_step_times(reports)
            slowest = max(own, key=own.get)
            lines.append(f"peers: the slowest at the last report (step {self.published}): process {slowest} on "
                         f"{hosts.get(slowest, '?')}, step {own[slowest]:.3g}s, "
                         f"{Stragglers.ratios(own)[slowest]:.1f}x the median of the others")
        return lines


class ProfileHook(Hook):
    """A jax.profiler trace of steps first..last (log.profile_steps) into `logdir`, for TensorBoard's profile
    plugin or Perfetto (perfetto_trace.json.gz). Steps run ahead of the host, so the trace starts once the step
    before `first` has finished and stops once `last` has. A run resumed past `first` traces nothing. Then, with
    `hlo_text` (a callable returning the compiled step's HLO), jaxtrain.observe.profiling's table of where the time went:
    summary.txt, and its per-kind lines printed."""

    def __init__(self, first: int, last: int, logdir, *, start_step: int, hlo_text=None, print_fn=print):
        self.first, self.last, self.logdir, self.print_fn = first, last, str(logdir), print_fn
        self.hlo_text = hlo_text
        self.active = False
        if first == start_step + 1:
            self._start()

    def _start(self):
        jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
        self.active = True

    def _stop(self, state):
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.active = False
        self.print_fn(f"profile of steps {self.first}..{self.last} written to {self.logdir}")
        if self.hlo_text is None:
            return
        try:  # a table that cannot be made costs the table, not the run
            summary = profiling.write_summary(self.logdir, self.hlo_text(), self.last - self.first + 1)
        except (OSError, ValueError, KeyError) as e:
            self.print_fn(f"profile summary skipped: {type(e).__name__}: {e}")
            return
        self.print_fn(profiling.format_summary(summary, top=0, kinds=6)
                      + f"\n(all ops: {Path(self.logdir) / profiling.SUMMARY_FILE})")

    def __call__(self, step, state, metrics, batch):
        if step == self.first - 1 and not self.active:
            jax.block_until_ready(state)
            self._start()
        elif step == self.last and self.active:
            self._stop(state)

    def end(self, step, state):
        if self.active:
            self._stop(state)


class FingerprintHook(Hook):
    """Appends {"step", "fingerprint"} of every batch this process trained on to a JSONL file."""

    def __init__(self, path, fingerprint):
        self.file, self.fingerprint = open(path, "a", buffering=1), fingerprint

    def __call__(self, step, state, metrics, batch):
        self.file.write(json.dumps({"step": step, "fingerprint": self.fingerprint(batch)}) + "\n")

    def end(self, step, state):
        self.file.close()


@dataclasses.dataclass
class RunHooks:
    """A run's hooks in the order the loop calls them (`all`), and those the loop and its teardown reach by name.
    `close()` stops the watchdog and the preemption handler (the run's `finally`)."""
    all: list[Hook]
    clock: Clock
    nan_guard: NonFiniteGuard
    eval: EvalHook
    checkpoint: CheckpointHook
    watchdog: faults.Watchdog
    preemption: faults.PreemptionGuard

    def close(self) -> None:
        self.watchdog.stop()
        self.preemption.close()


def build(config, *, workdir: Path, start_step: int, checkpointer, data_iterator, evaluate, writer,
          flops_per_token: float, peak_flops: float, hlo_text=None, progress=None, print_fn=print,
          is_main: bool = True) -> RunHooks:
    """The hooks of a run of `config` in `workdir` resumed at `start_step` (0: fresh): the non-finite guard, the
    progress log, evals (`evaluate(state)`, see EvalHook), checkpoints, preemption, the step watchdog, and where
    configured goodput (process 0), a profile and the data fingerprints. `writer`: the metrics writer
    (jaxtrain.observe.metrics); `hlo_text`: the compiled step's HLO, for the profile's table; `progress`: an
    objective's metrics for the progress line (LogHook)."""
    t = config.train
    watchdog = faults.Watchdog(config.faults.step_timeout_s)
    clock = Clock(on_pause=watchdog.paused)
    recorder = goodput.GoodputRecorder(workdir / "goodput.jsonl") if is_main else None

    def on_checkpoint(step):
        nan_guard.checkpoint_committed()
        if recorder:
            recorder.checkpoint(step)

    nan_guard = NonFiniteGuard(config.faults.nan_policy, print_fn=print_fn)
    log_hook = LogHook(every=config.log.every_steps, total_steps=t.steps, start_step=start_step,
                       tokens_per_step=t.batch_size * t.seq_len, flops_per_token=flops_per_token,
                       peak_flops=peak_flops, writer=writer, clock=clock, print_fn=print_fn, progress=progress)
    eval_hook = EvalHook(every=config.eval.every_steps, total_steps=t.steps, evaluate=evaluate, writer=writer,
                         clock=clock, print_fn=print_fn,
                         # A resumed run's summary keeps the evals before it (from process 0's log).
                         earlier=metrics_lib.earlier_evals(workdir, start_step) if is_main and start_step else ())
    ckpt_hook = CheckpointHook(checkpointer=checkpointer, data_iterator=data_iterator, clock=clock,
                               start_step=start_step, on_write_error=config.checkpoint.on_write_error,
                               print_fn=print_fn, on_commit=on_checkpoint)
    preemption = faults.PreemptionGuard(grace_s=config.faults.preempt_grace_s)
    hooks = [nan_guard, log_hook, eval_hook, ckpt_hook, PreemptionHook(preemption, ckpt_hook, print_fn=print_fn),
             WatchdogHook(watchdog)]
    if recorder:
        hooks.append(GoodputHook(recorder, every=config.log.every_steps, clock=clock, start_step=start_step))
    if profiled := profiling.parse_steps(config.log.profile_steps):
        hooks.append(ProfileHook(*profiled, workdir / "profile", start_step=start_step, print_fn=print_fn,
                                 hlo_text=hlo_text if is_main else None))
    if config.model.n_experts:
        hooks.append(ExpertLoadHook(workdir / "expert_load.jsonl", config.log.every_steps, start_step, is_main))
    if jax.process_count() > 1:
        stragglers = StragglerHook(distributed.KeyValueStore(), process=jax.process_index(),
                                   processes=jax.process_count(), every=config.faults.straggler_every_steps,
                                   factor=config.faults.straggler_factor, clock=clock, start_step=start_step,
                                   print_fn=print_fn)
        hooks.append(stragglers)
        watchdog.peer_report = stragglers.peer_report
    if config.log.fingerprints:
        hooks.append(FingerprintHook(workdir / f"data_fingerprints.{jax.process_index()}.jsonl",
                                     data_pipeline.tokens_per_batch_fingerprint))
    return RunHooks(all=hooks, clock=clock, nan_guard=nan_guard, eval=eval_hook, checkpoint=ckpt_hook,
                    watchdog=watchdog, preemption=preemption)
