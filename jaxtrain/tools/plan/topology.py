"""NVIDIA GPUs described to XLA without one attached, for ahead-of-time compiles on any host (`jaxtrain plan
--compiler gpu`).

XLA:GPU compiles for a device it is told about: the CUDA PJRT plugin takes a target description (SM count, shared
memory, L2, bandwidth, compute capability) and a topology (slices x hosts x GPUs per host) and returns device
objects that `jax.jit(...).lower(...).compile()` accepts, with no driver and no GPU. The compiled program is the
one a real GPU would run except for autotuning (GEMM and fusion configs are picked by heuristics): its buffer
assignment (`memory_analysis()`), fusions, collectives and scheduling are XLA:GPU's own.

It needs the plugin, not CUDA itself (no nvidia-* wheels): `pip install "jax-cuda12-plugin==$(python -c 'import
jaxlib; print(jaxlib.__version__)')"`. On a host without a driver jax's CUDA version check must be skipped
(JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1, which `jaxtrain plan` sets) or the CPU chosen (JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

GPUS_PER_HOST = 8  # an HGX/DGX node

# Public datasheet figures, SXM parts; `memory` is what the driver reports (nvidia-smi's MiB).
_HOPPER = dict(core_count=132, l2_cache_size=50 * 2**20, clock_rate_ghz=1.98, shared_memory_per_core=228 * 1024,
               shared_memory_per_block_optin=227 * 1024, capability=(9, 0))
SPECS = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", memory=81_559 * 2**20, memory_bandwidth=3.35e12),
    "h200": dict(_HOPPER, name="NVIDIA H200", memory=143_771 * 2**20, memory_bandwidth=4.8e12),
}


BUNDLED = Path(sys.prefix) / "cuda-plugin"  # where `make test` installs it, away from every other jax process


def available() -> bool:
    """Whether the CUDA PJRT plugin is importable (it is what compiles for a described GPU)."""
    try:
        return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def use_bundled() -> bool:
    """Makes the plugin in BUNDLED importable when no other is; call before jax starts its backends. True when
    a plugin is available. Only CPU devices run here then: the plugin only compiles for described GPUs."""
    if not available() and (BUNDLED / "jax_plugins").is_dir():
        sys.path.insert(0, str(BUNDLED))
        importlib.invalidate_caches()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return available()


def spec_for(device_kind: str | None) -> tuple[str, dict]:
    """(key, spec) of a device kind such as "H100", "NVIDIA H200" (longest key contained, case-insensitive)."""
    kind = (device_kind or "H100").lower()
    for key in sorted(SPECS, key=len, reverse=True):
        if key in kind:
            return key, SPECS[key]
    raise ValueError(f"no GPU description for {device_kind!r}; described: {', '.join(sorted(SPECS))}")


def target_config(device_kind: str | None) -> str:
    """The plugin's target description (xla.GpuTargetConfigProto, text format) of one GPU of this kind."""
    _, s = spec_for(device_kind)
    major, minor = s["capability"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {s['shared_memory_per_core']}
  threads_per_core_limit: 2048
  core_count: {s['core_count']}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(s['memory_bandwidth'])}
  l2_cache_size: {s['l2_cache_size']}
  clock_rate_ghz: {s['clock_rate_ghz']}
  device_memory_size: {s['memory']}
  shared_memory_per_block_optin: {s['shared_memory_per_block_optin']}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{s['name']}"
"""


def topology_name(num_devices: int) -> str:
    """"slices x hosts x GPUs per host": one host up to GPUS_PER_HOST, whole hosts beyond."""
    if num_devices <= GPUS_PER_HOST:
        return f"1x1x{num_devices}"
    if num_devices % GPUS_PER_HOST:
        raise ValueError(f"{num_devices} GPUs do not fill hosts of {GPUS_PER_HOST}")
    return f"1x{num_devices // GPUS_PER_HOST}x{GPUS_PER_HOST}"


def devices(device_kind: str | None, num_devices: int) -> list:
    """`num_devices` described GPUs of this kind (jax device objects, in topology order) to compile for."""
    if not available():
        raise ModuleNotFoundError(
            "gpu needs the CUDA PJRT plugin: pip install \"jax-cuda12-plugin==$(python -c 'import jaxlib; "
            f"print(jaxlib.__version__)')\" (no GPU or CUDA needed), or `make test`, which puts it in {BUNDLED}")
    from jax.experimental import topologies  # noqa: PLC0415

    # The CUDA plugin reads the shape from its "topology" option (topology_name is the TPU's).
    topology = topologies.get_topology_desc(platform="cuda", topology=topology_name(num_devices),
                                            target_config=target_config(device_kind))
    return list(topology.devices)
