"""Host memory: glibc malloc settings that stop XLA:CPU from page-faulting its buffers in again on every step.

XLA:CPU allocates a step's outputs and temporaries with posix_memalign and frees them when the step ends. With
glibc's defaults blocks that large come from mmap, or from per-thread arenas that are trimmed with madvise, so the
kernel takes the pages back on free and zero-fills fresh ones on the next step: on configs/bench_cpu.py ~150,000
minor page faults and ~0.35 s of system CPU time per 1.4 s step. One arena that neither unmaps nor trims keeps those
pages: the faults stop after the first steps and the step is ~12% faster (BUILD.md, performance). The price is that
the process keeps its high-water mark of host memory (1.4 -> 1.95 GiB resident on bench_cpu; the step touches
that much anyway).

`jaxtrain/__init__.py` applies it on import, because the arena limit only binds threads that have not allocated
yet: import jaxtrain before running any jax computation. Applied only to CPU runs (an accelerator run's host
buffers are checkpoint staging and input batches, which should go back to the OS), decided without starting jax:
JAX_PLATFORMS / JAX_PLATFORM_NAME if set (the first platform listed), else whether a GPU or TPU plugin is
installed. JAXTRAIN_KEEP_FREED_MEMORY=1 forces it, =0 leaves glibc's defaults. Only glibc has these knobs;
elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import pkgutil
import platform
import warnings

ENV = "JAXTRAIN_KEEP_FREED_MEMORY"
# mallopt(3) parameters and the values set: one arena, no mmap'd blocks, no trimming below 2 GiB of free top,
# and the heap grown 64 MiB at a time (with glibc's 128 KiB pad the faults came back every step).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX, M_ARENA_MAX = -1, -2, -4, -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, 64 << 20))
ACCELERATOR_MODULES = ("jax_cuda", "jax_rocm", "libtpu")  # name prefixes of jax's GPU/TPU plugin packages

status = "not applied"  # what keep_freed_memory() did; scripts print it next to their figures


def cpu_run(environ=os.environ, installed=None) -> bool:
    """Whether this process will compute on the CPU: the first of JAX_PLATFORMS (or JAX_PLATFORM_NAME) if set,
    else no GPU/TPU plugin among the `installed` top-level module names (default: what is importable)."""
    platforms = environ.get("JAX_PLATFORMS") or environ.get("JAX_PLATFORM_NAME") or ""
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    names = installed if installed is not None else (m.name for m in pkgutil.iter_modules())
    return not any(name.startswith(ACCELERATOR_MODULES) for name in names)


def keep_freed_memory(environ=os.environ) -> str:
    """Applies SETTINGS where wanted (see the module doc); returns and records in `status` what it did."""
    global status
    wanted = environ.get(ENV, "").strip()
    if wanted not in ("", "0", "1"):
        status = f"glibc defaults ({ENV}={wanted!r} is neither 0 nor 1)"
        warnings.warn(f"{ENV}: must be 0 or 1, got {wanted!r}; left glibc's malloc defaults", stacklevel=2)
    elif wanted == "0":
        status = f"glibc defaults ({ENV}=0)"
    elif wanted == "" and not cpu_run(environ):
        status = "glibc defaults (accelerator run)"
    elif platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        status = "system defaults (not glibc)"
    else:
        libc = ctypes.CDLL("libc.so.6")
        ok = all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
        status = "kept (glibc: 1 arena, no mmap, no trim)" if ok else "glibc defaults (mallopt refused)"
    return status
