"""Config schema, defaults and validation.

`base_config()` is the full schema: every key a run may set, grouped by component. Recipes in
`configs/` start from it and change values; a key the schema does not have is an error. `validate`
runs once at startup, before anything compiles or touches the workdir, and raises `ConfigError`
naming the first bad field.
"""

from __future__ import annotations

import math

import ml_collections

from jaxtrain import mesh as mesh_lib
from jaxtrain.models.transformer import ATTENTION_IMPLS, REMAT_POLICIES, ModelConfig

SCHEDULES = ("cosine", "linear", "wsd", "constant")
DTYPES = ("auto", "float32", "bfloat16", "float16")
NAN_POLICIES = ("halt", "skip", "rollback")
WRITE_ERROR_POLICIES = ("stop", "continue")


class ConfigError(ValueError):
    """A bad config value. `str()` is the one line shown to the user: '<field>: <reason>'."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"

    # `steps` sets the schedule's length; `stop_at` (0 = off) ends this invocation early at that step
    # with a checkpoint, e.g. to fit a job's time slot. Rerunning continues the same schedule.
    c.train = dict(steps=150, batch_size=16, seq_len=128, microbatches=1, seed=0, stop_at=0)

    # -1 = all remaining devices. `rules` is a preset name (jaxtrain.mesh.PRESETS) or an explicit
    # table such as "batch=data+fsdp,embed=fsdp,mlp=tensor" (unlisted logical axes are replicated).
    # `pipeline` devices hold pipeline stages, `expert` ones MoE experts, `sequence` ones slices of the sequence.
    # `dcn_<axis>` (hybrid meshes: TPU multislice, GPU multi-node): how many of that axis's ways cross the
    # slow network between slices / nodes; see jaxtrain/mesh.py for which axes belong there.
    c.mesh = dict(data=-1, pipeline=1, fsdp=1, expert=1, sequence=1, tensor=1, rules="dp_fsdp_tp",
                  dcn_data=1, dcn_pipeline=1, dcn_fsdp=1, dcn_expert=1, dcn_sequence=1, dcn_tensor=1)

    # `init_from` (optional): a Hugging Face Llama directory whose weights replace the random init of a fresh
    # run (a resumed run takes its checkpoint); its architecture must equal these fields, and its tokenizer,
    # if it ships one, data.dir's. `python -m jaxtrain.hf overrides DIR` prints the flags that make it so.
    # How the step runs, not what the model is (checkpoints do not depend on them): `loss_chunk_tokens` fuses the
    # output projection with the loss, about that many tokens per device at a time, so [B, T, vocab] logits never
    # exist (0 = plain logits); `scan_unroll` layers per iteration of the layer loop (n_layers = no loop: faster
    # steps, compile time grows with depth); `attention_block` > 0 runs causal attention written out (einsums and a
    # softmax) in query blocks of that many positions and skips the blocks above the diagonal (0 = the library call);
    # `attention_impl` is that call's kernel: "xla" (any backend) or "cudnn" (GPU, bf16/fp16 compute, block 0).
    c.model = dict(vocab_size=8192, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=768,
                   tie_embeddings=True, remat="none", dtype="auto", param_dtype="auto",
                   rope_theta=10000.0, norm_eps=1e-5, init_std=0.02, init_from="",
                   n_experts=0, moe_top_k=2, moe_capacity_factor=1.25, moe_aux_weight=0.01, moe_group_tokens=0,
                   loss_chunk_tokens=512, scan_unroll=1, attention_block=0, attention_impl="xla")

    # Pipeline parallelism (jaxtrain/pipeline_parallel.py): `stages` (1 = off) splits the layers into that many
    # stages over the mesh's `pipeline` axis (which must divide it); each batch (or gradient-accumulation
    # microbatch) runs as `microbatches` pipeline microbatches. Schedules: "gpipe", or "circular" where each
    # stage holds `repeats` chunks of layers and a microbatch goes round the stages `repeats` times (a smaller
    # bubble: (stages-1) / (repeats*microbatches + stages-1)).
    c.pipeline = dict(stages=1, microbatches=1, schedule="gpipe", repeats=1)

    c.optim = dict(lr=3e-3, warmup_steps=15, schedule="cosine", min_lr_ratio=0.1, decay_fraction=0.2,
                   weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8)

    # `dir` empty = ~/.cache/jaxtrain/data/<corpus>_v<vocab_size>. `vocab_size` is the tokenizer's;
    # it may be smaller than model.vocab_size (padding rows for better matmul shapes).
    # `mixture` (optional): train on several prepared dirs with weights, "dirA:0.7,dirB:0.3", all tokenized
    # with `dir`'s tokenizer; `dir` still supplies the tokenizer and the held-out split.
    # `num_workers` > 0: build train batches in that many Grain worker processes (the same batches); 0 = one
    # prefetch thread in the trainer, which is faster on a few CPU cores.
    c.data = dict(corpus="kjv", dir="", vocab_size=8192, heldout_docs=200, mixture="", num_workers=0)

    # `sets` (optional): more validation sets, "name=DIR,name2=DIR2", each the held-out split of a prepared
    # dir tokenized with `data.dir`'s tokenizer, reported as eval_loss/<name>; eval_loss stays data.dir's.
    c.eval = dict(every_steps=50, batches=4, at_start=True, sets="")

    # Saves every `every_steps` and every `every_minutes` (0 = off); keeps the latest `keep` plus every
    # `keep_period`-th step (0 = none). `local_dir` (optional) is a faster disk saved every
    # `local_every_steps`; restore takes the newest verified copy in either. `on_write_error`: "stop"
    # (exit 4) or "continue" (warn; the next save tries again). A good checkpoint is never deleted.
    c.checkpoint = dict(every_steps=50, every_minutes=0.0, keep=3, keep_period=0, local_dir="",
                        local_every_steps=0, local_keep=2, on_write_error="stop")

    # `nan_policy` for a non-finite loss or gradient (the update is never applied): "halt" (exit 3),
    # "skip" (drop that step's update and go on) or "rollback" (restore the last checkpoint and skip
    # the data since). `step_timeout_s`: a step (or a peer) stuck this long dumps all stacks and exits
    # 124 (0 = off). `preempt_grace_s`: the time SIGTERM leaves us to save; we warn if a save took longer.
    c.faults = dict(nan_policy="halt", step_timeout_s=600.0, preempt_grace_s=30.0)

    # Multi-host (jaxtrain.distributed): empty/0/-1 = from JAXTRAIN_* env vars, or auto-detected on
    # Cloud TPU, SLURM and Kubernetes when `auto`; a single process needs nothing.
    c.distributed = dict(coordinator="", num_processes=0, process_id=-1, auto=True, timeout_s=300)

    # `fingerprints`: also append each step's batch hash to WORKDIR/data_fingerprints.<process>.jsonl,
    # an audit trail that proves a resumed run saw exactly the batches an uninterrupted one would.
    # `trackers`: also log to "mlflow" and/or "wandb" (comma-separated; optional extras). The MLflow/W&B run is
    # named `run_name` (default: the workdir's name) in experiment/project `experiment`. `mlflow_uri` empty =
    # $MLFLOW_TRACKING_URI or sqlite:///WORKDIR/mlflow.db. `wandb_mode`: offline (WORKDIR/wandb, `wandb sync`
    # later), online or disabled; `wandb_api_key` empty = W&B's own login ($WANDB_API_KEY), and is redacted.
    # `profile_steps`: "FIRST,LAST" (or one step) to trace with jax.profiler into WORKDIR/profile.
    c.log = dict(every_steps=10, fingerprints=False, trackers="", experiment="jaxtrain", run_name="",
                 mlflow_uri="", wandb_mode="offline", wandb_entity="", wandb_api_key="", profile_steps="")

    c.sample = dict(prompt="And God said", max_new_tokens=40, temperature=0.8, top_k=40)
    return c


# --- Validation ------------------------------------------------------------------------------------

def _unknown_keys(cfg, schema, prefix="") -> list[str]:
    out = []
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in schema:
            out.append(path)
        elif isinstance(schema[key], ml_collections.ConfigDict):
            out += _unknown_keys(cfg[key], schema[key], path + ".")
    return out


def _positive_int(cfg, field: str, allow_zero=False):
    value = cfg
    for part in field.split("."):
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ConfigError(field, f"must be a {'non-negative' if allow_zero else 'positive'} integer, got {value!r}")
    return value


def _choice(cfg, field: str, choices):
    group, key = field.split(".")
    if cfg[group][key] not in choices:
        raise ConfigError(field, f"unknown value {cfg[group][key]!r}; choose one of {list(choices)}")


def _number(value, field, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ConfigError(field, f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ConfigError(field, f"must be <= {hi}, got {value!r}")


def validate(cfg: ml_collections.ConfigDict, num_devices: int, process_count: int = 1) -> dict:
    """Checks every field. Returns derived facts the run needs: the resolved mesh shape and rules."""
    unknown = _unknown_keys(cfg, base_config())
    if unknown:
        raise ConfigError(unknown[0], "unknown key (not in jaxtrain.config.base_config)")

    if not isinstance(cfg.workdir, str) or not cfg.workdir.strip():
        raise ConfigError("workdir", "must be a non-empty path")

    # Mesh and rules.
    try:
        shape = mesh_lib.resolve_shape(cfg.mesh, num_devices)
        rules = mesh_lib.resolve_rules(cfg.mesh.rules)
        dcn = mesh_lib.resolve_dcn(cfg.mesh, shape)
    except (ValueError, TypeError) as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field if field.startswith("mesh") else "mesh", reason or str(e)) from None
    unused = mesh_lib.unused_axes(shape, rules)
    if unused:
        raise ConfigError(f"mesh.{unused[0]}", f"size {shape[unused[0]]} but mesh.rules={cfg.mesh.rules!r} "
                          f"maps nothing to {unused[0]!r}; use a preset that does (e.g. 'dp_fsdp_tp')")

    # Train.
    for f in ("steps", "batch_size", "seq_len", "microbatches"):
        _positive_int(cfg, f"train.{f}")
    if cfg.train.seq_len % shape["sequence"]:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} is not divisible by mesh.sequence={shape['sequence']}")
    _positive_int(cfg, "train.seed", allow_zero=True)
    _positive_int(cfg, "train.stop_at", allow_zero=True)
    t = cfg.train
    dp = mesh_lib.data_parallel_size(shape, rules)
    if t.batch_size % t.microbatches:
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by train.microbatches={t.microbatches}")
    micro = t.batch_size // t.microbatches
    if micro % dp:
        raise ConfigError("train.batch_size", f"microbatch of {micro} sequences is not divisible by the "
                          f"data-parallel size {dp} (mesh axes {rules.get('batch')})")
    if t.batch_size % process_count:
        raise ConfigError("train.batch_size", f"{t.batch_size} is not divisible by the {process_count} processes")

    # Model.
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
        _positive_int(cfg, f"model.{f}")
    m = cfg.model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
    if m.head_dim % 2:
        raise ConfigError("model.head_dim", f"must be even for RoPE, got {m.head_dim}")
    if m.remat not in REMAT_POLICIES:
        raise ConfigError("model.remat", f"unknown policy {m.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
    for f in ("dtype", "param_dtype"):
        if m[f] not in DTYPES:
            raise ConfigError(f"model.{f}", f"unknown dtype {m[f]!r}; choose one of {list(DTYPES)}")
    _number(m.rope_theta, "model.rope_theta", lo=0, lo_open=True)
    _number(m.norm_eps, "model.norm_eps", lo=0, lo_open=True)
    _number(m.init_std, "model.init_std", lo=0, lo_open=True)
    _positive_int(cfg, "model.n_experts", allow_zero=True)
    _positive_int(cfg, "model.loss_chunk_tokens", allow_zero=True)
    _positive_int(cfg, "model.scan_unroll")
    _positive_int(cfg, "model.attention_block", allow_zero=True)
    _choice(cfg, "model.attention_impl", ATTENTION_IMPLS)
    if m.attention_impl == "cudnn" and m.attention_block:
        raise ConfigError("model.attention_impl", f"cudnn is the library call's kernel; it needs "
                          f"model.attention_block=0, got {m.attention_block}")
    if m.n_experts:
        _positive_int(cfg, "model.moe_top_k")
        if m.moe_top_k > m.n_experts:
            raise ConfigError("model.moe_top_k", f"{m.moe_top_k} exceeds model.n_experts={m.n_experts}")
        _number(m.moe_capacity_factor, "model.moe_capacity_factor", lo=0, lo_open=True)
        _number(m.moe_aux_weight, "model.moe_aux_weight", lo=0)
        group = _positive_int(cfg, "model.moe_group_tokens", allow_zero=True)
        if group and cfg.train.seq_len % group:
            raise ConfigError("model.moe_group_tokens", f"{group} does not divide train.seq_len={cfg.train.seq_len}")
        if group and (cfg.train.seq_len // group) % shape["sequence"]:
            raise ConfigError("model.moe_group_tokens", f"the {cfg.train.seq_len // group} groups of a sequence do not "
                              f"split over mesh.sequence={shape['sequence']} (a group must sit on one sequence shard)")
        if m.n_experts % shape["expert"]:
            raise ConfigError("mesh.expert", f"{shape['expert']} does not divide model.n_experts={m.n_experts}")
    elif shape["expert"] > 1:
        raise ConfigError("mesh.expert", f"size {shape['expert']} needs a mixture of experts (model.n_experts > 0)")
    _validate_pipeline(cfg, shape, micro)
    if m.init_from:  # the checkpoint's config.json only: its weights are read at init, after compiling
        from jaxtrain import hf  # noqa: PLC0415 (hf imports this module)
        try:
            hf.check_fields(hf.read_config(m.init_from), model_config(cfg, "cpu"), m.init_from)
        except hf.HFMismatch:
            raise
        except hf.HFError as e:
            raise ConfigError("model.init_from", str(e)) from None

    # Optimizer.
    o = cfg.optim
    _number(o.lr, "optim.lr", lo=0, lo_open=True)
    _positive_int(cfg, "optim.warmup_steps", allow_zero=True)
    if o.warmup_steps > t.steps:
        raise ConfigError("optim.warmup_steps", f"{o.warmup_steps} exceeds train.steps={t.steps}")
    if o.schedule not in SCHEDULES:
        raise ConfigError("optim.schedule", f"unknown schedule {o.schedule!r}; choose one of {list(SCHEDULES)}")
    _number(o.min_lr_ratio, "optim.min_lr_ratio", lo=0, hi=1)
    _number(o.decay_fraction, "optim.decay_fraction", lo=0, hi=1)
    _number(o.weight_decay, "optim.weight_decay", lo=0)
    _number(o.clip_norm, "optim.clip_norm", lo=0)  # 0 disables clipping
    _number(o.b1, "optim.b1", lo=0, hi=1)
    _number(o.b2, "optim.b2", lo=0, hi=1)
    _number(o.eps, "optim.eps", lo=0, lo_open=True)

    # Data, eval, checkpoint, log, sample.
    if cfg.data.corpus != "kjv":
        raise ConfigError("data.corpus", f"unknown corpus {cfg.data.corpus!r}; only 'kjv' ships so far")
    _positive_int(cfg, "data.vocab_size")
    if cfg.data.vocab_size < 258:
        raise ConfigError("data.vocab_size", f"must be at least 258 (256 bytes + 2 special tokens), "
                          f"got {cfg.data.vocab_size}")
    if cfg.data.vocab_size > m.vocab_size:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} is smaller than the tokenizer's "
                          f"data.vocab_size={cfg.data.vocab_size}")
    _positive_int(cfg, "data.heldout_docs")
    if cfg.data.mixture:
        from jaxtrain.data.pipeline import parse_mixture

        try:
            parse_mixture(cfg.data.mixture)
        except ValueError as e:
            raise ConfigError("data.mixture", str(e)) from None
    _positive_int(cfg, "data.num_workers", allow_zero=True)
    _positive_int(cfg, "eval.every_steps", allow_zero=True)
    _positive_int(cfg, "eval.batches")
    if not isinstance(cfg.eval.sets, str):
        raise ConfigError("eval.sets", f"must be a string \"name=DIR,...\", got {cfg.eval.sets!r}")
    if cfg.eval.sets:
        from jaxtrain.data.pipeline import parse_eval_sets

        try:
            parse_eval_sets(cfg.eval.sets)
        except ValueError as e:
            raise ConfigError("eval.sets", str(e)) from None
    _positive_int(cfg, "checkpoint.every_steps")
    _number(cfg.checkpoint.every_minutes, "checkpoint.every_minutes", lo=0)
    _positive_int(cfg, "checkpoint.keep")
    _positive_int(cfg, "checkpoint.keep_period", allow_zero=True)
    _positive_int(cfg, "checkpoint.local_every_steps", allow_zero=True)
    _positive_int(cfg, "checkpoint.local_keep")
    if not isinstance(cfg.checkpoint.local_dir, str):
        raise ConfigError("checkpoint.local_dir", f"must be a path or empty, got {cfg.checkpoint.local_dir!r}")
    if bool(cfg.checkpoint.local_dir) != bool(cfg.checkpoint.local_every_steps):
        raise ConfigError("checkpoint.local_every_steps", "set both checkpoint.local_dir and "
                          "checkpoint.local_every_steps, or neither")
    _choice(cfg, "checkpoint.on_write_error", WRITE_ERROR_POLICIES)
    _choice(cfg, "faults.nan_policy", NAN_POLICIES)
    _number(cfg.faults.step_timeout_s, "faults.step_timeout_s", lo=0)
    _number(cfg.faults.preempt_grace_s, "faults.preempt_grace_s", lo=0)
    _positive_int(cfg, "log.every_steps")
    _validate_trackers(cfg.log)
    profile_steps(cfg.log.profile_steps)
    _positive_int(cfg, "sample.max_new_tokens", allow_zero=True)
    _number(cfg.sample.temperature, "sample.temperature", lo=0)
    _positive_int(cfg, "sample.top_k", allow_zero=True)
    return {"mesh_shape": shape, "rules": rules, "data_parallel": dp, "dcn": dcn}


WANDB_MODES = ("offline", "online", "disabled")


def _validate_pipeline(cfg, shape: dict, microbatch: int) -> None:
    p = cfg.pipeline
    for f in ("stages", "microbatches", "repeats"):
        _positive_int(cfg, f"pipeline.{f}")
    if p.stages % shape["pipeline"]:
        raise ConfigError("mesh.pipeline", f"{shape['pipeline']} does not divide pipeline.stages={p.stages}")
    if p.stages == 1:
        return
    from jaxtrain import pipeline_parallel  # noqa: PLC0415 (it imports jax)

    try:
        pipeline_parallel.check(cfg.model.n_layers, microbatch, p.stages, p.microbatches, p.schedule, p.repeats)
    except ValueError as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field, reason) from None
    dp = mesh_lib.data_parallel_size(shape, mesh_lib.resolve_rules(cfg.mesh.rules))
    if (microbatch // p.microbatches) % dp:
        raise ConfigError("pipeline.microbatches", f"a pipeline microbatch of {microbatch // p.microbatches} "
                          f"sequences is not divisible by the data-parallel size {dp}")


def profile_steps(spec) -> tuple[int, int] | None:
    """log.profile_steps "FIRST,LAST" or "STEP" -> (first, last), "" -> None; ConfigError otherwise."""
    if spec == "":
        return None
    parts = str(spec).split(",")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ConfigError("log.profile_steps", f"expected \"FIRST,LAST\" or \"STEP\" with 1 <= FIRST <= LAST, "
                          f"got {spec!r}")
    return first, last


def _validate_trackers(log) -> None:
    """Named trackers must be importable now, not after the compile."""
    import importlib.util

    from jaxtrain.metrics import parse_trackers

    for f in ("trackers", "experiment", "run_name", "mlflow_uri", "wandb_entity", "wandb_api_key"):
        if not isinstance(log[f], str):
            raise ConfigError(f"log.{f}", f"must be a string, got {log[f]!r}")
    try:
        names = parse_trackers(log.trackers)
    except ValueError as e:
        raise ConfigError("log.trackers", str(e)) from None
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise ConfigError("log.trackers", f"{name} is not installed: pip install 'jaxtrain[{name}]'")
    if "mlflow" in names and not log.experiment:
        raise ConfigError("log.experiment", "must not be empty with mlflow")
    if log.wandb_mode not in WANDB_MODES:
        raise ConfigError("log.wandb_mode", f"unknown value {log.wandb_mode!r}; choose one of {list(WANDB_MODES)}")


def validate_distributed(cfg: ml_collections.ConfigDict) -> None:
    """The `distributed` group, checked before jax.distributed starts (so before the other groups)."""
    from jaxtrain import distributed

    d = cfg.distributed
    for f in ("coordinator", "num_processes", "process_id", "auto", "timeout_s"):
        if f not in d:
            raise ConfigError(f"distributed.{f}", "missing")
    try:
        distributed.check(d.coordinator, d.num_processes, d.process_id)
    except ValueError as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field, reason) from None
    _number(d.timeout_s, "distributed.timeout_s", lo=0, lo_open=True)


# Settings a workdir's checkpoints are tied to: the state's shapes and the data order.
RESUME_FIXED = ("model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                "model.head_dim", "model.d_ff", "model.tie_embeddings", "model.param_dtype", "model.n_experts",
                "train.seed", "data.corpus", "data.vocab_size", "data.heldout_docs")


def check_resumable(saved: dict, cfg: ml_collections.ConfigDict, workdir: str) -> None:
    """Raises ConfigError naming the first RESUME_FIXED field that differs from the workdir's saved config."""
    for field in RESUME_FIXED:
        group, key = field.split(".")
        # A key older workdirs did not save has its schema default.
        was, now = saved.get(group, {}).get(key, base_config()[group][key]), cfg[group][key]
        if was != now:
            raise ConfigError(field, f"is {now!r} but the checkpoints in {workdir} were made with {was!r}; "
                              f"set it back or use a new workdir")


def check_backend(cfg: ml_collections.ConfigDict, backend: str) -> None:
    """ConfigError for settings the backend the step compiles for ("cpu", "gpu", "tpu") cannot run."""
    if cfg.model.attention_impl == "cudnn":
        if backend != "gpu":
            raise ConfigError("model.attention_impl", f"cudnn runs on GPUs only; this run compiles for {backend} "
                              f"(use 'xla')")
        dtype = model_config(cfg, backend).dtype
        if dtype not in ("bfloat16", "float16"):
            raise ConfigError("model.attention_impl", f"cudnn needs bfloat16 or float16 compute; "
                              f"model.dtype is {dtype}")


def model_config(cfg: ml_collections.ConfigDict, backend: str) -> ModelConfig:
    """Resolves `auto` dtypes: float32 on CPU (faster there with XLA), bf16 compute + f32 params elsewhere."""
    m = dict(cfg.model)
    m.pop("init_from", None)  # where the weights come from, not what the model is
    if m["dtype"] == "auto":
        m["dtype"] = "float32" if backend == "cpu" else "bfloat16"
    if m["param_dtype"] == "auto":
        m["param_dtype"] = "float32"
    p = cfg.pipeline
    return ModelConfig(**m, pipeline_stages=p.stages, pipeline_microbatches=p.microbatches,
                       pipeline_schedule=p.schedule, pipeline_repeats=p.repeats)
