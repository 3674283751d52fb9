"""Workarounds for jaxtrain's dependencies, one module each, installed by entry points only.

Each module says what it works around, the upstream issue where there is one, and when it can go:
- `orbax_noise`: Orbax and tensorstore reports around a damaged checkpoint or a failed save (log filters,
  sys.unraisablehook);
- `orbax_s3`: s3:// checkpoints, and both schemes' retry budget (Orbax's private tensorstore spec helpers, wrapped);
- `glibc_malloc`: XLA:CPU's freed step buffers kept in the process (mallopt, synchronous CPU dispatch);
- `tensorboardx`: tensorboardX imported without torch;
- `tokamax`: absl flags marked parsed, so tokamax does not parse a notebook's or pytest's sys.argv;
- `beam`: Apache Beam's import-time warning about Google Cloud clients;
- `old_paths`: `python -m jaxtrain.<old module>` (installed by jaxtrain/__init__.py in such a process only).
Library modules never import this package: importing jaxtrain or calling a library function changes no
process-wide state. `install()` is what `jaxtrain train` and `train.run` call first; tools call what they need.
"""

from __future__ import annotations

from jaxtrain.compat import beam, glibc_malloc, orbax_noise, orbax_s3, tensorboardx, tokamax

__all__ = ["beam", "glibc_malloc", "install", "orbax_noise", "orbax_s3", "tensorboardx", "tokamax"]


def install() -> None:
    """Every workaround a training run needs, once per process (each is idempotent). The malloc settings apply
    only if jax has not started its backend yet; `glibc_malloc.status` says what they did."""
    glibc_malloc.install()
    orbax_noise.install()
    orbax_s3.install()
    tensorboardx.install()
    tokamax.install()
