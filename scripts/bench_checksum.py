"""The checkpoint checksum (jaxtrain.checkpoint.checksums) against the same sums taken as two jnp.sum calls.

    python scripts/bench_checksum.py [--mb 256] [--repeats 5]

Every save computes it over the whole state, and every restore from a directory tier again. The arrays are
float32 matrices and a bfloat16 embedding, `--mb` MB in all, on one device. Prints each one's median time, the
ratio and a plain uint32 sum of the same words (a lower bound: one pass, no mixing), then one JSON line. Exits 1
if the two checksums differ.
"""

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxtrain import checkpoint

_MB = flags.DEFINE_integer("mb", 256, "State size in MB.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls of each.")


def two_sums(x):
    """The same terms, each sum a jnp.sum of its own."""
    return jnp.stack([jnp.sum(t, dtype=jnp.uint32) for t in checkpoint._terms(x)])


def median_ms(fn, leaves) -> tuple[float, list]:
    out = jax.device_get(fn(leaves))  # compiles
    times = []
    for _ in range(_REPEATS.value):
        t = time.perf_counter()
        jax.block_until_ready(fn(leaves))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, [np.asarray(o).tolist() for o in out]


def main(_):
    key = jax.random.key(0)
    rows = max(1, _MB.value * 2**20 // 4 // 4 // 4096)  # three f32 matrices and a bf16 one of twice the rows
    leaves = [jax.random.normal(jax.random.fold_in(key, i), (rows, 4096)) for i in range(3)]
    leaves.append(jax.random.normal(key, (2 * rows, 4096)).astype(jnp.bfloat16))
    mb = sum(x.nbytes for x in leaves) / 2**20
    ours, got = median_ms(checkpoint._checksum_leaves, leaves)
    ref, want = median_ms(jax.jit(lambda xs: [two_sums(x) for x in xs]), leaves)
    floor, _ = median_ms(jax.jit(lambda xs: [jnp.sum(checkpoint._words(x), dtype=jnp.uint32) for x in xs]), leaves)
    print(f"{mb:.0f} MB: checksums {ours:.1f} ms, as two jnp.sum {ref:.1f} ms ({ref / ours:.1f}x), "
          f"a plain sum of the words {floor:.1f} ms", file=sys.stderr)
    print(json.dumps({"mb": round(mb), "checksum_ms": round(ours, 2), "two_sums_ms": round(ref, 2),
                      "speedup": round(ref / ours, 2), "plain_sum_ms": round(floor, 2), "equal": got == want,
                      "backend": jax.default_backend()}))
    return 0 if got == want else 1


if __name__ == "__main__":
    app.run(main)
