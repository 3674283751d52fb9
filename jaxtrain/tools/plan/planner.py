"""The plan itself: the train step compiled ahead of time for N devices, and every figure read back from it.

`plan()` builds the trainer a run would build (`trainer.build_trainer`, shapes only, nothing allocated), lowers
its step with an abstract batch and compiles it, on fake CPU devices or, with `compiler="gpu"`, by XLA:GPU for
described GPUs (`topology.py`). It reads the per-device bytes from the shardings and `memory_analysis()`, the
FLOPs from `cost_analysis()` and the HLO, and the collectives from the HLO text, and sets the analytic estimate
beside them. The device tables say what a target device holds and computes. jax is imported inside the
functions: the command sets XLA's flags first.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from pathlib import Path

from jaxtrain.errors import ConfigError, PlanError
from jaxtrain.observe import hlo as hlo_lib
from jaxtrain.tools.plan import pipeline_model, topology as gpu_topology
from jaxtrain.tools.plan.analytic import analytic
from jaxtrain.tools.plan.collectives import collectives, summarize_collectives
from jaxtrain.tools.plan.roofline import roofline

BACKENDS = ("cpu", "gpu", "tpu")
DEFAULT_DEVICE_KIND = {"gpu": "H100", "tpu": "TPU v5p"}
# Device memory per device in GiB (vendor figures; the A100 is its 80 GB model), for the "fits" line.
HBM_GIB = {"h100": 80 * 1e9 / 2**30, "h200": 141 * 1e9 / 2**30, "b200": 192 * 1e9 / 2**30,
           "a100": 80 * 1e9 / 2**30, "l4": 24 * 1e9 / 2**30, "tpu v4": 32, "tpu v5 lite": 16, "tpu v5e": 16,
           "tpu v5p": 95, "tpu v5": 95, "tpu v6 lite": 32, "tpu v6e": 32}


def per_device_bytes(tree) -> float:
    """Max over devices of the summed bytes of the shards each device holds."""
    import jax  # noqa: PLC0415
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        itemsize = leaf.dtype.itemsize
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            n = math.prod(len(range(*s.indices(dim))) for s, dim in zip(index, leaf.shape))
            per_device[device] = per_device.get(device, 0) + n * itemsize
    return float(max(per_device.values(), default=0))


def _memory_analysis(compiled) -> dict | None:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (unimplemented on some backends)
        return None
    if stats is None:
        return None
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    out = {}
    for key in ("argument", "output", "alias", "temp", "generated_code"):
        value = getattr(stats, f"{key}_size_in_bytes", None)
        if value is not None:
            out[key] = float(value)
        host = getattr(stats, f"host_{key}_size_in_bytes", None)  # pinned host memory (offload)
        if host:
            out[f"host_{key}"] = float(host)
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if {"argument", "output", "alias", "temp"} <= out.keys():
        out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    if peak:
        out["peak_reported"] = float(peak)
    return out or None


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        return None
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else None
    if not cost:
        return None
    flops = cost.get("flops") if hasattr(cost, "get") else None
    return float(flops) if flops is not None and flops >= 0 else None


def device_memory(backend: str, device_kind: str | None) -> float | None:
    """Bytes of memory of one target device (HBM_GIB), or None (cpu, unknown kind)."""
    if backend == "cpu" and not device_kind:
        return None
    kind = (device_kind or DEFAULT_DEVICE_KIND[backend]).lower()
    for name, gib in sorted(HBM_GIB.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return gib * 2**30
    return None


def peak_per_device(backend: str, device_kind: str | None, num_devices: int,
                    dtype: str = "float32") -> tuple[float, str]:
    """Peak FLOP/s of one target device and where it comes from. On cpu: this machine's measured matmul peak in
    the compute `dtype` (metrics.peak_flops, cached), shared by the fake devices, so divided by their count."""
    from jaxtrain.observe import metrics  # noqa: PLC0415
    if backend == "cpu" and not device_kind:
        flops, source = metrics.peak_flops(dtype=dtype)
        return flops / num_devices, f"this machine's peak, {source}, shared by the fake devices"
    kind = (device_kind or DEFAULT_DEVICE_KIND[backend]).lower()
    for name, flops in sorted(metrics.PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if name in kind:
            return flops, f"{name}: dense bf16, metrics.PEAK_FLOPS"
    raise ConfigError("device_kind", f"unknown {device_kind!r}; known: {', '.join(sorted(metrics.PEAK_FLOPS))}")


def plan(config, num_devices: int, backend: str = "cpu", *, device_kind: str | None = None, mfu: float = 0.5,
         peak_flops: float | None = None, hlo_path: str | None = None, compiler: str = "cpu",
         force: bool = False) -> dict:
    """Compiles `config`'s train step for `num_devices` fake CPU devices with `backend`'s dtypes, and returns
    every figure of the report (bytes are per device). Raises errors.ConfigError on bad input.

    The calling process must see at least `num_devices` CPU devices (XLA_FLAGS, before jax is imported).
    `compiler="gpu"` (with backend "gpu") compiles with XLA:GPU instead, for `num_devices` described GPUs of
    `device_kind` (`jaxtrain.tools.plan.topology`: needs the CUDA PJRT plugin, not a GPU): the memory, fusions and
    collectives are then the GPU compiler's own.
    `peak_flops`: peak FLOP/s per device, overriding the `backend` / `device_kind` lookup. `hlo_path`: also
    write the compiled HLO text there (to read the collectives' op names and shapes)."""
    from jaxtrain import step as step_lib  # noqa: PLC0415

    _check_request(num_devices, backend, mfu)
    devices, compiled_on = _target_devices(compiler, backend, device_kind, num_devices)
    resolved = _check_config(config, num_devices, backend, device_kind, force)
    model_cfg, objective = resolved.model, resolved.objective
    if peak_flops is None:  # an unknown device kind fails before the compile
        peak_dev, peak_source = peak_per_device(backend, device_kind, num_devices, model_cfg.dtype)
    else:
        peak_dev, peak_source = float(peak_flops), "--peak_tflops"
    mesh_shape, rules = resolved.mesh_shape, resolved.rules

    config, trainer = _build_for_target(config, resolved, compiler, devices)
    t = config.train
    abstract_batch = _abstract_batch(t, objective, trainer.batch_sharding)
    compiled, compile_s = _compile(trainer, abstract_batch, compiler, devices[0], compiled_on)

    state = trainer.abstract_state
    reference, feedback = "reference" in state, step_lib.RESIDUAL in state  # DPO's; error feedback's
    sharded = _sharded_bytes(state, abstract_batch, model_cfg, config.optim.offload)
    est, inventory = _estimate(config, resolved, reference=reference, feedback=feedback)
    memory = _memory_analysis(compiled)
    module = _compiled_hlo(compiled, hlo_path)

    tokens = t.batch_size * t.seq_len
    model_flops = _model_flops(model_cfg, resolved.reference, t)
    work, lockstep = _switch_weights(config.pipeline)
    collective_rows = _collective_rows(module, mesh_shape, rules, est["collectives"], work)
    flops = _flop_counts(compiled, module, model_flops, num_devices, work)
    roof = _roofline(module, compiler, device_kind, peak_dev, model_flops / num_devices, lockstep)
    step_s = model_flops / (peak_dev * num_devices * mfu)
    pipe = _pipeline_summary(config.pipeline)
    bubble_step_s = step_s / (1 - pipe["bubble"])
    return {
        "config": _config_summary(config, resolved),
        "target": {"backend": backend, "device_kind": device_kind or DEFAULT_DEVICE_KIND.get(backend, "this machine"),
                   "num_devices": num_devices, "compiler": compiler, "compiled_on": compiled_on,
                   "peak_flops_per_device": peak_dev, "peak_source": peak_source,
                   "memory_bytes": device_memory(backend, device_kind)},
        "model": {"params": sum(math.prod(p["shape"]) for p in inventory), "tokens_per_step": tokens,
                  "layers": model_cfg.n_layers},
        "compile_s": compile_s,
        "memory": {"sharding": sharded, "compiled": memory, "analytic": est,
                   "rows": _memory_rows(sharded, memory, est, reference=reference, feedback=feedback),
                   **({"rollout": _rollout_memory(config, resolved, sharded)}
                      if objective.data == "prompts" else {})},
        "flops": flops,
        "speed": {"mfu": mfu, "ideal_step_s": step_s, "tokens_per_s": tokens / step_s, "roofline": roof,
                  # the step with the schedule's bubble (bubble = 0 without a pipeline)
                  "bubble_step_s": bubble_step_s, "bubble_tokens_per_s": tokens / bubble_step_s},
        "pipeline": pipe,
        "collectives": collective_rows,
    }


def _check_request(num_devices: int, backend: str, mfu: float) -> None:
    """The plain arguments, checked before anything is built."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ConfigError("devices", f"must be an integer >= 1, got {num_devices!r}")
    if backend not in BACKENDS:
        raise ConfigError("backend", f"unknown {backend!r}; choose one of {list(BACKENDS)}")
    if not 0 < mfu <= 1:
        raise ConfigError("mfu", f"must be in (0, 1], got {mfu!r}")


def _target_devices(compiler: str, backend: str, device_kind: str | None, num_devices: int) -> tuple[list, str]:
    """The devices `compiler` compiles for (fake CPU devices, or GPUs described to XLA:GPU), and their description."""
    import jax  # noqa: PLC0415
    if compiler == "gpu":
        if backend != "gpu":
            raise ConfigError("compiler", f"gpu compiles for a gpu target; --backend is {backend!r}")
        try:
            devices = gpu_topology.devices(device_kind, num_devices)
        except (ModuleNotFoundError, ValueError) as e:
            raise ConfigError("compiler", str(e)) from None
        return devices, f"{num_devices} described {gpu_topology.spec_for(device_kind)[0].upper()} GPU(s), by XLA:GPU"
    if compiler == "cpu":
        devices = jax.devices("cpu")[:num_devices]
        if len(devices) < num_devices:
            raise ConfigError("devices", f"{num_devices} requested but this process has {len(devices)} CPU "
                              f"device(s); set XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} "
                              f"before jax is imported (the CLI does)")
        return devices, f"{num_devices} fake CPU devices"
    raise ConfigError("compiler", f"unknown {compiler!r}; choose cpu or gpu")


def _check_config(config, num_devices: int, backend: str, device_kind: str | None, force: bool):
    """What config.validate resolves of the config for the target (its mesh, its model in the target's dtypes),
    or a ConfigError: the target's checks too (e.g. cuDNN attention needs a gpu target), and the run's own memory
    floor against the target's memory, refused before a long compile unless forced."""
    from jaxtrain import config as config_lib, memory  # noqa: PLC0415
    resolved = config_lib.validate(config, num_devices, backend=backend)
    if not force:
        memory.check_fits(config, num_devices, device_memory(backend, device_kind))
    return resolved


def _build_for_target(config, resolved, compiler: str, devices: list) -> tuple:
    """(the config as compiled, the trainer a run would build from it: shapes only, nothing allocated).

    The target's dtypes are written into the config, and it is resolved again for the platform it compiles on
    (fake CPU devices for a GPU target, say), so that build_trainer builds exactly them. The CPU compiler has no
    cuDNN: its attention is XLA's (the analytic counts the target's kernel)."""
    from jaxtrain import config as config_lib  # noqa: PLC0415
    from jaxtrain.trainer import build_trainer  # noqa: PLC0415
    model_cfg = resolved.model
    config = copy.deepcopy(config)
    config.model.dtype, config.model.param_dtype = model_cfg.dtype, model_cfg.param_dtype
    if compiler == "cpu":
        config.model.attention_impl = "xla"
    on_target = config_lib.resolve(config, resolved.mesh_shape, resolved.rules, devices[0].platform, resolved.dcn)
    trainer = build_trainer(config, on_target, devices=devices)
    assert trainer.model_cfg == dataclasses.replace(model_cfg, attention_impl=config.model.attention_impl), \
        (trainer.model_cfg, model_cfg)
    return config, trainer


def _abstract_batch(t, objective, sharding) -> dict:
    """The step's batch as shapes (`t`: the config's train group), with what `objective` needs, placed like a
    run's."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    keys = ("tokens", "segment_ids", "positions") + objective.batch_keys
    return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.float32 if k in objective.float_keys else
                                    jnp.int32, sharding=sharding) for k in keys}


# A plan never runs its program, so XLA:CPU may skip what only makes the machine code fast: these options change
# the code LLVM emits, never the HLO, its buffers or its collectives (every figure of tests/tools/test_plan.py's
# plans stayed identical), and halve the compile.
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _compile(trainer, abstract_batch: dict, compiler: str, device, compiled_on: str) -> tuple[object, float]:
    """The step lowered and compiled ahead of time, and the seconds that took. A compiler's failure is a PlanError
    of one line rather than its traceback."""
    import jax  # noqa: PLC0415
    t0 = time.perf_counter()
    # A kernel library that picks its kernel by the default device (tokamax: Mosaic GPU for sm90) sees the target.
    target = jax.default_device(device) if compiler == "gpu" else contextlib.nullcontext()
    options = FAST_CPU_COMPILE if compiler == "cpu" else None
    try:
        with target:
            compiled = trainer.train_step.lower(trainer.abstract_state, abstract_batch).compile(options)
    except jax.errors.JaxRuntimeError as e:  # a compiler limit, e.g. XLA:GPU's GEMM tiling without autotuning
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "; --compiler cpu plans the same step with XLA:CPU" if compiler == "gpu" else ""
        raise PlanError(f"compiler: compiling the step for {compiled_on} failed: "
                        f"{reason[:300]}{'...' if len(reason) > 300 else ''}{hint}") from None
    return compiled, time.perf_counter() - t0


def _sharded_bytes(state: dict, abstract_batch: dict, model_cfg, offload: bool) -> dict:
    """Per-device bytes of each part of the step's arguments, from their shardings."""
    from jaxtrain import step as step_lib, trainer as trainer_lib  # noqa: PLC0415
    sharded = {"params": per_device_bytes(state["params"]), "optimizer": per_device_bytes(state["opt_state"]),
               "step": per_device_bytes(state["step"]), "batch": per_device_bytes(abstract_batch)}
    sharded["gradients"] = per_device_bytes(trainer_lib.trained_params(model_cfg)(state["params"]))
    sharded["reference"] = per_device_bytes(state["reference"]) if "reference" in state else 0.0  # DPO's
    feedback = step_lib.RESIDUAL in state  # optim.grad_reduce_error_feedback's residual, one per replica
    sharded["grad_residual"] = per_device_bytes(state[step_lib.RESIDUAL]) if feedback else 0.0
    # optim.offload: the state's shards live in each device's host memory. Counted by the config, not the
    # shardings' memory kind, which a described GPU's devices (no memories) drop.
    sharded["host"] = {"optimizer": sharded["optimizer"] if offload else 0.0}
    if offload:
        sharded["optimizer"] = 0.0
    return sharded


def _param_inventory(model_cfg, seed: int) -> tuple[list[dict], dict, dict]:
    """Every parameter's shape, logical names (the model's own annotations), bytes and whether it is trained; and
    the trees of names and shapes."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jaxtrain.models import lora, transformer  # noqa: PLC0415
    abstract_params = nnx.state(nnx.eval_shape(lambda: transformer.build(model_cfg, seed)))
    names = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    shapes = nnx.to_pure_dict(abstract_params)
    is_names = lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec)  # noqa: E731
    # With LoRA only the adapters are trained: they alone have gradients and optimizer state.
    flags = [not model_cfg.lora_rank or lora.is_adapter(str(path[-1].key))
             for path, _ in jax.tree_util.tree_leaves_with_path(shapes)]
    inventory = [{"shape": x.shape, "names": tuple(n) if n is not None else None,
                  "bytes": math.prod(x.shape) * jnp.dtype(x.dtype).itemsize, "trained": f}
                 for n, x, f in zip(jax.tree.leaves(names, is_leaf=is_names), jax.tree.leaves(shapes), flags)]
    return inventory, names, shapes


def _optimizer_size(config, model_cfg, names: dict, shapes: dict, inventory: list[dict]) -> tuple[int, float]:
    """The optimizer state's integer counters, and its other bytes per trained parameter byte."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxtrain import optim, trainer as trainer_lib  # noqa: PLC0415
    trained = trainer_lib.trained_params(model_cfg)
    optimizer = optim.make_optimizer(config.optim, config.train.steps, trained(names), model_cfg.dtype)
    opt_leaves = jax.tree.leaves(jax.eval_shape(optimizer.init, trained(shapes)))
    counters = sum(1 for x in opt_leaves if x.shape == () and jnp.issubdtype(x.dtype, jnp.integer))
    moments = sum(math.prod(x.shape) * x.dtype.itemsize for x in opt_leaves if x.ndim) / sum(
        p["bytes"] for p in inventory if p["trained"])
    return counters, moments


def _estimate(config, resolved, *, reference: bool, feedback: bool) -> tuple[dict, list[dict]]:
    """The analytic estimate of the step (analytic.py) with the state's extra arguments, and the parameter
    inventory it counted."""
    import jax.numpy as jnp  # noqa: PLC0415
    t, model_cfg = config.train, resolved.model
    inventory, names, shapes = _param_inventory(model_cfg, t.seed)
    counters, moments = _optimizer_size(config, model_cfg, names, shapes, inventory)
    est = analytic(model_cfg, inventory, resolved.mesh_shape, resolved.rules, batch=t.batch_size, seq_len=t.seq_len,
                   microbatches=t.microbatches, opt_counters=counters, opt_moments=moments,
                   layout=resolved.layout, offload=config.optim.offload,
                   per_replica=config.optim.grad_reduce_error_feedback)
    # An objective's frozen reference (DPO's): a copy of the trained params (all, or LoRA's adapters), an argument.
    est["reference"] = est["gradients"] if reference else 0.0
    est["arguments"] += est["reference"]
    # Error feedback's residual: each replica's is f32 and split like its trained params, one copy per device.
    est["grad_residual"] = est["gradients"] * 4 / jnp.dtype(model_cfg.param_dtype).itemsize if feedback else 0.0
    est["arguments"] += est["grad_residual"]
    return est, inventory


def _compiled_hlo(compiled, hlo_path: str | None) -> dict | None:
    """The compiled program's HLO, parsed (None where the backend gives no text); also written to `hlo_path`."""
    text = compiled.as_text() or ""
    if hlo_path:
        Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
        Path(hlo_path).write_text(text)
    return hlo_lib.parse_hlo(text) if text else None


def _collective_rows(module: dict | None, mesh_shape: dict, rules: dict, predicted: list[dict],
                     branch_weights=None) -> list[dict]:
    """The compiled program's collectives per kind and mesh axes, each beside the analytic bytes `predicted`; then
    those predicted but not in the program. `branch_weights`: an explicit schedule's switch (pipeline_model)."""
    from jaxtrain.parallel import mesh as mesh_lib  # noqa: PLC0415
    weights = (lambda instr: branch_weights(instr, [0.0] * len(hlo_lib.called(instr)))) if branch_weights else None
    ops = collectives(module, mesh_shape, mesh_lib.replica_axes(mesh_shape, rules), weights) if module else []
    rows = summarize_collectives(ops)
    analytic_by_key = {(r["kind"], r["axes"]): r["bytes"] for r in predicted}
    for row in rows:
        row["analytic_bytes"] = analytic_by_key.pop((row["kind"], row["axes"]), None)
    for (kind, axes), nbytes in analytic_by_key.items():  # predicted but not in the compiled program
        rows.append({"kind": kind, "axes": axes, "count": 0, "bytes": 0.0, "wire_bytes": 0.0,
                     "partial": False, "trip_count_unknown": False, "analytic_bytes": nbytes})
    return [dict(r, axes=list(r["axes"]), ratio=_ratio(r.get("analytic_bytes"), r["bytes"])) for r in rows]


def _model_flops(model_cfg, reference: bool, t) -> float:
    """The step's model FLOPs over all devices (`t`: the config's train group)."""
    from jaxtrain.models import transformer  # noqa: PLC0415
    tokens = t.batch_size * t.seq_len
    model_flops = transformer.train_flops_per_token(model_cfg, t.seq_len) * tokens
    if reference:  # the reference model's forward, a third of a train step's FLOPs
        model_flops *= 4 / 3
    return model_flops


def _switch_weights(p) -> tuple:
    """hlo.chosen_branches weights for an explicit schedule's switch (pipeline_model): (the work each tick's
    branch does, for the FLOPs; the slowest stage's branch each tick, for the roofline), or (None, None)."""
    from jaxtrain.parallel import pipeline as pipeline_parallel  # noqa: PLC0415
    if p.stages == 1 or p.schedule not in pipeline_parallel.EXPLICIT:
        return None, None
    args = (p.schedule, p.stages, p.microbatches, p.repeats)
    return pipeline_model.work_weights(*args), pipeline_model.lockstep_weights(*args)


def _flop_counts(compiled, module: dict | None, model_flops: float, num_devices: int, branch_weights=None) -> dict:
    """The model's FLOPs beside XLA's cost analysis and the HLO's dots, over all devices (a conditional's branches
    as `branch_weights` weighs them, hlo.chosen_branches)."""
    cost = _cost_flops(compiled)
    dots = hlo_lib.dot_flops(module, branch_weights) if module is not None else None
    cost_total = cost * num_devices if cost is not None else None
    dots_total = dots * num_devices if dots is not None else None
    return {"model_per_step": model_flops, "cost_analysis_per_device": cost, "cost_analysis_total": cost_total,
            "conditionals": "branches as the schedule runs them" if branch_weights else "costliest branch",
            "hlo_dots_total": dots_total, "cost_analysis_vs_model": _ratio(cost_total, model_flops),
            "hlo_dots_vs_model": _ratio(dots_total, model_flops)}


def _roofline(module: dict | None, compiler: str, device_kind: str | None, peak_dev: float,
              flops_per_device: float, branch_weights=None) -> dict | None:
    """The roofline of an XLA:GPU program (roofline.py), with the MFU it allows; None for other compilers."""
    if compiler != "gpu" or module is None:
        return None
    roof = roofline(module, peak_dev, gpu_topology.spec_for(device_kind)[1]["memory_bandwidth"],
                    branch_weights=branch_weights)
    roof["mfu"] = flops_per_device / (peak_dev * roof["seconds"]) if roof["seconds"] else None
    return roof


def _ratio(x, y):
    return x / y if x is not None and y else None


def _rollout_memory(config, resolved, sharded: dict) -> dict:
    """An RL objective's rollouts (jaxtrain.models.rollout) beside the resident state: the K/V cache of a
    rollout's rows (train.batch_size x grpo.rollout_batches, train.seq_len positions) per device, its rows split
    over the batch axes and the heads over `tensor` as the decode splits them, and that with the state's
    arguments (params, optimizer, reference; not the step's batch or gradients): the rollouts' floor."""
    import jax  # noqa: PLC0415

    from jaxtrain.models import transformer  # noqa: PLC0415
    model_cfg, t = resolved.model, config.train
    rows = t.batch_size * config.grpo.rollout_batches
    cache = jax.eval_shape(lambda: transformer.init_cache(model_cfg, rows, t.seq_len))
    tensor = resolved.mesh_shape.get("tensor", 1)
    heads_split = tensor if not model_cfg.kv_lora_rank and model_cfg.n_kv_heads % tensor == 0 else 1
    kv_cache = sum(math.prod(c.shape) * c.dtype.itemsize for c in jax.tree.leaves(cache)) / (
        resolved.data_parallel * heads_split)
    state = sharded["params"] + sharded["optimizer"] + sharded["reference"] + sharded["step"]
    return {"rows": rows, "kv_cache": kv_cache, "peak": state + kv_cache}


def _memory_rows(sharded: dict, memory: dict | None, est: dict, *, reference: bool, feedback: bool) -> list[dict]:
    """The memory table: each part's bytes from the shardings or the compiler, beside the analytic ones."""
    rows = [
        ("params", sharded["params"], est["params"]),
        ("optimizer", sharded["optimizer"], est["optimizer"]),
        ("gradients", sharded["gradients"], est["gradients"]),
        *([("reference", sharded["reference"], est["reference"])] if reference else []),
        *([("grad_residual", sharded["grad_residual"], est["grad_residual"])] if feedback else []),
        ("arguments", (memory or {}).get("argument"), est["arguments"]),
        ("temporaries", (memory or {}).get("temp"), est["temporaries"]),
    ]
    return [{"name": n, "compiled": c, "analytic": a, "ratio": _ratio(a, c)} for n, c, a in rows]


def _config_summary(config, resolved) -> dict:
    t, model_cfg = config.train, resolved.model
    return {"mesh": resolved.mesh_shape, "rules": config.mesh.rules, "batch_size": t.batch_size, "seq_len": t.seq_len,
            "microbatches": t.microbatches, "remat": resolved.layout.remat, "dtype": model_cfg.dtype,
            "param_dtype": model_cfg.param_dtype, "attention_impl": model_cfg.attention_impl,
            "compiled_attention": config.model.attention_impl}


def _pipeline_summary(p) -> dict:
    """The schedule's bubble, chart and peak of held chunk activations per stage (its table's); the analytic
    estimate's pipeline part is the memory's (analytic._pipeline_estimate)."""
    from jaxtrain.parallel import pipeline as pipeline_parallel, schedules  # noqa: PLC0415
    # The schedule's chart, as report prints it (indented 4).
    table = schedules.build(p.schedule, p.stages, p.microbatches, p.repeats) if p.stages > 1 else None
    chart = schedules.format_table(table, width=116, max_blocks=3) if table else ""
    bubble = pipeline_parallel.bubble_fraction(p.stages, p.microbatches, p.repeats, p.schedule) if table else 0.0
    return {"stages": p.stages, "microbatches": p.microbatches, "schedule": p.schedule, "repeats": p.repeats,
            "bubble": bubble, "chart": chart,
            "peak_activations": list(schedules.peak_activations(table)) if table else []}
