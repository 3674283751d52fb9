"""glibc malloc on CPU runs: keep freed heap memory in the process so XLA:CPU stops page-faulting its buffers in
again on every step (workaround for XLA:CPU freeing a step's buffers to glibc, which unmaps large blocks).

XLA:CPU allocates a step's buffers and frees them after it; with glibc's defaults blocks that large are mmap'd
and unmapped again, so the kernel zero-fills fresh pages every step. `install` stops that for the main
malloc arena and makes jax run CPU computations on the calling thread (an async worker's own arena would mmap
large blocks whatever the settings); the step is faster and the process keeps its high-water mark of memory
(docs/performance.md has the figure). Call it before jax starts its backend. Only for CPU runs, decided without
starting jax: JAX_PLATFORMS / JAX_PLATFORM_NAME if set, else whether a GPU or TPU plugin is installed.
JAXTRAIN_KEEP_FREED_MEMORY=1 forces it, =0 leaves the defaults. The malloc settings need glibc.
It can go when XLA:CPU keeps its own buffer pool between executions (no upstream issue tracks it).
"""

from __future__ import annotations

import ctypes
import os
import pkgutil
import platform
import warnings

ENV = "JAXTRAIN_KEEP_FREED_MEMORY"
# mallopt(3) parameters and values: no mmap'd blocks, no trimming below 2 GiB of free top, and the heap grown
# 64 MiB at a time (with glibc's 128 KiB pad some faults came back every step).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))
ACCELERATOR_MODULES = ("jax_cuda", "jax_rocm", "libtpu")  # name prefixes of jax's GPU/TPU plugin packages

NOT_APPLIED = "not applied"
status = NOT_APPLIED  # what install() did; scripts print it next to their figures


def cpu_run(environ=os.environ, installed=None) -> bool:
    """Whether this process will compute on the CPU: the first of JAX_PLATFORMS (or JAX_PLATFORM_NAME) if set,
    else no GPU/TPU plugin among the `installed` top-level module names (default: what is importable)."""
    platforms = environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME") or ""
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    names = installed if installed is not None else (m.name for m in pkgutil.iter_modules())
    return not any(name.startswith(ACCELERATOR_MODULES) for name in names)


def install(environ=os.environ) -> str:
    """Applies the settings where wanted (see the module doc), once per process; returns and records in `status`
    what it did."""
    global status
    if status == NOT_APPLIED:
        status = _apply(environ)
    return status


def _apply(environ) -> str:
    import jax
    from jax._src import xla_bridge

    wanted = environ.get(ENV, "").strip()
    if wanted not in ("", "0", "1"):
        warnings.warn(f"{ENV}: must be 0 or 1, got {wanted!r}; left the defaults", stacklevel=3)
        return f"defaults ({ENV}={wanted!r} is neither 0 nor 1)"
    if wanted == "0":
        return f"defaults ({ENV}=0)"
    if wanted == "" and not cpu_run(environ):
        return "defaults (accelerator run)"
    if xla_bridge.backends_are_initialized():
        return "defaults (jax had already started; call jaxtrain.compat.install() before the first jax computation)"
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "steps on the calling thread; system malloc defaults (not glibc)"
    libc = ctypes.CDLL("libc.so.6")
    if all(libc.mallopt(param, value) == 1 for param, value in SETTINGS):
        return "kept (glibc main arena: no mmap, no trim; steps on the calling thread)"
    return "steps on the calling thread; glibc malloc defaults (mallopt refused)"
