"""Device mesh and logical axis rules.

Parameters and activations name their dimensions with *logical* axes ("embed", "mlp", "batch", ...). A rule
table maps each to zero or more *mesh* axes, and XLA inserts the collectives. The mesh axes, outermost first:
`data` (pure replicas), `pipeline` (stages of the layer stack), `fsdp` (replicas that also shard params, grads
and optimizer state: ZeRO-3), `expert` (MoE experts; a batch axis for the rest), `sequence` (activations split
along the sequence) and `tensor` (Megatron over heads / mlp / vocab). A preset picks the active ones; a mesh
axis larger than 1 that the rules leave unused is a config error, not silently wasted devices.

Hybrid meshes (TPU multislice, GPU multi-node): `mesh.dcn_<axis>` ways of an axis cross the slow network
between granules (TPU slices, else processes), the rest stay inside one; each granule holds an ICI block laid
out by `mesh_utils.create_device_mesh`. BUILD.md says which axes belong where.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain.errors import ConfigError

AXES = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")

_TP = {"q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": ("tensor", "pipeline")}
# Stacked layers and pipeline buffers ("layers", "stages") live on their stage; experts on the expert axis;
# activations' sequence dimension ("seq") on the sequence axis. Size-1 axes drop out, so every preset has them.
# The vocabulary tables are not pipelined, so they are split over `pipeline` along the vocab: otherwise every
# stage would hold (and Adam) both whole tables and compute the whole head and loss of its batch again.
_PP_EP_SP = {"layers": "pipeline", "stages": "pipeline", "experts": "expert", "seq": "sequence",
             "vocab": "pipeline"}
# Under fsdp an expert weight [E, d, f] is split over its experts, not its d_model: gathered along the leading
# dim, it arrives in the layout the grouped matmuls read, where gathered along d XLA:GPU transposed every expert
# weight and its gradient for every layer and microbatch (docs/models.md). Its activations stay on `expert`.
_EXPERTS_FSDP = {"experts": ("expert", "fsdp"), "act_experts": "expert"}
# Logical axis -> mesh axis (or tuple of mesh axes). Unlisted logical axes are replicated.
PRESETS: dict[str, dict[str, str | tuple[str, ...]]] = {
    "dp": {"batch": ("data", "expert"), **_PP_EP_SP},
    "fsdp": {"batch": ("fsdp", "expert"), "embed": "fsdp", **_PP_EP_SP, **_EXPERTS_FSDP},
    "fsdp_tp": {"batch": ("fsdp", "expert"), "embed": "fsdp", **_PP_EP_SP, **_TP, **_EXPERTS_FSDP},
    "dp_fsdp_tp": {"batch": ("data", "fsdp", "expert"), "embed": "fsdp", **_PP_EP_SP, **_TP, **_EXPERTS_FSDP},
    # Long context: the weights split over sequence too (ZeRO-3 over fsdp x sequence), so sequence 8 holds what
    # fsdp 8 would; XLA:GPU reduce-scatters their gradients over both. With data > 1 it sums the vocabulary
    # tables' gradients whole over data first (docs/parallelism.md), so the other presets keep them off sequence.
    "fsdp_seq": {"batch": ("fsdp", "expert"), "embed": ("fsdp", "sequence"), **_PP_EP_SP, **_EXPERTS_FSDP},
}
# Activations use their own names ("act_embed", "act_mlp", ...) so that FSDP shards the weights' "embed"
# dimension without also sharding the activations' hidden dimension. By default an activation axis
# follows its parameter twin (tensor parallelism); "act_embed" is unmapped unless a table maps it.
_ACT_TO_PARAM = {"act_heads": "q_heads", "act_kv_heads": "kv_heads", "act_mlp": "mlp", "act_vocab": "vocab",
                 "act_experts": "experts"}


# The config's `mesh` group. -1 = all remaining devices. `rules` is a preset name (PRESETS) or an explicit table
# such as "batch=data+fsdp,embed=fsdp,mlp=tensor" (unlisted logical axes are replicated). `dcn_<axis>` (hybrid
# meshes: TPU multislice, GPU multi-node): how many of that axis's ways cross the slow network between slices or
# nodes (see above for which axes belong there).
CONFIG = dict(data=-1, pipeline=1, fsdp=1, expert=1, sequence=1, tensor=1, rules="dp_fsdp_tp",
              dcn_data=1, dcn_pipeline=1, dcn_fsdp=1, dcn_expert=1, dcn_sequence=1, dcn_tensor=1)


def check_config(mesh_cfg, num_devices: int) -> tuple[dict, dict, dict]:
    """(shape, rules, dcn) of the `mesh` group for `num_devices`; ConfigError naming the first bad field."""
    try:
        shape = resolve_shape(mesh_cfg, num_devices)
        rules = resolve_rules(mesh_cfg.rules)
        dcn = resolve_dcn(mesh_cfg, shape)
    except (ValueError, TypeError) as e:
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field if field.startswith("mesh") else "mesh", reason or str(e)) from None
    unused = unused_axes(shape, rules)
    if unused:
        raise ConfigError(f"mesh.{unused[0]}", f"size {shape[unused[0]]} but mesh.rules={mesh_cfg.rules!r} "
                          f"maps nothing to {unused[0]!r}; use a preset that does (e.g. 'dp_fsdp_tp')")
    return shape, rules, dcn


def resolve_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Fills in the one -1 axis and checks the product. Raises ValueError naming the axis."""
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}  # axes a caller leaves out are size 1
    for axis, n in sizes.items():
        if n == 0 or n < -1:
            raise ValueError(f"mesh.{axis}: must be a positive size or -1, got {n}")
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1:
        raise ValueError(f"mesh.{free[1]}: only one axis may be -1 (also {free[0]})")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh.{free[0]}: -1 cannot fill {num_devices} devices, the other axes multiply "
                             f"to {fixed}")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        shape = " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "1"
        raise ValueError(f"mesh.data: mesh {shape} has {fixed} devices but JAX sees {num_devices}")
    return sizes


def resolve_rules(rules) -> dict[str, tuple[str, ...]]:
    """A preset name, a table string "logical=axis+axis,...", or a mapping -> {logical: mesh axes}."""
    if isinstance(rules, str) and "=" in rules:
        pairs = [item.split("=", 1) for item in rules.replace(" ", "").split(",") if item]
        rules = {name: tuple(a for a in axes.split("+") if a) for name, axes in pairs}
    elif isinstance(rules, str):
        if rules not in PRESETS:
            raise ValueError(f"mesh.rules: unknown preset {rules!r}; choose one of {sorted(PRESETS)}")
        rules = PRESETS[rules]
    table = dict(rules.items()) if hasattr(rules, "items") else dict(rules)
    out = {}
    for logical, axes in table.items():
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"mesh.rules: {logical!r} maps to unknown mesh axis {unknown[0]!r}")
        out[str(logical)] = axes
    for act, param in _ACT_TO_PARAM.items():
        out.setdefault(act, out.get(param, ()))
    return out


def unused_axes(shape: Mapping[str, int], rules: Mapping[str, tuple[str, ...]]) -> list[str]:
    used = {a for axes in rules.values() for a in axes}
    return [a for a in AXES if shape[a] > 1 and a not in used]


def resolve_dcn(sizes: Mapping[str, int], shape: Mapping[str, int]) -> dict[str, int]:
    """{axis: DCN ways} from `mesh.dcn_<axis>` (default 1); each must divide its resolved axis size."""
    dcn = {}
    for axis in AXES:
        n = sizes.get(f"dcn_{axis}", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"mesh.dcn_{axis}: must be a positive integer, got {n!r}")
        if shape[axis] % n:
            raise ValueError(f"mesh.dcn_{axis}: {n} does not divide mesh.{axis}={shape[axis]}")
        dcn[axis] = n
    return dcn


def granules(devices: Sequence, count: int) -> list[list]:
    """The devices split into `count` granules: TPU slices, else processes; one slice and process of CPU
    devices (tests) splits into consecutive blocks. ValueError naming mesh.dcn_* when they do not match."""
    if count == 1:  # not a hybrid mesh: the granules do not matter
        return [list(devices)]
    for attr, kind in (("slice_index", "slices"), ("process_index", "processes")):
        keys = sorted({getattr(d, attr, None) for d in devices} - {None})
        if len(keys) > 1:
            if len(keys) != count:
                raise ValueError(f"mesh.dcn_data: the dcn sizes multiply to {count}, but the devices form "
                                 f"{len(keys)} granules ({kind}); on GPU run one process per node")
            return [[d for d in devices if getattr(d, attr) == k] for k in keys]
    if devices[0].platform == "cpu" and len(devices) % count == 0:
        block = len(devices) // count
        return [list(devices[i * block:(i + 1) * block]) for i in range(count)]
    raise ValueError(f"mesh.dcn_data: the dcn sizes multiply to {count}, but the devices form one slice in one "
                     f"process; dcn axes need several")


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None,
              dcn: Mapping[str, int] | None = None) -> Mesh:
    """The mesh over `devices` (default all); with `dcn` (resolve_dcn) a hybrid DCN x ICI layout."""
    devices = jax.devices() if devices is None else devices
    axis_types = (AxisType.Auto,) * len(AXES)
    shape = {a: shape.get(a, 1) for a in AXES}
    if not dcn or math.prod(dcn.values()) == 1:
        return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, axis_types=axis_types, devices=devices)
    dcn_shape = [dcn.get(a, 1) for a in AXES]
    ici_shape = [shape[a] // n for a, n in zip(AXES, dcn_shape)]
    # jax's create_hybrid_device_mesh does this for slices or processes; we also need the CPU blocks.
    blocks = np.empty(dcn_shape, dtype=object)
    for index, granule in zip(np.ndindex(*dcn_shape), granules(devices, math.prod(dcn_shape))):
        blocks[index] = mesh_utils.create_device_mesh(ici_shape, granule, allow_split_physical_axes=True)
    return Mesh(np.block(blocks.tolist()), AXES, axis_types=axis_types)


def spec_for(shape: Sequence[int], names: Sequence[str | None] | None, mesh: Mesh,
             rules: Mapping[str, tuple[str, ...]]) -> P:
    """PartitionSpec for an array of `shape` whose dims carry logical `names`.

    Mesh axes already taken by an earlier dimension are left out of a later one's mapping (experts on
    `expert`, then the batch on the rest of its axes). A mapping that does not divide its dimension keeps its
    longest leading run of axes that does (a 50257 vocab over tensor x pipeline: none; 32002 over 2 x 4: tensor
    only); a mapping left empty replicates that dimension. An array with no names at all falls back to FSDP on
    its largest dimension that the fsdp axis divides.
    """
    if names is None:
        return _fsdp_fallback(shape, mesh, rules)
    return P(*[axes[0] if len(axes) == 1 else axes or None for axes in dim_axes(shape, names, mesh.shape, rules)])


def dim_axes(shape: Sequence[int], names: Sequence[str | None], mesh_shape: Mapping[str, int],
             rules: Mapping[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The mesh axes each dimension is split over (() = replicated), by `spec_for`'s rules."""
    taken: set[str] = set()
    out = []
    for size, name in zip(shape, names):
        axes = tuple(a for a in rules.get(name, ()) if mesh_shape[a] > 1 and a not in taken) if name else ()
        while axes and size % math.prod(mesh_shape[a] for a in axes):
            axes = axes[:-1]
        taken |= set(axes)
        out.append(axes)
    return out


def _fsdp_fallback(shape, mesh, rules) -> P:
    fsdp_active = any("fsdp" in axes for axes in rules.values()) and mesh.shape["fsdp"] > 1
    spec = [None] * len(shape)
    if fsdp_active:
        candidates = [i for i, n in enumerate(shape) if n % mesh.shape["fsdp"] == 0]
        if candidates:
            spec[max(candidates, key=lambda i: shape[i])] = "fsdp"
    return P(*spec)


def tree_shardings(abstract_tree, logical_tree, mesh: Mesh, rules) -> object:
    """NamedShardings for a pytree of abstract arrays, given a matching tree of logical names (or None)."""
    # The names tree leads: its leaves (a PartitionSpec of names, or None) sit where the arrays are.
    return jax.tree.map(
        lambda names, x: NamedSharding(mesh, spec_for(x.shape, names, mesh, rules)),
        logical_tree, abstract_tree, is_leaf=lambda n: n is None or isinstance(n, P))


# --- Activation constraints -------------------------------------------------------------------------
# The model calls `constrain(x, names)`; it is a no-op unless a step function is being traced inside
# `activation_sharding(mesh, rules)`. This keeps the model free of mesh plumbing.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Mapping[str, tuple[str, ...]]):
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_sharding() -> tuple[Mesh, Mapping[str, tuple[str, ...]]] | None:
    """(mesh, rules) while tracing inside `activation_sharding`, else None."""
    return _ACTIVE.get()


def compile_platform() -> str:
    """The platform the computation being traced compiles for: the active mesh's devices' ("cpu", "gpu", "tpu"),
    else this process's default backend. An ahead-of-time compile for GPUs on a CPU host (`jaxtrain.tools.plan
    --compiler gpu`) then traces the GPU's forms, not the CPU's (`jaxtrain.models.cpu_bf16`)."""
    active = _ACTIVE.get()
    return active[0].devices.flat[0].platform if active is not None else jax.default_backend()


def split_ways(name: str) -> int:
    """Into how many pieces the active rules split the logical axis `name` (1 outside `activation_sharding`)."""
    active = _ACTIVE.get()
    if active is None:
        return 1
    mesh, rules = active
    return axis_ways(mesh.shape, rules, name)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` laid out by the logical `names` of its dims. Names for only the leading dims leave the rest to XLA
    (unconstrained), so a sharding set on them elsewhere (e.g. inside a pipeline stage) survives."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = spec_for(x.shape[:len(names)], names, mesh, rules)
    spec = P(*spec, *[P.UNCONSTRAINED] * (x.ndim - len(names)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# --- Per-replica copies -----------------------------------------------------------------------------------
# A gradient summed over several pieces of work (microbatches, pipeline ticks) on rows split over `data` is a
# partial sum per replica, and XLA reduces it over `data` after every piece. Giving each replica its own copy of
# the weights (a broadcast sharded over the replica axes: no data moves) and running its rows with it under a
# vmap keeps every piece's gradient local; the copies' gradients are summed once, where the copies were made.
def per_replica(x: jax.Array, axes: tuple[str, ...], dim: int = 0, leading=None) -> jax.Array:
    """`x` with a new dimension `dim` holding one copy per replica along mesh `axes` (inside
    `activation_sharding`). `leading`: the specs of the dims before `dim` (default: left to XLA)."""
    mesh = _ACTIVE.get()[0]
    x = jax.numpy.expand_dims(x, dim)
    x = jax.numpy.broadcast_to(x, (*x.shape[:dim], math.prod(mesh.shape[a] for a in axes), *x.shape[dim + 1:]))
    leading = (P.UNCONSTRAINED,) * dim if leading is None else tuple(leading)
    spec = P(*leading, axes, *[P.UNCONSTRAINED] * (x.ndim - dim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# Mesh axes an enclosing vmap holds (spmd_axis_name): `per_shard`'s shard_map must make them manual too, or
# jax 0.10 fails to batch it (sdy.manual_computation's shapes disagree).
_HELD: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_held_axes", default=frozenset())


def spmd_vmap(fn, axes, **kwargs):
    """jax.vmap(fn, spmd_axis_name=axes, **kwargs), `axes` (None, a name or names) recorded as held while fn
    traces."""
    held = frozenset((axes,) if isinstance(axes, str) else axes or ())

    def inner(*args):
        token = _HELD.set(_HELD.get() | held)
        try:
            return fn(*args)
        finally:
            _HELD.reset(token)

    return jax.vmap(inner, spmd_axis_name=axes, **kwargs)


def _without(rules, axes: tuple[str, ...]) -> dict:
    """The rules with `axes` dropped from every mapping: inside a vmap or shard_map that holds them."""
    return {name: tuple(a for a in mapped if a not in axes) for name, mapped in rules.items()}


def over_replicas(fn, axes: tuple[str, ...]):
    """fn(copies, rows) vmapped over the replica dim (0) of both; inside, the rules no longer map the replica
    axes (the vmap holds them), so activation constraints name the rest. `rows` leaves are [batch, ...]."""
    mesh, rules = _ACTIVE.get()
    n = math.prod(mesh.shape[a] for a in axes)
    inner_rules = _without(rules, axes)

    def inner(copy, part):
        with activation_sharding(mesh, inner_rules):
            return fn(copy, part)

    def run(copies, rows):
        split = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), rows)
        return spmd_vmap(inner, axes)(copies, split)

    return run


def per_shard(fn, name: str, dim: int = 0, keep: tuple[str, ...] = ()):
    """fn(shared, *args) run on each shard of dim `dim` of `args` (arrays) on its own, the shards being those the
    rules cut the logical axis `name` into (mesh axes in `keep` not counted: fn sees them as before). A
    shard_map makes those mesh axes manual, so work that would gather the whole dim (a sort, say) stays on each
    shard's devices, and a kernel XLA cannot partition (a Pallas custom call) sees one shard's rows. `shared` (a
    pytree of arrays, e.g. weights) reaches every shard whole: XLA gathers what those axes split (fsdp's
    all-gather) and sums its gradients over them. fn's outputs keep the dim; fn must not communicate. Outside
    `activation_sharding` (read when called, so these nest), or if the shards do not divide the dim evenly,
    this is fn itself."""
    def run(shared, *args):
        active = _ACTIVE.get()
        if active is None:
            return fn(shared, *args)
        mesh, rules = active
        axes = tuple(a for a in rules.get(name, ()) if mesh.shape[a] > 1 and a not in keep)
        n = math.prod(mesh.shape[a] for a in axes)
        if n == 1 or any(x.shape[dim] % n for x in args):
            return fn(shared, *args)
        inner_rules = _without(rules, axes)
        dtypes = jax.tree.map(lambda a: a.dtype, shared)
        if compile_platform() == "cpu":
            # XLA:CPU sums a bf16 all-reduce in f32, and crashes widening the one that sums `shared`'s gradients
            # in a partial-manual shard_map ("Invalid binary instruction opcode copy", jax 0.10.2): widen first.
            shared = jax.tree.map(_widened, shared)

        def inner(shared, *parts):
            with activation_sharding(mesh, inner_rules):
                return fn(jax.tree.map(lambda a, dtype: a.astype(dtype), shared, dtypes), *parts)

        spec = P(*[None] * dim, axes)
        return jax.shard_map(inner, mesh=mesh, in_specs=(P(), *[spec] * len(args)), out_specs=spec,
                             axis_names=set(axes) | _HELD.get(), check_vma=False)(shared, *args)

    return run


def _widened(a):
    """a in f32 if it is a narrower float."""
    return a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4 else a


def split_microbatches(x, n: int):
    """[B, ...] -> [n, B/n, ...] taking every n-th row, so each microbatch spans every data shard."""
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """Sharding of [batch, seq] input arrays (config validation guarantees the batch divides)."""
    axes = tuple(a for a in rules.get("batch", ()) if mesh.shape[a] > 1)
    return NamedSharding(mesh, P(axes or None, None))


def axis_ways(shape: Mapping[str, int], rules, name: str) -> int:
    """How many ways the rules split the logical axis `name` on a mesh of `shape`."""
    return math.prod(shape[a] for a in rules.get(name, ()))


def replica_axes(shape: Mapping[str, int], rules) -> tuple[str, ...]:
    """The leading mesh axes (> 1) of the batch mapping that split no parameter: pure replicas (`data` in the
    presets). A gradient summed over many microbatches needs reducing over them only once. Names other than
    "batch", "seq" and "act_*" name parameter dimensions ("experts" claims `expert` even in a dense model)."""
    param_axes = {a for name, axes in rules.items() if name not in ("batch", "seq") and not name.startswith("act_")
                  for a in axes}
    out = []
    for axis in (a for a in rules.get("batch", ()) if shape[a] > 1):
        if axis in param_axes:
            break
        out.append(axis)
    return tuple(out)


def data_parallel_size(shape: Mapping[str, int], rules) -> int:
    """How many ways the global batch is split."""
    return axis_ways(shape, rules, "batch")
