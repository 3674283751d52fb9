"""The run's config: its schema (`base_config`) and its validation (`validate`).

Each component owns its group: its defaults (`CONFIG` in that module) and its checks (`check_config`); an
objective's group comes from its declaration (jaxtrain.objectives). `base_config()` assembles the groups, and
`validate` runs every group's checks once at startup, before anything compiles or touches the workdir, raising
`ConfigError` naming the first bad field. It returns what it resolved (`Resolved`: the mesh, the model config
for the backend, the layout and the objective), which the trainer is built from. Recipes in `configs/` start
from the schema and change values; a key the schema does not have is an error. This module only configures:
it builds no model and reads no file (jaxtrain.memory holds the fit check, jaxtrain.train the input checks).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from jaxtrain import checkpoint, compile_cache, faults, hooks, objectives, optim
from jaxtrain.data import pipeline as data_pipeline
from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.models import config as model_lib
from jaxtrain.models import sampling
from jaxtrain.observe import metrics
from jaxtrain.parallel import distributed, mesh
from jaxtrain.parallel import pipeline as pipeline_parallel


def base_config() -> ml_collections.ConfigDict:
    """Every key a run may set, grouped by component, with its default (defined once, in the component)."""
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    # `steps` sets the schedule's length; `stop_at` (0 = off) ends this invocation early at that step with a
    # checkpoint, e.g. to fit a job's time slot. Rerunning continues the same schedule. `batch_size` is global, in
    # sequences; `microbatches` accumulates gradients (numerically the full-batch step). `objective`: a registered
    # objective (jaxtrain.objectives): "lm" (next-token cross-entropy: pretraining, and SFT on chat data) or "dpo"
    # (preference pairs; the `dpo` group). `compile_cache`: where compiled steps are kept for the next start
    # (jaxtrain.compile_cache: "auto" = beside the workdir, "off", or a directory).
    c.train = dict(steps=150, batch_size=16, seq_len=128, microbatches=1, seed=0, stop_at=0, objective="lm",
                   compile_cache="auto")
    for objective in objectives.registered():  # each objective's own group, if it has one
        if objective.config:
            c[objective.name] = dict(objective.config)
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


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What `validate` resolved from a config, for the run to be built from (jaxtrain.trainer.build_trainer).
    `mesh_shape`, `rules` and `dcn`: the mesh (jaxtrain.parallel.mesh); `data_parallel`: how many ways the batch
    is split; `model`: the ModelConfig with its `auto` dtypes resolved for `backend`; `layout`: how the model
    runs (pipeline, remat, gradient-reduction dtype); `objective`: train.objective's declaration; `reference`:
    whether its state keeps the frozen reference model (objectives.uses_reference)."""
    mesh_shape: dict
    rules: dict
    dcn: dict
    data_parallel: int
    backend: str
    model: model_lib.ModelConfig
    layout: model_lib.Layout
    objective: objectives.Objective
    reference: bool = False


def validate(cfg: ml_collections.ConfigDict, num_devices: int, process_count: int = 1,
             backend: str | None = None) -> Resolved:
    """Checks every field, for a step compiled for `backend` ("cpu", "gpu", "tpu"; default: jax's default
    backend) on `num_devices` devices in `process_count` processes. Returns what it resolved."""
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
    objective = objectives.get(cfg.train.objective)
    model_lib.check_config(cfg.model, seq_len=cfg.train.seq_len, mesh_shape=shape)
    # The pipeline splits the stacked layers; DeepSeek-V3's dense first layers run before it.
    pipeline_parallel.check_config(cfg.pipeline, n_layers=cfg.model.n_layers - cfg.model.first_dense_layers,
                                   microbatch=micro, mesh_shape=shape, rules=rules)
    if cfg.pipeline.stages > 1 and cfg.pipeline.schedule in pipeline_parallel.EXPLICIT:
        # The executor runs the loss per microbatch in the last stage (the model refuses the rest when traced too).
        if cfg.model.n_experts and cfg.model.moe_aux_weight:
            raise ConfigError("model.moe_aux_weight", f"the load-balancing loss needs the whole batch's routing "
                              f"before the first backward of pipeline.schedule={cfg.pipeline.schedule}; set it to 0 "
                              f"(model.moe_bias_rate balances without a loss) or use gpipe or circular")
        if objective.name != "lm":
            raise ConfigError("pipeline.schedule", f"{cfg.pipeline.schedule} trains the lm objective only "
                              f"(train.objective={objective.name} reads every token's log-prob); use gpipe or "
                              f"circular")
    if cfg.model.sliding_window and cfg.model.global_every and cfg.pipeline.stages > 1:
        raise ConfigError("model.global_every", f"sliding and global layers mixed (every {cfg.model.global_every}) "
                          f"do not run in a pipeline yet; set pipeline.stages=1")
    if cfg.model.mtp_layers and cfg.pipeline.stages > 1:
        raise ConfigError("model.mtp_layers", f"{cfg.model.mtp_layers} multi-token prediction modules do not run in "
                          f"a pipeline yet; set pipeline.stages=1 or model.mtp_layers=0")
    if cfg.model.init_adapters and (not cfg.model.init_from or not cfg.model.lora_rank):
        raise ConfigError("model.init_adapters", "PEFT adapters start a LoRA run over their base model: set "
                          "model.init_from to the base's directory and model.lora_rank to the adapters' r")
    if objective.check_config:
        objective.check_config(cfg[objective.name])
    optim.check_config(cfg.optim, total_steps=cfg.train.steps)
    if cfg.optim.grad_reduce_error_feedback:
        _check_error_feedback(cfg, shape, rules)
    data_pipeline.check_config(cfg.data, model_vocab_size=cfg.model.vocab_size)
    hooks.check_eval_config(cfg.eval)
    checkpoint.check_config(cfg.checkpoint)
    faults.check_config(cfg.faults)
    metrics.check_log_config(cfg.log)
    sampling.check_config(cfg.sample)
    backend = backend or jax.default_backend()
    model_lib.check_backend(cfg.model, backend, cfg.train.seq_len, shape["sequence"])
    return resolve(cfg, shape, rules, backend, dcn)


def resolve(cfg: ml_collections.ConfigDict, mesh_shape: dict, rules: dict, backend: str = "cpu",
            dcn: dict | None = None) -> Resolved:
    """What `validate` returns, for `cfg` on the given mesh, without the checks: for a config that passed them
    before (a workdir's), or a test's reference run on another mesh."""
    full_shape = {axis: mesh_shape.get(axis, 1) for axis in mesh.AXES}  # a test's mesh may name some axes only
    return Resolved(mesh_shape=mesh_shape, rules=rules, dcn=dcn or {},
                    data_parallel=mesh.data_parallel_size(full_shape, rules), backend=backend,
                    model=model_config(cfg, backend), layout=layout(cfg), objective=objectives.get(cfg.train.objective),
                    reference=objectives.uses_reference(cfg))


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


def _check_train(t, shape: dict, rules: dict, dp: int, process_count: int) -> int:
    """The `train` group; returns the rows of one gradient-accumulation microbatch."""
    g = Group(t, "train")
    for f in ("steps", "batch_size", "seq_len", "microbatches"):
        g.positive_int(f)
    if t.seq_len % shape["sequence"]:
        raise ConfigError("train.seq_len", f"{t.seq_len} is not divisible by mesh.sequence={shape['sequence']}")
    g.positive_int("seed", allow_zero=True)
    g.positive_int("stop_at", allow_zero=True)
    compile_cache.check(t.compile_cache)
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


# Settings a workdir's checkpoints are tied to: the state's shapes, the data order, and the scale of LoRA's
# adapters (a new alpha would change the function the saved adapters compute, and their export).
RESUME_FIXED = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.head_dim", "model.d_ff", "model.tie_embeddings", "model.param_dtype", "model.n_experts",
                "model.kv_lora_rank", "model.q_lora_rank", "model.qk_nope_head_dim", "model.v_head_dim",
                "model.first_dense_layers", "model.dense_d_ff", "model.n_shared_experts", "model.moe_score_bias",
                "model.mtp_layers",
                "model.lora_rank", "model.lora_targets", "model.lora_alpha",
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
            same = len({model_lib.lora_target_names(v, cfg.model.n_experts, bool(cfg.model.kv_lora_rank))
                        for v in (was, now)}) == 1
        if field == "model.lora_alpha" and not cfg.model.lora_rank:
            same = True  # no adapters: the alpha scales nothing
        if not same:
            raise ConfigError(field, f"is {now!r} but the checkpoints in {workdir} were made with {was!r}; "
                              f"set it back or use a new workdir")


def model_config(cfg: ml_collections.ConfigDict, backend: str) -> model_lib.ModelConfig:
    """The run's ModelConfig, `auto` dtypes resolved for `backend` (models.config.resolve_dtypes)."""
    return model_lib.from_config(cfg.model, backend)


def layout(cfg: ml_collections.ConfigDict) -> model_lib.Layout:
    """How the run lays the model out: the `pipeline` group, model.remat and optim.grad_reduce_dtype."""
    p = cfg.pipeline
    return model_lib.Layout(remat=cfg.model.remat, pipeline_stages=p.stages, pipeline_microbatches=p.microbatches,
                            pipeline_schedule=p.schedule, pipeline_repeats=p.repeats,
                            grad_reduce_dtype=cfg.optim.grad_reduce_dtype)
