"""The ring's per-step flash kernels (model.attention_impl=pallas: jaxtrain.models.gpu_flash, or tpu_flash on a
TPU or with --kernel tpu) against its XLA blocks, on one device: ring attention over a mesh of 1, so the one ring
step's block is the whole sequence, forward and backward, on packed documents. Each path runs in --dtype; the
reference is the XLA blocks in f32. Prints each path's median time per forward + backward and a JSON line with
them, their ratio and each path's largest difference from the reference (output and gradients, over the
reference's largest magnitude); exits 1 when the kernels' difference passes --tolerance.

    python scripts/bench_ring_kernel.py                     # a GPU (bash scripts/gpu_bench.sh ring) or a TPU
    python scripts/bench_ring_kernel.py --interpret --dtype float32 --seq_len 256 --heads 4 --kv_heads 2 \\
        --head_dim 16 --window 40 [--kernel tpu]        # a check on CPU (whose dots take no bf16 -> f32)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.models import gpu_flash, tpu_flash  # noqa: E402
from jaxtrain.parallel import context  # noqa: E402
from jaxtrain.parallel import mesh as mesh_lib  # noqa: E402


def packed(batch: int, t: int, mean_doc: int, seed: int):
    """Segment ids and positions [batch, t]: documents of random lengths around `mean_doc`, the last one padding."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((batch, t), np.int32), np.zeros((batch, t), np.int32)
    for row in range(batch):
        at, doc = 0, 1
        while at < t - t // 16:
            n = min(int(rng.integers(mean_doc // 2, mean_doc * 3 // 2 + 1)), t - t // 16 - at)
            seg[row, at:at + n], pos[row, at:at + n] = doc, np.arange(n)
            at, doc = at + n, doc + 1
    return seg, pos


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--mean_doc", type=int, default=0, help="mean document length; 0: seq_len // 4")
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--tolerance", type=float, default=2e-2)
    p.add_argument("--interpret", action="store_true", help="Pallas's interpreter (CPU)")
    p.add_argument("--kernel", choices=("gpu", "tpu"), default="tpu" if jax.default_backend() == "tpu" else "gpu")
    a = p.parse_args(argv)
    mesh = mesh_lib.make_mesh({"sequence": 1}, devices=jax.devices()[:1])
    seg, pos = packed(a.batch, a.seq_len, a.mean_doc or a.seq_len // 4, 0)
    rng = np.random.default_rng(1)
    shapes = [(a.batch, a.seq_len, h, a.head_dim) for h in (a.heads, a.kv_heads, a.kv_heads, a.heads)]
    q, k, v, ct = (rng.normal(size=s).astype(np.float32) for s in shapes)

    def step(kernel, dtype):
        def loss(q, k, v):
            out = context.ring_attention(q, k, v, jnp.asarray(seg), jnp.asarray(pos), mesh=mesh, window=a.window,
                                         kernel=kernel)
            return jnp.sum(out.astype(jnp.float32) * ct), out

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        args = [jnp.asarray(x, dtype) for x in (q, k, v)]
        (_, out), grads = fn(*args)
        times = []
        for _ in range(a.iters):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return [np.asarray(x, np.float32) for x in (out, *grads)], statistics.median(times)

    want, _ = step(None, jnp.float32)
    real = (seg != 0)[:, :, None, None]  # a query that sees no key has an unused output

    def error(got):
        return max(float(np.abs((g - w) * (real if i == 0 else 1)).max() / np.abs(w).max())
                   for i, (g, w) in enumerate(zip(got, want)))

    xla, xla_s = step(None, a.dtype)
    module = {"gpu": gpu_flash, "tpu": tpu_flash}[a.kernel]
    kern, kern_s = step(module.RingKernel(interpret=a.interpret), a.dtype)
    result = {"backend": jax.default_backend(), "kernel": a.kernel, "device": str(jax.devices()[0].device_kind),
              "dtype": a.dtype, "shape": shapes[0], "kv_heads": a.kv_heads, "window": a.window,
              "xla_ms": round(xla_s * 1e3, 2), "pallas_ms": round(kern_s * 1e3, 2), "speedup": round(xla_s / kern_s, 3),
              "xla_error": error(xla), "pallas_error": error(kern)}
    print(f"ring step, forward + backward: XLA blocks {xla_s * 1e3:.2f} ms, pallas kernels {kern_s * 1e3:.2f} ms "
          f"({result['speedup']}x); largest difference from f32: XLA {result['xla_error']:.2e}, pallas "
          f"{result['pallas_error']:.2e}")
    print(json.dumps(result))
    return 0 if result["pallas_error"] <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
