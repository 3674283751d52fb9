"""Whether a step can fit: a floor under its bytes per device, and what a device holds.

`check_fits` refuses sizes such as train.seq_len=10**9 before anything is allocated or the workdir is created,
instead of exhausting the machine. The floor is deliberately low (any real step needs more); `jaxtrain plan`
compiles the step and gives its real figure. The run and the planner both call it.
"""

from __future__ import annotations

import os

import ml_collections

from jaxtrain import config as config_lib
from jaxtrain import objectives
from jaxtrain.errors import ConfigError
from jaxtrain.models import transformer


def step_bytes_floor(cfg: ml_collections.ConfigDict, num_devices: int) -> float:
    """A floor under one step's bytes per device, however the mesh splits it: params and gradients in f32 and
    AdamW's two moments (the matmul params only, every expert of a mixture; none for another optimizer or a
    state offloaded to the host; under LoRA the frozen weights alone), the objective's own bytes per parameter
    (objectives.Objective.extra_bytes_per_param, when every parameter trains), plus, as under full remat, one
    bf16 residual per layer and token of a microbatch, all spread evenly over every device."""
    model = config_lib.model_config(cfg, "cpu")  # the parameter count, whatever the dtypes
    objective = objectives.get(cfg.train.objective)
    tokens = cfg.train.batch_size // cfg.train.microbatches * cfg.train.seq_len
    o = cfg.optim
    moments = 0 if o.offload or o.name != "adamw" else 2 * (2 if o.moments_dtype == "bfloat16" else 4)
    per_param = 4 if model.lora_rank else 8 + moments + objective.extra_bytes_per_param
    return (per_param * transformer.matmul_params(model, stored=True) + 2 * tokens * model.n_layers
            * model.d_model) / num_devices


def check_fits(cfg: ml_collections.ConfigDict, num_devices: int, device_bytes: float | None) -> None:
    """ConfigError naming train.seq_len or train.batch_size when `step_bytes_floor` exceeds a device's memory."""
    floor = step_bytes_floor(cfg, num_devices)
    if device_bytes and floor > device_bytes:
        gib, t = 2**30, cfg.train
        raise ConfigError("train.seq_len" if t.seq_len > t.batch_size else "train.batch_size",
                          f"train.batch_size {t.batch_size} x train.seq_len {t.seq_len} with this model needs at "
                          f"least {floor / gib:,.1f} GiB per device for one step, over the {device_bytes / gib:,.1f} "
                          f"GiB each of the {num_devices} devices has; use smaller batches or sequences (or "
                          f"train.microbatches), or more devices")


def device_bytes(devices) -> float | None:
    """Memory one of these (local) devices can hold: an accelerator's own limit, or for CPU devices the host's
    physical memory shared among them; None if unknown."""
    device = devices[0]
    if device.platform != "cpu":
        try:
            return float((device.memory_stats() or {}).get("bytes_limit") or 0) or None
        except Exception:  # noqa: BLE001 - a backend without memory stats
            return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total / sum(d.platform == "cpu" for d in devices)
