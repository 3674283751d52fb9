"""What a run compiles, and what a tool needs to rebuild a run's model from its workdir.

`build_trainer` makes the mesh, the abstract sharded train state and the jitted steps from a config and what
`jaxtrain.config.validate` resolved of it (no parameter is allocated); `restore_params` reads a workdir's
checkpoint back for tools (generation, export).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint as ckpt_lib, compile_cache
from jaxtrain import config as config_lib
from jaxtrain import objectives, optim, step as step_lib
from jaxtrain import workdir as workdir_lib
from jaxtrain.errors import CheckpointError
from jaxtrain.models import lora, transformer
from jaxtrain.models.config import Layout, ModelConfig
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline as pipeline_parallel


def abstract_train_state(model_cfg, optim_cfg, total_steps: int, mesh, rules, seed: int, reference: bool = False,
                         layout: Layout = Layout()):
    """(graphdef, abstract state, state shardings, init function, optimizer), all without allocating a parameter.
    ConfigError naming optim.groups if a rule matches no parameter of the model.
    `reference`: the state also keeps a frozen copy of the starting trained weights (DPO's reference model): every
    parameter, or under LoRA the starting adapters only (over the frozen base they give the starting model).
    Under optim.grad_reduce_error_feedback the state's "grad_residual" (step.RESIDUAL) holds each data-parallel
    replica's rounding error (f32, [replicas, *shape] of each trained parameter, split over the replicas like the
    per-replica weight copies of jaxtrain.step and otherwise like its parameter)."""
    abstract_model = nnx.eval_shape(lambda: transformer.build(model_cfg, seed, layout))
    graphdef, abstract_params = nnx.split(abstract_model)
    param_names = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    if optim_cfg.groups:  # a typo would otherwise change nothing, silently
        optim.check_groups(optim_cfg.groups, param_paths(nnx.to_pure_dict(abstract_params)))
    trained = trained_params(model_cfg)
    optimizer = optim.make_optimizer(optim_cfg, total_steps, trained(param_names), model_cfg.dtype)
    replicas = mesh_lib.replica_axes(mesh.shape, rules) if optim_cfg.grad_reduce_error_feedback else ()
    n_replicas = math.prod(mesh.shape[a] for a in replicas)

    def init(params=None):  # given params (e.g. a Hugging Face checkpoint's) get a fresh optimizer state
        fresh = lambda: nnx.to_pure_dict(nnx.state(transformer.build(model_cfg, seed, layout)))  # noqa: E731
        if params is None:
            params = fresh()
        elif model_cfg.lora_rank and not lora.split(params)[0]:  # a base model's weights: fresh adapters beside
            params = lora.join(lora.split(fresh())[0], params)
        # The stacked layers in the order the pipeline keeps them (the model's, unless circular).
        params = pipeline_parallel.reorder_layers(params, None, transformer.layer_order(model_cfg, layout))
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(trained(params))}
        if replicas:
            state[step_lib.RESIDUAL] = jax.tree.map(lambda w: jnp.zeros((n_replicas, *w.shape), jnp.float32),
                                                  trained(params))
        return {**state, "reference": trained(params)} if reference else state

    abstract_state = jax.eval_shape(init)
    # Optimizer moments shard like their parameters; scalars (e.g. Adam's count) are replicated. Moments of another
    # rank than their parameter's (Adafactor's factored row and column statistics) get no names, hence the
    # unannotated fallback (FSDP on their largest divisible dimension). A state kept for some parameters only
    # (Muon's) holds optax.MaskedNode for the others.
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    opt_names = optax.tree_map_params(
        optimizer, lambda x, names: x if masked(x) else names if x.ndim == len(names) else None,
        abstract_state["opt_state"], trained(param_names), transform_non_params=lambda _: None,
        is_leaf=lambda x: isinstance(x, P) or masked(x))
    names = {"step": None, "params": param_names, "opt_state": opt_names,
             **({"reference": trained(param_names)} if reference else {})}
    shardings = mesh_lib.tree_shardings({k: abstract_state[k] for k in names}, names, mesh, rules)
    if replicas:
        shardings[step_lib.RESIDUAL] = jax.tree.map(lambda s: NamedSharding(mesh, P(replicas, *s.spec)),
                                                    trained(shardings["params"]))
    if optim_cfg.offload:  # same layout, in pinned host memory (the step brings it to the device for the update)
        shardings["opt_state"] = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), shardings["opt_state"])
    return graphdef, abstract_state, shardings, init, optimizer


def param_paths(params: dict) -> list[str]:
    """Every parameter's path in a pure dict of params (arrays or their shapes), as optim.groups matches it."""
    return [optim.param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def trained_params(model_cfg: ModelConfig) -> Callable[[dict], dict]:
    """params -> the part training updates: all of them, or with LoRA the adapters (jaxtrain.models.lora)."""
    return (lambda params: lora.split(params)[0]) if model_cfg.lora_rank else (lambda params: params)


def global_batch(local: dict, sharding: NamedSharding) -> dict:
    """Process-local numpy rows -> one global jax.Array per key (works the same on one or many hosts)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


@dataclasses.dataclass
class Trainer:
    """Everything compiled for one config on one mesh. `train_step(state, batch)` donates `state`."""
    mesh: Mesh
    rules: dict
    model_cfg: ModelConfig
    graphdef: object
    abstract_state: dict  # ShapeDtypeStructs carrying the shardings: the restore target
    shardings: dict
    batch_sharding: NamedSharding
    init: Callable[..., dict]  # init() from the seed, or init(params) around given (sharded) params
    train_step: Callable
    eval_step: Callable

    def init_from_host(self, params: dict) -> dict:
        """A fresh state around host (numpy) params: each process places the shards its devices hold."""
        shardings = self.shardings["params"]
        if self.model_cfg.lora_rank and not lora.split(params)[0]:  # base weights: `init` adds the adapters
            shardings = lora.split(shardings)[1]
        placed = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
                              params, shardings)
        return self.init(placed)

    def eval_metrics(self, params, batches, reference=None) -> dict:
        """{"loss": the objective's mean over process-local numpy batches, and its metrics' means (DPO's)}.
        `reference`: the state's "reference" (DPO's starting weights, or adapters under LoRA)."""
        sums = jax.device_get([self.eval_step(params, reference, global_batch(b, self.batch_sharding))
                               for b in batches])
        count = max(float(sum(c for _, c, _ in sums)), 1.0)
        means = {"loss": float(sum(s for s, _, _ in sums) / count)}
        return means | {k: float(sum(m[k] for _, _, m in sums) / count) for k in sums[0][2]}

    def evaluate(self, params, batches, reference=None) -> float:
        """The mean loss over process-local numpy batches (token loss, or DPO's pair loss)."""
        return self.eval_metrics(params, batches, reference)["loss"]


def compiled_to_run_once(jitted, mesh):
    """`jitted`, compiled on CPU without XLA's backend optimizations: for a function that runs once per run
    (the init), they cost most of startup and save nothing (docs/performance.md, "Compile time and startup").
    Its values then differ from an optimized compile's by float rounding (a few ulps); every run and every
    process compiles it the same way, so runs stay bit-identical to each other."""
    if mesh.devices.flat[0].platform != "cpu":
        return jitted
    return compile_cache.per_signature(
        lambda *args: jitted.lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0}))


def build_trainer(config, resolved: config_lib.Resolved, devices=None) -> Trainer:
    """Mesh, model, optimizer and the jitted steps for `config`, from what `config_lib.validate` resolved of it
    (its mesh shape, rules and dcn layout, the model for its backend, the layout, the objective); `devices`
    defaults to all of them, and must be of the backend `resolved` was resolved for."""
    platform = (devices or jax.devices())[0].platform  # a deviceless GPU topology's too (jaxtrain.tools.plan)
    if platform != resolved.backend:
        raise ValueError(f"the config was resolved for {resolved.backend}, the devices are {platform}")
    rules, model_cfg = resolved.rules, resolved.model
    mesh = mesh_lib.make_mesh(resolved.mesh_shape, devices, resolved.dcn)
    lora_run = bool(model_cfg.lora_rank)
    graphdef, abstract_state, shardings, init, optimizer = abstract_train_state(
        model_cfg, config.optim, config.train.steps, mesh, rules, config.train.seed, reference=resolved.reference,
        layout=resolved.layout)
    loss = objectives.loss_of(config)
    batch_sharding = mesh_lib.batch_sharding(mesh, rules)
    replicated = NamedSharding(mesh, P())
    train_step = jax.jit(
        step_lib.make_train_step(graphdef, optimizer, optim.schedule(config.optim, config.train.steps),
                                 config.train.microbatches, mesh, rules, aux_weight=model_cfg.moe_aux_weight,
                                 param_shardings=shardings["params"],
                                 offload=config.optim.offload, lora=lora_run, loss=loss, reference=resolved.reference,
                                 dropout_seed=config.train.seed if model_cfg.lora_dropout else None,
                                 rebalance=transformer.router_balancer(model_cfg, resolved.layout),
                                 mtp_weight=model_cfg.mtp_loss_weight if model_cfg.mtp_layers else 0.0),
        in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated), donate_argnums=0)
    eval_step = jax.jit(step_lib.make_eval_step(graphdef, mesh, rules, loss, lora_run, resolved.reference),
                        in_shardings=(shardings["params"], shardings.get("reference"), batch_sharding),
                        out_shardings=replicated)
    return Trainer(mesh=mesh, rules=rules, model_cfg=model_cfg, graphdef=graphdef,
                   abstract_state=ckpt_lib.abstract_with_shardings(abstract_state, shardings),
                   shardings=shardings, batch_sharding=batch_sharding,
                   init=compiled_to_run_once(jax.jit(init, out_shardings=shardings), mesh),
                   train_step=train_step, eval_step=eval_step)


def make_checkpointer(config, workdir: Path, print_fn=print, run_id: str | None = None) -> ckpt_lib.Checkpointer:
    c = config.checkpoint
    order = transformer.layer_order(config.model, config_lib.layout(config))
    return ckpt_lib.Checkpointer(ckpt_lib.directory(c, workdir), keep=c.keep, keep_period=c.keep_period,
                                 every_steps=c.every_steps, every_minutes=c.every_minutes,
                                 local_directory=c.local_dir or None, local_every_steps=c.local_every_steps,
                                 local_keep=c.local_keep, local_mode=c.local_mode, local_replica=c.local_replica,
                                 log=print_fn, layer_order=order, run_id=run_id,
                                 resettable=(step_lib.RESIDUAL,))


def load_config(workdir) -> ml_collections.ConfigDict:
    """The config a workdir's checkpoints were made with (its config.json over the current schema)."""
    config = config_lib.base_config()
    config.update_from_flattened_dict(_flatten(workdir_lib.read_config(workdir)))
    return config


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def restore_params(workdir, step: int | None = None, devices=None):
    """(config, model_cfg, graphdef, params) of a workdir's checkpoint: the newest that verifies, or `step`.

    For tools that only need the weights (generation, export). The params land replicated over `devices`
    (default: the first device), their stacked layers in the model's order. Raises CheckpointError if there is
    none."""
    config = load_config(workdir)
    ckpt_dir = epath.Path(ckpt_lib.directory(config.checkpoint, workdir))
    if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):  # before Orbax starts
        raise CheckpointError(f"no checkpoint in {ckpt_dir}")
    devices = devices or jax.devices()[:1]
    if devices[0].platform != "gpu":  # a kernel choice, not the model: GPU-trained weights load anywhere
        config.model.attention_impl = "xla"
    # How training ran the layers, not what they are; restoring converts a pipeline's layer order to the model's.
    config.pipeline.update(stages=1, microbatches=1, schedule="gpipe", repeats=1)
    # Not config_lib.validate: the workdir's config passed it when the run started, and what it names (data dirs,
    # Hugging Face weights) need not exist any more.
    resolved = config_lib.resolve(config, {"data": len(devices), "fsdp": 1, "tensor": 1},
                                  mesh_lib.resolve_rules("dp"), devices[0].platform)
    trainer = build_trainer(config, resolved, devices=devices)
    checkpointer = make_checkpointer(config, Path(workdir), print_fn=lambda *a, **k: None)
    try:
        if step is None:
            restored = checkpointer.restore_latest(trainer.abstract_state)
            if restored is None:
                raise CheckpointError(f"no checkpoint in {ckpt_dir}")
            step, state, _ = restored
        else:
            state, _ = checkpointer.restore(step, trainer.abstract_state)
    finally:
        checkpointer.close()
    return config, trainer.model_cfg, trainer.graphdef, state["params"]
