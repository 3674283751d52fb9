"""The run's config: its schema (`base_config`) and its validation (`validate`).

Each component owns its group: its defaults (`CONFIG` in that module) and its checks (`check_config`).
`base_config()` assembles the groups, and `validate` runs every group's checks once at startup, before
anything compiles or touches the workdir, raising `ConfigError` naming the first bad field. Recipes in
`configs/` start from the schema and change values; a key the schema does not have is an error.
"""

from __future__ import annotations

import jax
import ml_collections

from jaxtrain import checkpoint, faults, hooks, optim
from jaxtrain.data import pipeline as data_pipeline
from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.models import config as model_lib
from jaxtrain.models import dpo, hf, sampling
from jaxtrain.observe import metrics
from jaxtrain.parallel import distributed, mesh
from jaxtrain.parallel import pipeline as pipeline_parallel


def base_config() -> ml_collections.ConfigDict:
    """Every key a run may set, grouped by component, with its default (defined once, in the component)."""
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    # `steps` sets the schedule's length; `stop_at` (0 = off) ends this invocation early at that step with a
    # checkpoint, e.g. to fit a job's time slot. Rerunning continues the same schedule. `batch_size` is global, in
    # sequences; `microbatches` accumulates gradients (numerically the full-batch step). `objective`: "lm" (next-token
    # cross-entropy: pretraining, and SFT on chat data) or "dpo" (preference pairs; the `dpo` group).
    c.train = dict(steps=150, batch_size=16, seq_len=128, microbatches=1, seed=0, stop_at=0, objective="lm")
    c.dpo = dict(dpo.CONFIG)
    c.mesh = dict(mesh.CONFIG)
    c.model = model_lib.config_defaults()
    c.pipeline = dict(pipeline_parallel.CONFIG)
    c.optim = dict(optim.CONFIG)
    c.data = dict(data_pipeline.CONFIG)
    c.eval = dict(hooks.EVAL_CONFIG)
    c.checkpoint = dict(checkpoint.CONFIG)
    c.faults = dict(faults.CONFIG)
    c.distributed = dict(distributed.CONFIG)
    c.log = dict(metrics.LOG_CONFIG)
    c.sample = dict(sampling.CONFIG)
    return c


def _unknown_keys(cfg, schema, prefix="") -> list[str]:
    out = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            out.append(path)
        elif isinstance(schema[key], ml_collections.ConfigDict):
            out += _unknown_keys(cfg[key], schema[key], path + ".")
    return out


def validate(cfg: ml_collections.ConfigDict, num_devices: int, process_count: int = 1) -> dict:
    """Checks every field. Returns derived facts the run needs: the resolved mesh shape and rules."""
    unknown = _unknown_keys(cfg, base_config())
    if unknown:
        raise ConfigError(unknown[0], "unknown key (not in jaxtrain.config.base_config)")
    if not isinstance(cfg.workdir, str) or not cfg.workdir.strip():
        raise ConfigError("workdir", "must be a non-empty path")
    if "://" in cfg.workdir:  # its logs, locks and config are local files
        raise ConfigError("workdir", f"{cfg.workdir}: must be a local path (put the checkpoints in a bucket with "
                          f"checkpoint.dir=gs://... or s3://...)")

    shape, rules, dcn = mesh.check_config(cfg.mesh, num_devices)
    dp = mesh.data_parallel_size(shape, rules)
    micro = _check_train(cfg.train, shape, rules, dp, process_count)
    model_lib.check_config(cfg.model, seq_len=cfg.train.seq_len, mesh_shape=shape)
    pipeline_parallel.check_config(cfg.pipeline, n_layers=cfg.model.n_layers, microbatch=micro, mesh_shape=shape,
                                   rules=rules)
    if cfg.model.sliding_window and cfg.model.global_every and cfg.pipeline.stages > 1:
        raise ConfigError("model.global_every", f"sliding and global layers mixed (every {cfg.model.global_every}) "
                          f"do not run in a pipeline yet; set pipeline.stages=1")
    if cfg.model.init_from:  # the checkpoint's config.json only: its weights are read at init, after compiling
        hf.check_init_from(cfg.model.init_from, model_config(cfg, "cpu"))
    if cfg.model.init_adapters:
        if not cfg.model.init_from or not cfg.model.lora_rank:
            raise ConfigError("model.init_adapters", "PEFT adapters start a LoRA run over their base model: set "
                              "model.init_from to the base's directory and model.lora_rank to the adapters' r")
        hf.check_init_adapters(cfg.model.init_adapters, model_config(cfg, "cpu"))
    dpo.check_config(cfg.dpo)
    optim.check_config(cfg.optim, total_steps=cfg.train.steps)
    if cfg.optim.grad_reduce_error_feedback:
        _check_error_feedback(cfg, shape, rules)
    if cfg.optim.groups:
        optim.check_groups(cfg.optim.groups, param_paths(model_config(cfg, "cpu")))
    data_pipeline.check_config(cfg.data, model_vocab_size=cfg.model.vocab_size)
    hooks.check_eval_config(cfg.eval)
    checkpoint.check_config(cfg.checkpoint)
    faults.check_config(cfg.faults)
    metrics.check_log_config(cfg.log)
    sampling.check_config(cfg.sample)
    return {"mesh_shape": shape, "rules": rules, "data_parallel": dp, "dcn": dcn}


def _check_error_feedback(cfg: ml_collections.ConfigDict, shape: dict, rules: dict) -> None:
    """optim.grad_reduce_error_feedback keeps a residual per data-parallel replica (jaxtrain.step): it needs
    replicas, and a step that sums their gradients once (not a pipeline's or a mixture of experts')."""
    why = ("needs data-parallel replicas (a mesh axis that splits the batch and no parameter, e.g. mesh.data > 1): "
           "the reduce-scatter over fsdp keeps no residual" if not mesh.replica_axes(shape, rules) else
           "does not run with pipeline.stages > 1 yet" if cfg.pipeline.stages > 1 else
           "does not run with model.n_experts yet (the load-balancing loss needs the batch-wide sums)"
           if cfg.model.n_experts else None)
    if why:
        raise ConfigError("optim.grad_reduce_error_feedback", why)


def param_paths(model_cfg) -> list[str]:
    """Every parameter's path as optim.groups matches it, from the model's shapes alone (nothing allocated)."""
    from flax import nnx  # noqa: PLC0415 - flax only where the model is needed
    from jaxtrain.models import transformer  # noqa: PLC0415

    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: transformer.build(model_cfg, 0))))
    return [optim.param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(abstract)]


OBJECTIVES = ("lm", "dpo")


def _check_train(t, shape: dict, rules: dict, dp: int, process_count: int) -> int:
    """The `train` group; returns the rows of one gradient-accumulation microbatch."""
    g = Group(t, "train")
    for f in ("steps", "batch_size", "seq_len", "microbatches"):
        g.positive_int(f)
    if t.seq_len % shape["sequence"]:
        raise ConfigError("train.seq_len", f"{t.seq_len} is not divisible by mesh.sequence={shape['sequence']}")
    g.positive_int("seed", allow_zero=True)
    g.positive_int("stop_at", allow_zero=True)
    if t.objective not in OBJECTIVES:
        raise ConfigError("train.objective", f"{t.objective!r} is not one of {', '.join(OBJECTIVES)}")
    if t.batch_size % t.microbatches:
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by train.microbatches={t.microbatches}")
    micro = t.batch_size // t.microbatches
    if micro % dp:
        raise ConfigError("train.batch_size", f"microbatch of {micro} sequences is not divisible by the "
                          f"data-parallel size {dp} (mesh axes {rules.get('batch')})")
    if t.batch_size % process_count:
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by the {process_count} processes")
    return micro


def validate_distributed(cfg: ml_collections.ConfigDict) -> None:
    """The `distributed` group, checked before jax.distributed starts (so before the other groups)."""
    distributed.check_config(cfg.distributed)


# Settings a workdir's checkpoints are tied to: the state's shapes and the data order.
RESUME_FIXED = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.head_dim", "model.d_ff", "model.tie_embeddings", "model.param_dtype", "model.n_experts",
                "model.lora_rank", "model.lora_targets",
                "optim.name", "optim.moments_dtype", "train.seed", "train.objective", "data.corpus", "data.vocab_size",
                "data.heldout_docs")


def check_resumable(saved: dict, cfg: ml_collections.ConfigDict, workdir: str) -> None:
    """Raises ConfigError naming the first RESUME_FIXED field that differs from the workdir's saved config."""
    for field in RESUME_FIXED:
        group, key = field.split(".")
        # A key older workdirs did not save has its schema default.
        was, now = saved.get(group, {}).get(key, base_config()[group][key]), cfg[group][key]
        same = was == now
        if field == "model.lora_targets":  # the same adapters, however named ("all", or listed)
            same = len({model_lib.lora_target_names(v, cfg.model.n_experts) for v in (was, now)}) == 1
        if not same:
            raise ConfigError(field, f"is {now!r} but the checkpoints in {workdir} were made with {was!r}; "
                              f"set it back or use a new workdir")


def step_bytes_floor(cfg: ml_collections.ConfigDict, num_devices: int) -> float:
    """A floor under one step's bytes per device, however the mesh splits it: params and gradients in f32 and
    AdamW's two moments (the matmul params only, every expert of a mixture; none for another optimizer or a
    state offloaded to the host; under LoRA the frozen weights alone; DPO's reference copy without LoRA), plus, as
    under full remat, one bf16 residual per layer and token of a microbatch, all spread evenly over every device.
    Any real step needs more; `jaxtrain plan` gives its figure."""
    m = model_lib.from_config(cfg.model, cfg.pipeline, "cpu")
    from jaxtrain.models import transformer  # noqa: PLC0415 - imports flax; the arithmetic is all here

    tokens = cfg.train.batch_size // cfg.train.microbatches * cfg.train.seq_len
    o = cfg.optim
    moments = 0 if o.offload or o.name != "adamw" else 2 * (2 if o.moments_dtype == "bfloat16" else 4)
    per_param = 4 if m.lora_rank else 8 + moments + (4 if cfg.train.objective == "dpo" else 0)
    return (per_param * transformer.matmul_params(m, stored=True) + 2 * tokens * m.n_layers * m.d_model) / num_devices


def check_fits(cfg: ml_collections.ConfigDict, num_devices: int, device_bytes: float | None) -> None:
    """ConfigError when `step_bytes_floor` exceeds a device's memory: sizes such as train.seq_len=10**9 are
    refused before anything is allocated (or the workdir created) instead of exhausting the machine."""
    floor = step_bytes_floor(cfg, num_devices)
    if device_bytes and floor > device_bytes:
        gib, t = 2**30, cfg.train
        raise ConfigError("train.seq_len" if t.seq_len > t.batch_size else "train.batch_size",
                          f"train.batch_size {t.batch_size} x train.seq_len {t.seq_len} with this model needs at least {floor / gib:,.1f} GiB per device for one step, over the "
                          f"{device_bytes / gib:,.1f} GiB each of the {num_devices} devices has; use smaller "
                          f"batches or sequences (or train.microbatches), or more devices")


def check_backend(cfg: ml_collections.ConfigDict, backend: str) -> None:
    """ConfigError for settings the backend the step compiles for ("cpu", "gpu", "tpu") cannot run."""
    model_lib.check_backend(cfg.model, backend)


def model_config(cfg: ml_collections.ConfigDict, backend: str) -> model_lib.ModelConfig:
    """The run's ModelConfig, `auto` dtypes resolved for `backend` (models.config.resolve_dtypes)."""
    return model_lib.from_config(cfg.model, cfg.pipeline, backend, cfg.optim.grad_reduce_dtype)
