"""Things that happen between steps. The loop calls every hook after every step; each decides itself
whether it has work. Add a feature by adding a hook, not a branch in the loop."""

from __future__ import annotations

import contextlib
import json
import math
import time

import jax
import numpy as np


class Clock:
    """Wall time of the run minus time spent paused (eval, checkpoint writes), for honest tokens/s."""

    def __init__(self):
        self.start = time.perf_counter()
        self.paused_s = 0.0

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - t

    def train_seconds(self) -> float:
        return time.perf_counter() - self.start - self.paused_s


class Hook:
    """`batch` is this process's numpy batch; `metrics` are device arrays (fetching them syncs)."""

    def __call__(self, step: int, state, metrics, batch) -> None: ...
    def end(self, step: int, state) -> None: ...


class NonFiniteLoss(RuntimeError):
    pass


def _duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class LogHook(Hook):
    """Every `every` steps: one progress line and one metrics record. Also stops the run on a non-finite
    loss (the step already refused to apply that update, so no checkpoint ever holds it)."""

    def __init__(self, *, every: int, total_steps: int, start_step: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops: float, writer, clock: Clock, print_fn=print):
        self.every, self.total, self.tokens_per_step = every, total_steps, tokens_per_step
        self.flops_per_token, self.peak = flops_per_token, peak_flops
        self.writer, self.clock, self.print = writer, clock, print_fn
        self.pending = []
        self.last_step, self.last_time = start_step, clock.train_seconds()

    def __call__(self, step, state, metrics, batch):
        self.pending.append(metrics)
        if step % self.every and step != self.total:
            return
        fetched = jax.device_get(self.pending)
        self.pending = []
        bad = [step - len(fetched) + 1 + i for i, m in enumerate(fetched) if not m["finite"]]
        if bad:
            raise NonFiniteLoss(f"non-finite loss or gradient at step {bad[0]} (update skipped); "
                                f"lower optim.lr or check the data")
        now = self.clock.train_seconds()
        steps_done = step - self.last_step
        secs = max(now - self.last_time, 1e-9)
        tok_s = steps_done * self.tokens_per_step / secs
        mfu = tok_s * self.flops_per_token / self.peak
        eta = (self.total - step) * secs / steps_done
        record = {"loss": float(np.mean([m["loss"] for m in fetched])), "lr": float(fetched[-1]["lr"]),
                  "grad_norm": float(fetched[-1]["grad_norm"]), "tokens_per_sec": tok_s, "mfu": mfu,
                  "eta_s": eta}
        self.writer.write_scalars(step, record)
        self.print(f"step {step:>{len(str(self.total))}}/{self.total} | loss {record['loss']:.4f} | "
                   f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | {tok_s:,.0f} tok/s | "
                   f"MFU {100 * mfu:.1f}% | ETA {_duration(eta)}")
        self.last_step, self.last_time = step, now


class EvalHook(Hook):
    """Held-out loss every `every` steps (and at the end); 0 = only at the end."""

    def __init__(self, *, every: int, total_steps: int, evaluate, writer, clock: Clock, print_fn=print):
        self.every, self.total, self.evaluate = every, total_steps, evaluate
        self.writer, self.clock, self.print = writer, clock, print_fn
        self.history: list[tuple[int, float]] = []

    def run(self, step, params):
        with self.clock.paused():
            loss = self.evaluate(params)
        self.history.append((step, loss))
        self.writer.write_scalars(step, {"eval_loss": loss})
        self.print(f"eval @ step {step}: eval_loss {loss:.4f}")

    def __call__(self, step, state, metrics, batch):
        if (self.every and step % self.every == 0) or step == self.total:
            self.run(step, state["params"])


class CheckpointHook(Hook):
    """Saves every `every` steps and where the run ends normally (last step or `train.stop_at`).
    After an error nothing new is saved: the state may be half-donated."""

    def __init__(self, *, every: int, checkpointer, data_iterator, clock: Clock, start_step: int):
        self.every, self.ckpt, self.data, self.clock = every, checkpointer, data_iterator, clock
        self.last_saved = start_step

    def save(self, step, state):
        with self.clock.paused():
            self.ckpt.save(step, state, self.data)
        self.last_saved = step

    def __call__(self, step, state, metrics, batch):
        if step % self.every == 0:
            self.save(step, state)

    def end(self, step, state):
        if step != self.last_saved:
            self.save(step, state)
        with self.clock.paused():
            self.ckpt.wait()


class FingerprintHook(Hook):
    """Appends {"step", "fingerprint"} of every batch this process trained on to a JSONL file."""

    def __init__(self, path, fingerprint):
        self.file, self.fingerprint = open(path, "a", buffering=1), fingerprint

    def __call__(self, step, state, metrics, batch):
        self.file.write(json.dumps({"step": step, "fingerprint": self.fingerprint(batch)}) + "\n")

    def end(self, step, state):
        self.file.close()


