"""Metric writers, peak FLOP/s and MFU.

MFU = model FLOPs per second achieved / peak FLOP/s of the devices used. Model FLOPs per token are
`jaxtrain.models.transformer.train_flops_per_token` (6 * N_matmul + causal attention). The peak comes
from a table by device kind; on CPU it is a 4096x4096 f32 matmul measured once and cached, because
"peak" of a CPU depends on the machine. Simulated CPU devices share the same cores, so on CPU the peak
is the machine's, not multiplied by the device count.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak FLOP/s per device (vendor figures).
PEAK_FLOPS = {
    "h100": 989e12, "h200": 989e12, "b200": 2250e12, "a100": 312e12, "l4": 121e12,
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12, "tpu v5": 459e12,
    "tpu v6 lite": 918e12, "tpu v6e": 918e12,
}


class MetricWriter:
    """The interface every writer implements."""

    def write_scalars(self, step: int, scalars: dict) -> None: ...
    def write_hparams(self, hparams: dict) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class JsonlWriter(MetricWriter):
    def __init__(self, path: str | os.PathLike):
        self._file = open(path, "a", buffering=1)

    def write_scalars(self, step, scalars):
        self._file.write(json.dumps({"step": int(step), **{k: _plain(v) for k, v in scalars.items()}}) + "\n")

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


class TensorBoardWriter(MetricWriter):
    def __init__(self, logdir: str | os.PathLike):
        from tensorboardX import SummaryWriter  # imported lazily: only process 0 writes
        self._writer = SummaryWriter(str(logdir))

    def write_scalars(self, step, scalars):
        for k, v in scalars.items():
            if (value := _plain(v)) is not None:
                self._writer.add_scalar(k, value, int(step))

    def write_hparams(self, hparams):
        self._writer.add_text("config", "```\n" + json.dumps(hparams, indent=1, default=str) + "\n```")

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()


class MultiWriter(MetricWriter):
    def __init__(self, writers):
        self.writers = list(writers)

    def write_scalars(self, step, scalars):
        for w in self.writers:
            w.write_scalars(step, scalars)

    def write_hparams(self, hparams):
        for w in self.writers:
            w.write_hparams(hparams)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self):
        for w in self.writers:
            w.close()


def _plain(v):
    """A JSON-safe Python scalar; non-finite floats (e.g. MFU on an unknown device) become None."""
    v = v if isinstance(v, (int, float, str)) else np.asarray(v).item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


# --- Peak FLOP/s -----------------------------------------------------------------------------------

def measure_matmul_flops(n: int = 4096, reps: int = 5, dtype=jnp.float32) -> float:
    """Median FLOP/s of an n x n matmul on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mm(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times))


def _cpu_cache_key() -> str:
    return f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}|jax{jax.__version__}"


def peak_flops(cache_dir: str | os.PathLike | None = None) -> tuple[float, str]:
    """Total peak FLOP/s of the devices this run uses, and where the figure came from."""
    devices = jax.devices()
    kind = devices[0].device_kind.lower()
    if devices[0].platform != "cpu":
        for name, flops in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
            if name in kind:
                return flops * len(devices), f"table:{name}"
        return float("nan"), f"unknown device kind {kind!r}"
    cache = Path(cache_dir or Path.home() / ".cache" / "jaxtrain") / "cpu_peak.json"
    key = _cpu_cache_key()
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return float(cached["flops"]), "measured (cached)"
    except (OSError, ValueError, KeyError):
        pass
    flops = measure_matmul_flops()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "flops": flops}))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return flops, "measured"
