"""jax.lax.ragged_dot (dropless MoE's grouped matmul) against one dense matmul with the same FLOPs, in one process.

    python scripts/bench_ragged_dot.py [--rows 8192] [--k 4096] [--n 14336] [--groups 8] [--steps 20]

x [rows, k] times each group's own [k, n] weight, `--groups` equal groups of rows, bf16: the FLOPs of one
[rows, k] @ [k, n] matmul, which is timed beside it. A grouped kernel takes about the dense time; a lowering
that multiplies every row by every group's weight takes about `--groups` times it. Also prints what the
compiled ragged_dot calls. Ends with one JSON line, e.g. {"dense_ms": ..., "ragged_ms": ..., "ratio": ...}
"""

import json
import re
import time

from absl import app, flags

_ROWS = flags.DEFINE_integer("rows", 8192, "rows of x")
_K = flags.DEFINE_integer("k", 4096, "contracted dimension")
_N = flags.DEFINE_integer("n", 14336, "output columns")
_GROUPS = flags.DEFINE_integer("groups", 8, "equal groups (experts)")
_STEPS = flags.DEFINE_integer("steps", 20, "timed calls of each")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    rows, k, n, groups = _ROWS.value, _K.value, _N.value, _GROUPS.value
    key = jax.random.key(0)
    x = jax.random.normal(key, (rows, k), jnp.bfloat16)
    w = jax.random.normal(key, (groups, k, n), jnp.bfloat16)
    sizes = jnp.full((groups,), rows // groups, jnp.int32).at[-1].add(rows % groups)
    dense = jax.jit(lambda x, w: x @ w[0])
    ragged = jax.jit(lambda x, w, sizes: jax.lax.ragged_dot(x, w, sizes))

    def ms(f, *args):
        f(*args).block_until_ready()  # compile and warm
        t0 = time.perf_counter()
        for _ in range(_STEPS.value):
            out = f(*args)
        out.block_until_ready()
        return (time.perf_counter() - t0) / _STEPS.value * 1e3

    dense_ms, ragged_ms = ms(dense, x, w), ms(ragged, x, w, sizes)
    tflops = 2 * rows * k * n / 1e9
    calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', ragged.lower(x, w, sizes).compile().as_text())))
    print(f"{jax.devices()[0].device_kind}: dense {dense_ms:.3f} ms ({tflops / dense_ms:,.2f} TFLOP/s), ragged_dot "
          f"{ragged_ms:.3f} ms ({tflops / ragged_ms:,.2f} TFLOP/s of useful work), {ragged_ms / dense_ms:.2f}x; "
          f"ragged_dot compiles to {calls or 'XLA dots'}")
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows, "k": k, "n": n,
                      "groups": groups, "dense_ms": dense_ms, "ragged_ms": ragged_ms,
                      "ratio": ragged_ms / dense_ms, "custom_calls": calls}))


if __name__ == "__main__":
    app.run(main)
