"""`jaxtrain plan --config configs/X.py [--devices N] [--backend cpu|gpu|tpu] [--compiler auto|cpu|gpu]
[--config.a.b=v ...]`

Does this fit, and how fast could it go? Answered before anyone books a cluster: the train step is
compiled ahead of time (shapes only, no parameter is ever allocated) for N devices, and the compiled
program is read back next to an analytic estimate.

What is compiled is exactly what `train.run` compiles: `train.build_trainer` and its abstract state, lowered
with an abstract batch, then `.compile()`. By default it is compiled on N *fake CPU devices*
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`, set before jax is imported). `--backend` names the
*target*: it decides how `auto` dtypes resolve (`config.model_config`: bf16 compute on gpu/tpu) and
which peak FLOP/s is quoted (`metrics.PEAK_FLOPS` by `--device_kind`; on cpu the measured matmul peak of
this machine, which fake devices share). Shapes, shardings, collectives and their byte counts are the
target's; fusion, buffer reuse and collective combining are the CPU compiler's. In particular the CPU
compiler runs bf16 matmuls in f32 and keeps f32 activations, so for a bf16 target the compiled temporaries
are about the f32 figure (the report prints the analytic temporaries both ways), and it has no
reduce-scatter: it all-reduces and slices, which the GPU/TPU pipelines turn into a reduce-scatter, so the
report counts an all-reduce whose every result is only sliced to 1/n afterwards as a reduce-scatter.
`--compiler gpu` (the default for `--backend gpu` where the CUDA PJRT plugin is installed) compiles with XLA:GPU
instead, for N described GPUs of `--device_kind` (`jaxtrain.tools.plan.topology`, no GPU needed): then fusion, buffer
reuse, collectives and scheduling are the GPU compiler's, without its autotuning.

From Python: `plan(config, num_devices, backend) -> dict` (the process must already see N CPU devices),
`format_report(result)` for the table, `parse_replica_groups` / `collectives` for HLO text.

Memory, per device (bytes, `p` = param dtype bytes, `a` = compute dtype bytes)
----------------------------------------------------------------------------
Sharding-derived: for every state leaf, the bytes of the shard each device holds
(`sharding.devices_indices_map`), summed per device, max over devices.
Compiled: `compiled.memory_analysis()` (argument / output / alias / temp / generated code), if the backend
gives it; peak = argument + output - alias + temp.
Analytic, as in the ZeRO paper's tables, for each parameter tensor with n elements and `shards` = the
product of the mesh axes the rule table maps its dimensions to (an axis that does not divide, or is taken
by an earlier dimension, does not count):
  params     = sum n * p / shards
  gradients  = params (same sharding and dtype)
  optimizer  = AdamW: 2 moments * params  +  4 bytes per int32 step counter in the optax chain
  arguments  = params + optimizer + step + batch (3 int32 arrays [B, S] split over the batch axes)
  temporaries= gradients + L' * act_layer(policy) * t + logits, L' = L, or under a pipeline the layer runs
    ticks * L / (P * R * M) of a device (a stage keeps its layers' activations for every tick; symbols below)
    t = tokens per device per microbatch = B / (microbatches * dp) * S / Q, dp = product of the batch axes,
    Q = product of the sequence axes (each layer then also keeps K and V gathered whole, (1 - 1/Q) of them more),
    T = tensor axis size, h/kv heads, hd head dim, f = d_ff, d = d_model, S = seq_len, per token:
    act_layer(none | everything_saveable) = a*(4d + (h+2kv)*hd/T + h*hd/T + 4f/T) + 8d + (8+a)*h*S/T
      (norm inputs and their f32 copies, q/k/v, attention scores and probabilities in f32 and the
       probabilities in the compute dtype, attention output, gate, up, silu(gate), hidden)
    act_layer(full) = a*d  (the layer input), plus one layer's `none` activations while it is recomputed
    act_layer(dots_saveable) = a*(3d + (h+2kv)*hd/T + h*hd/T + 2f/T) + a*h*S/T
    act_layer(dots_with_no_batch_dims_saveable) = a*(3d + (h+2kv)*hd/T + 2f/T)
    with a fused attention kernel (model.attention_impl=cudnn) the scores terms become 4*h/T (f32 softmax
    statistics per query) under none, and 0 under dots_saveable
    logits = t * V/V_ways * (a + 4 + (4 if a < 4))  (logits, their f32 copy for bf16, f32 softmax); with the
      fused chunked loss (model.loss_chunk_tokens > 0) t_chunk * V/V_ways * (8 + (a if a < 4)) for one chunk's
      f32 logits, f32 gradient and its compute-dtype copy
  These are the saved-for-backward tensors (Korthikanti et al. 2022 count the same way); XLA's buffer
  reuse and fusion move the compiled figure by tens of percent, which the ratio column shows. Against the
  compiled growth per layer (f32 activations, one device): configs/bench_cpu.py with remat none, 2 vs 4
  layers, the formula is about 10% under; configs/plan_1b.py with dots_with_no_batch_dims_saveable
  (f32 activations, as the CPU compiler keeps them), 9 vs 18 layers, about 5% over.

Compute
-------
model FLOPs per step = transformer.train_flops_per_token(cfg, S) * B * S (6 N_matmul + causal attention;
remat recomputation is not useful work and not counted).
XLA `cost_analysis()["flops"]`: per device, times N; XLA counts a while-loop body ONCE, so with scanned
layers it undercounts by about (L-1)/L of the layer FLOPs.
HLO dot FLOPs: 2 * prod(output dims) * prod(contracting dims) of every dot/convolution in the compiled
text, times how often its computation runs (while bodies by trip count): this one counts remat
recomputation and the full (non-causal) attention product, so it sits above the model FLOPs.
ideal step time = model FLOPs / (peak per device * N * MFU); tokens/s = B * S / step time.

Collectives
-----------
Read from `compiled.as_text()`: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
their async `-start` forms (the `-done` gives the result shape) and ops inside async wrappers. Every
computation's multiplicity is the sum over its call sites of the caller's multiplicity, times the trip
count for a while body (`known_trip_count` in the backend config, else the integer bound of the loop
condition's compare, else 1 and the op is flagged `trip_count_unknown`); both branches of a conditional
count once. replica_groups (explicit `{{0,1},{2,3}}`, iota `[2,4]<=[4,2]T(1,0)`, or
`mesh[...]{axes}` with optional `device_ids=`) and collective-permute `source_target_pairs` are turned
into groups of partition ids; partition id i is the i-th device of the mesh (row-major), so a group's
mesh axes are those along which its members' coordinates differ. A group that is not a full product of
those axes is flagged `partial`.
bytes = per device payload per step: all-reduce / all-to-all / collective-permute: the result;
all-gather: the gathered result; reduce-scatter: result * group size (the buffer being reduced); an
all-reduce whose results are all only dynamic-sliced to 1/n (through bitcast/copy/convert and fusions)
counts as a reduce-scatter of its full result (tuple all-reduces are split per element); one sliced over part
of its axes only (a gradient reduced over data x fsdp and kept as its fsdp shard) as a reduce-scatter over that
part and an all-reduce of the slice over the rest, which is how GPU's AllReduceSplitter pass compiles it (the
slice's size names the part; parts of one size: the one without replica axes, then the earlier mesh axes).
wire bytes = per device ring traffic: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n,
all-to-all (n-1)/n of bytes, collective-permute bytes.
Analytic, per parameter with shard axes Sp, batch axes Bt (mesh axes > 1 that split the batch),
m = microbatches (the gradient accumulator is sharded like the params, so every microbatch reduces, except over
the replica axes, see R):
  G = Sp & Bt (ZeRO-3 / FSDP): all-gather the params, n*p/prod(Sp - G) each time: in the forward, and again in
    the backward for the head (its input gradient) and for the layers unless remat is "none" (the forward's copy
    is kept), never for the lookup table (its gradient is a scatter); m times, or once a step under a pipeline
    or per-replica accumulation (the weights do not change between ticks or microbatches); reduce-scatter the
    grads, m * n*p/prod(Sp - G)  (the ZeRO paper's 3x, where everything is gathered twice);
  R = Bt - Sp (data parallel): all-reduce the grad shard over R, m * n*p/shards  (ring: 2(n-1)/n on wire);
    over the replica axes (mesh.replica_axes, `data` in the presets) once a step when m > 1 or the layers are
    pipelined (each replica accumulates on its own copy, mesh.per_replica), unless the model is a mixture of
    experts with m > 1 (its balance loss needs batch-wide means);
  tensor (Megatron, no sequence parallelism): all-reduce t*d*a 4 times per layer (2 forward, 2 backward;
    6 with remat=full) per microbatch.
  vocab axes (tensor and pipeline in the presets; V_ways ways): all-reduce t*d*a twice per microbatch, the
    embedding lookup's partial rows and the head's input gradient, and t*3*4 for the loss (each token's f32 max,
    sum of exponentials and target logit). Per-layer collectives count the
    layer runs of a device: L, or with a pipeline ticks * L / (P * R * M) (each tick runs L/(P*R) layers on one
    microbatch, bubble ticks included; symbols below).
  experts: an axis that splits a dimension named "experts" owns those weights; it is left out of G (the
    tokens travel, the weights never do).
  tied embeddings: the table's G reduce-scatters and R and Q all-reduces count twice (XLA reduces the lookup's
    and the head's gradients one after the other), except where it is reduced once a step (per-replica copies).
  sequence axes Q (context parallelism), rows = B / (m * dp) sequences per device: every gradient shard is
    all-reduced over Q too (XLA reduces over R, then over Q); each layer all-gathers K and V whole,
    2 * rows * S * kv*hd/T * a, and reduce-scatters their gradients (the same bytes); the backward gathers again
    what remat drops (both under `full`, K under the dots policies: RoPE is not a dot).
  expert axes (MoE): the token buffer [experts, rows, groups, capacity, d] goes to its experts and back, forward
    and backward: 4 all-to-alls of experts * rows * groups * capacity * d * a per layer and microbatch (6 with
    remat=full); groups = a device's routing groups of a sequence (model.moe_group_tokens; 1 for whole
    sequences), capacity per group.
  pipeline (P stages, M microbatches, R repeats, ticks = R*M + P - 1): over the replica axes (mesh.replica_axes,
    `data` in the presets) a pipelined layer's gradient is reduced once per microbatch (each replica keeps its own
    copy of the stage weights through the tick loop); over the other batch axes it counts ticks / R times (each
    tick adds to the chunk every stage ran, and XLA reduces it there); each tick hands every stage's microbatch
    on, rows/M * S/Q * (3*d*a + 8) (x and its int32 positions and segment ids forward, x's gradient back, and x
    once more: the backward loop re-sends the forward shift);
    the last stage's output is broadcast from stage 0 and its gradient comes back, 2 * rows * S/Q * d * a
    (all-reduce over pipeline). The stacked layers are kept in the pipeline's order (pipeline_parallel.layer_order),
    so no weight moves between stages.
The fused loss (model.loss_chunk_tokens) computes the head's gradient in the forward: an untied head is
gathered once per microbatch, not twice.
Where XLA departs from this (the ratio column shows it):
FSDP with gradient accumulation and no replica axis: XLA keeps some gathered weights from one microbatch to the
next (configs/tiny.py as fsdp 8 with 2 microbatches: all-gathers 1.5x over; configs/plan_1b.py: 1.08x).
It also combines small collectives into tuples: compare bytes, not counts. MoE with
remat none: 5 all-to-alls per layer, not 4 (it also moves a routing tensor's gradient). For a bf16 target the
CPU compiler moves f32 activations (2x the activation collectives). MoE x sequence with whole-sequence routing
groups (model.moe_group_tokens = 0): the dispatch contracts over the split sequence, an all-reduce of the token
buffer over `sequence` that is not predicted (groups that fit a sequence shard avoid it). Within 2%
(tests/test_plan.py) on data x sequence, data x expert (remat full), data x pipeline (gpipe and circular), data
with gradient accumulation, data x fsdp and fsdp x expert. The FSDP gathers are exact for configs/bench_cpu.py
as fsdp 8 (remat none and full), data 2 x fsdp 4 (with and without per-replica accumulation), fsdp 2 x sequence
4, fsdp x tensor, data x fsdp x pipeline and an MoE over fsdp x expert x tensor (2026-11-24).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from jaxtrain.observe import hlo as hlo_lib
from jaxtrain.tools.plan import topology as gpu_topology

BACKENDS = ("cpu", "gpu", "tpu")
DEFAULT_DEVICE_KIND = {"gpu": "H100", "tpu": "TPU v5p"}
# Device memory per device in GiB (vendor figures; the A100 is its 80 GB model), for the "fits" line.
HBM_GIB = {"h100": 80 * 1e9 / 2**30, "h200": 141 * 1e9 / 2**30, "b200": 192 * 1e9 / 2**30,
           "a100": 80 * 1e9 / 2**30, "l4": 24 * 1e9 / 2**30, "tpu v4": 32, "tpu v5 lite": 16, "tpu v5e": 16,
           "tpu v5p": 95, "tpu v5": 95, "tpu v6 lite": 32, "tpu v6e": 32}
COLLECTIVES = hlo_lib.COLLECTIVES


class PlanError(ValueError):
    """A bad planner input; `str()` is '<field>: <reason>' like config.ConfigError."""


def _error(field: str, reason: str):
    from jaxtrain.config import ConfigError  # noqa: PLC0415 (imports jax)
    return ConfigError(field, reason)


# ===== HLO text: computations, instructions, shapes ===================================================


_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "convert", "get-tuple-element")


def _only_sliced(module, name: str, n: int, depth: int = 0) -> bool:
    """Whether every use of the value `name` keeps 1/n of it through a dynamic-slice: directly, through
    element-preserving ops (bitcast, copy, convert, ...), or inside fusions (a fusion's root continues at
    the fusion's users). That is an all-reduce + slice, which GPU/TPU pipelines turn into a reduce-scatter."""
    instr = module["by_name"].get(name)
    users = module["users"].get(name, [])
    if instr is not None and instr.get("root") and instr["comp"] in module["fusion_of"]:
        users = users + module["users"].get(module["fusion_of"][instr["comp"]]["name"], [])
    if not users or depth > 12:
        return False
    size = hlo_lib.numel(module["shapes"][name])
    for user, index in users:
        op = user["op"]
        if op == "dynamic-slice" and index == 0:
            if hlo_lib.numel(user["shape"]) * n != size:
                return False
        elif op in _PASS_THROUGH and index == 0:
            if hlo_lib.numel(user["shape"]) != size or not _only_sliced(module, user["name"], n, depth + 1):
                return False
        elif op == "fusion":
            called = re.search(r"\bcalls=%?([\w.\-]+)", user["rest"])
            params = [i for i in module["computations"].get(called.group(1), []) if i["op"] == "parameter"
                      and i["rest"].startswith(f"{index})")] if called else []
            if not params or not _only_sliced(module, params[0]["name"], n, depth + 1):
                return False
        else:
            return False
    return True


def _scattered_elements(module, instr, n: int) -> list[bool]:
    """For each result of an all-reduce (a tuple has several): is it only sliced to 1/n afterwards?"""
    if not instr["shape"].startswith("("):
        return [_only_sliced(module, instr["name"], n)]
    elements = hlo_lib.tuple_elements(instr["shape"])
    out = [False] * len(elements)
    for user, _ in module["users"].get(instr["name"], []):
        if user["op"] == "get-tuple-element":
            index = int(re.search(r"\bindex=(\d+)", user["rest"]).group(1))
            out[index] = _only_sliced(module, user["name"], n)
    return out


def _scatter_axes(module, result, axes: tuple[str, ...], mesh_shape: dict, replica_axes: tuple[str, ...],
                  ) -> tuple[tuple[str, ...], list[bool]]:
    """For an all-reduce over `axes` whose results are not only sliced over all of them: the part of `axes` over
    which they are (a gradient reduced over data x fsdp and kept as its fsdp shard), and which results. The
    slice's size gives the part's size; equal sizes are told apart by preferring parts without `replica_axes`,
    then the earlier mesh axes (the HLO does not name the axes a slice splits)."""
    import itertools  # noqa: PLC0415
    parts = [part for k in range(1, len(axes)) for part in itertools.combinations(axes, k)]
    parts.sort(key=lambda part: (any(a in replica_axes for a in part), [axes.index(a) for a in part]))
    for part in parts:
        sliced = _scattered_elements(module, result, math.prod(mesh_shape[a] for a in part))
        if any(sliced):
            return part, sliced
    return (), []


# ===== Replica groups -> mesh axes =====================================================================

def _iota(reshape: list[int], perm: list[int] | None):
    import numpy as np  # noqa: PLC0415
    array = np.arange(math.prod(reshape)).reshape(reshape)
    return array.transpose(perm) if perm else array


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
    """The groups of partition ids in an HLO `replica_groups=` value, in any of its printed forms:

    explicit   {{0,1},{2,3}}        ({} = one group of all `num_devices`)
    iota       [2,4]<=[8]   or  [4,2]<=[4,2]T(1,0)   (iota over the reshape dims, transposed, as [groups, size])
    mesh axes  mesh['a'=4,'b'=2] {'a'}   (optional `, device_ids=([2,4]T(1,0))` or an id list; a sub-axis
               'a':(pre)size groups over that part of the axis)
    """
    import numpy as np  # noqa: PLC0415
    text = text.strip().rstrip(",")
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            return [list(range(num_devices))] if num_devices else []
        return [hlo_lib.ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        groups, size = hlo_lib.ints(m.group(1))
        array = _iota(hlo_lib.ints(m.group(2)), hlo_lib.ints(m.group(3)) if m.group(3) else None)
        return array.reshape(groups, size).tolist()
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = m.group(2)
        if ids:
            it = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$", ids.strip())
            devices = (_iota(hlo_lib.ints(it.group(1)), hlo_lib.ints(it.group(2)) if it.group(2) else None) if it
                       else np.array(hlo_lib.ints(ids)))
            devices = devices.reshape(sizes)
        else:
            devices = np.arange(math.prod(sizes)).reshape(sizes)
        # A sub-axis 'a':(pre)size is the middle factor of axis a reshaped to [pre, size, rest] (major to
        # minor), as in XLA's MeshAxesReplicaGroupList: split every axis at all its references' cuts.
        refs = [(n, int(p) if p else None, int(s) if s else None)
                for n, p, s in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", m.group(3)) if n]
        split, owner = [], []  # factor sizes, and (axis, first pre-size it covers)
        for name, size in zip(names, sizes):
            cuts = sorted({1, size} | {p for n, p, s in refs if n == name and p}
                          | {p * s for n, p, s in refs if n == name and p})
            for lo, hi in zip(cuts, cuts[1:]):
                split.append(hi // lo)
                owner.append((name, lo))
        group_dims = []
        for name, pre, size in refs:
            group_dims += [i for i, (n, lo) in enumerate(owner)
                           if n == name and (pre is None or pre <= lo < pre * size)]
        rest = [i for i in range(len(split)) if i not in group_dims]
        size = math.prod(split[i] for i in group_dims)
        return devices.reshape(split).transpose(rest + group_dims).reshape(-1, size).tolist()
    raise ValueError(f"unrecognised replica_groups {text[:80]!r}")


def groups_to_axes(groups, mesh_shape: dict) -> tuple[tuple[str, ...], bool]:
    """Mesh axes along which the members of the groups differ, in mesh order; and whether every group is
    exactly a full product of those axes (False = the groups cover part of an axis)."""
    import numpy as np  # noqa: PLC0415
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    varying: set[str] = set()
    exact = True
    for group in groups:
        if len(group) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        axes = [names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1]
        varying |= set(axes)
        exact &= len(set(map(tuple, coords))) == math.prod(mesh_shape[a] for a in axes)
    return tuple(a for a in names if a in varying), exact


def _group_attr(rest: str) -> str | None:
    m = re.search(r"\breplica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)?\))?\s*\{[^}]*\}"
                  r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,\s]*\},?\s*)*\})", rest)
    return m.group(1) if m else None


def _op_groups(instr, kind: str, num_devices: int) -> list[list[int]] | None:
    """Partition-id groups of a collective (for collective-permute: its source != target pairs); None if the
    replica_groups form is unknown."""
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", instr["rest"])
        return [p for p in map(hlo_lib.ints, re.findall(r"\{(\d+,\d+)\}", pairs.group(1))) if p[0] != p[1]] \
            if pairs else []
    attr = _group_attr(instr["rest"])
    if attr is None:  # absent = all devices in one group
        return None if "replica_groups=" in instr["rest"] else [list(range(num_devices))]
    try:
        return parse_replica_groups(attr, num_devices)
    except ValueError:
        return None


_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


def collectives(hlo, mesh_shape: dict, replica_axes: tuple[str, ...] = ()) -> list[dict]:
    """Every collective in compiled HLO (text or `hlo_lib.parse_hlo`'s result), one dict per op (an all-reduce whose
    results are partly sliced afterwards gives two, or three): kind, axes, partial, group_size, count (executions
    per step), bytes and wire_bytes per device per step, as_all_reduce (a reduce-scatter the CPU compiler emitted
    as all-reduce + dynamic-slice). An all-reduce whose results are only sliced over part of its axes counts as a
    reduce-scatter over that part and an all-reduce of the slice over the rest (GPU's AllReduceSplitter rewrites
    it so); `replica_axes` (mesh.replica_axes) breaks ties between parts of one size. See the module docstring."""
    module = hlo_lib.parse_hlo(hlo) if isinstance(hlo, str) else hlo
    mult, unknown = hlo_lib.multiplicities(module)
    num_devices = math.prod(mesh_shape.values())
    done_of = {}  # start name -> its -done instruction
    for instrs in module["computations"].values():
        for instr in instrs:
            if instr["op"].endswith("-done") and hlo_lib.operands(instr):
                done_of[hlo_lib.operands(instr)[0]] = instr
    out = []
    for comp, instrs in module["computations"].items():
        for instr in instrs:
            op = instr["op"]
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in COLLECTIVES:
                continue
            result = done_of.get(instr["name"], instr) if op.endswith("-start") else instr
            groups = _op_groups(instr, kind, num_devices)
            if groups is None:  # a replica_groups form this parser does not know: counted on axes "?"
                axes, exact, size = ("?",), False, 2
            else:
                size = 2 if kind == "collective-permute" else max((len(g) for g in groups), default=1)
                if not groups or size < 2:
                    continue  # no traffic: every device alone, or sending to itself
                axes, exact = groups_to_axes(groups, mesh_shape)
            count = mult.get(comp, 0)
            common = {"axes": axes, "partial": not exact, "group_size": size, "count": count,
                      "name": instr["name"], "async": op.endswith("-start"), "trip_count_unknown": comp in unknown}
            # (kind, axes, group size, payload bytes, emitted as all-reduce + slice)
            parts = [(kind, axes, size, hlo_lib.shape_bytes(result["shape"]) * (size if kind == "reduce-scatter" else 1),
                      False)]
            if kind == "all-reduce":  # all-reduce + slice to 1/n = reduce-scatter (the CPU pipeline has none)
                elements = hlo_lib.tuple_elements(result["shape"]) if result["shape"].startswith("(") else [result["shape"]]
                scattered = _scattered_elements(module, result, size)
                rs = sum(hlo_lib.shape_bytes(e) for e, sc in zip(elements, scattered) if sc)
                split, partly = _scatter_axes(module, result, axes, mesh_shape, replica_axes) if (
                    exact and not all(scattered)) else ((), [])
                n = math.prod(mesh_shape[a] for a in split)
                partly = partly or [False] * len(elements)
                rs_part = sum(hlo_lib.shape_bytes(e) for e, sc, p in zip(elements, scattered, partly) if p and not sc)
                rest = tuple(a for a in axes if a not in split)
                parts = [p for p in (("all-reduce", axes, size, hlo_lib.shape_bytes(result["shape"]) - rs - rs_part, False),
                                     ("reduce-scatter", axes, size, rs, True),
                                     ("reduce-scatter", split, n, rs_part, True),
                                     ("all-reduce", rest, size // n, rs_part / n, True)) if p[3]]
            for k, op_axes, op_size, payload, as_all_reduce in parts:
                out.append(dict(common, kind=k, axes=op_axes, group_size=op_size, bytes=payload * count,
                                wire_bytes=_WIRE[k](op_size) * payload * count, as_all_reduce=as_all_reduce))
    return out


def summarize_collectives(ops: list[dict]) -> list[dict]:
    """Per (kind, axes): count, bytes, wire_bytes summed."""
    rows: dict[tuple, dict] = {}
    for op in ops:
        key = (op["kind"], op["axes"])
        row = rows.setdefault(key, {"kind": op["kind"], "axes": op["axes"], "count": 0, "bytes": 0.0,
                                    "wire_bytes": 0.0, "partial": False, "trip_count_unknown": False})
        row["count"] += op["count"]
        row["bytes"] += op["bytes"]
        row["wire_bytes"] += op["wire_bytes"]
        row["partial"] |= op["partial"]
        row["trip_count_unknown"] |= op["trip_count_unknown"]
        row["as_all_reduce"] = row.get("as_all_reduce", False) | op.get("as_all_reduce", False)
    return sorted(rows.values(), key=lambda r: (COLLECTIVES.index(r["kind"]), r["axes"]))


# ===== Roofline of a compiled program ==================================================================

# Kernels: the ops that launch work in a non-fused computation. Collectives are left out (async on GPUs, they
# overlap the compute; their bytes are in the collectives table). Scalar ops of loop bodies and conditions cost
# nothing measurable and are left out too.
_KERNEL_OPS = {"fusion", "custom-call", "copy", "transpose", "reduce", "dot", "convolution", "scatter", "gather",
               "dynamic-update-slice", "dynamic-slice", "broadcast", "concatenate", "slice", "pad", "sort",
               "select-and-scatter", "reduce-window"}


def _flops_within(module, comp: str, seen=()) -> float:
    """Dot / convolution FLOPs of a fused computation and what it calls."""
    total = 0.0
    for instr in module["computations"].get(comp, []):
        total += hlo_lib.instruction_flops(module, instr)
        for target, _ in hlo_lib.called(instr):
            if target not in seen:
                total += _flops_within(module, target, seen + (comp,))
    return total


def _fusion_bytes(module, fusion, comp: str) -> float:
    """Bytes a fusion reads and writes: a parameter only sliced inside (a layer of a stacked weight) counts its
    slices, and a buffer updated in place (dynamic-update-slice into a scan's stacked outputs) counts the update."""
    body = module["computations"][comp]
    users: dict[str, list] = {}
    for instr in body:
        for i, name in enumerate(hlo_lib.operands(instr)):
            users.setdefault(name, []).append((instr, i))
    args = hlo_lib.operands(fusion)
    total, written = 0.0, hlo_lib.shape_bytes(fusion["shape"])
    for instr in body:
        if instr["op"] != "parameter":
            continue
        index = int(re.match(r"(\d+)", instr["rest"]).group(1))
        uses = users.get(instr["name"], [])
        if uses and all(u["op"] in ("dynamic-slice", "slice") and i == 0 for u, i in uses):
            total += sum(hlo_lib.shape_bytes(u["shape"]) for u, _ in uses)
        elif uses and all(u["op"] == "dynamic-update-slice" and i == 0 for u, i in uses):
            written = sum(hlo_lib.shape_bytes(module["shapes"].get(hlo_lib.operands(u)[1], "")) for u, _ in uses)
        elif index < len(args):
            total += hlo_lib.shape_bytes(module["shapes"].get(args[index], ""))
    return total + written


def roofline(hlo, peak_flops: float, bandwidth: float, top: int = 5) -> dict:
    """A roofline estimate of one device's step from compiled HLO: every kernel takes max(FLOPs / peak_flops,
    bytes / bandwidth) and they run one after another (one stream), times how often its computation runs.
    Matmul FLOPs inside custom calls (cuDNN attention) are not seen, so those count by their bytes only.
    Returns the seconds, the matmul and other kernels' parts, and the `top` other kernels by time."""
    module = hlo_lib.parse_hlo(hlo) if isinstance(hlo, str) else hlo
    mult, _ = hlo_lib.multiplicities(module)
    kernels = []
    for comp, instrs in module["computations"].items():
        if comp in module["fusion_of"] or not mult.get(comp):
            continue
        for instr in instrs:
            if instr["op"] not in _KERNEL_OPS:
                continue
            called = re.search(r"\bcalls=%?([\w.\-]+)", instr["rest"])
            if instr["op"] == "fusion" and called and called.group(1) in module["computations"]:
                nbytes = _fusion_bytes(module, instr, called.group(1))
                flops = _flops_within(module, called.group(1))
            else:
                nbytes = hlo_lib.shape_bytes(instr["shape"]) + sum(hlo_lib.shape_bytes(module["shapes"].get(o, ""))
                                                           for o in hlo_lib.operands(instr))
                flops = hlo_lib.instruction_flops(module, instr) + (_flops_within(module, called.group(1)) if called else 0)
            times = mult[comp]
            op_name = re.search(r'op_name="([^"]*)"', instr["rest"])
            kernels.append({"name": instr["name"], "kind": "matmul" if flops else instr["op"], "runs": times,
                            "flops": flops * times, "bytes": nbytes * times,
                            "seconds": max(flops / peak_flops, nbytes / bandwidth) * times,
                            "op_name": op_name.group(1) if op_name else ""})
    matmul = [k for k in kernels if k["kind"] == "matmul"]
    other = sorted((k for k in kernels if k["kind"] != "matmul"), key=lambda k: -k["seconds"])
    return {"seconds": sum(k["seconds"] for k in kernels), "kernels": len(kernels),
            "matmul_seconds": sum(k["seconds"] for k in matmul), "matmul_flops": sum(k["flops"] for k in matmul),
            "other_seconds": sum(k["seconds"] for k in other), "other_bytes": sum(k["bytes"] for k in other),
            "peak_flops": peak_flops, "bandwidth": bandwidth, "top": other[:top]}


# ===== Analytic model ==================================================================================

def _param_shards(shape, names, mesh_shape: dict, rules: dict) -> tuple[int, tuple[str, ...]]:
    """ZeRO-table arithmetic: how many ways a parameter is split, and by which mesh axes. A logical name's
    mesh axes are those `mesh.spec_for` shards it over."""
    if names is None:  # unannotated: FSDP on the largest dimension fsdp divides (mesh._fsdp_fallback)
        fsdp = mesh_shape.get("fsdp", 1)
        if fsdp > 1 and any("fsdp" in axes for axes in rules.values()) and any(n % fsdp == 0 for n in shape):
            return fsdp, ("fsdp",)
        return 1, ()
    from jaxtrain.parallel import mesh as mesh_lib  # noqa: PLC0415 (imports jax)
    taken = tuple(a for axes in mesh_lib.dim_axes(shape, names, mesh_shape, rules) for a in axes)
    return math.prod(mesh_shape[a] for a in taken), taken


def _activation_bytes_per_token(cfg, policy: str, tensor: int, seq_len: int) -> float:
    """Saved-for-backward bytes per token for one layer (see the module docstring)."""
    a = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    d, h, kv, hd, f, t = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, tensor
    qkv = (h + 2 * kv) * hd / t
    fused = cfg.attention_impl != "xla"  # a flash kernel keeps f32 softmax statistics per query, not the scores
    scores = 4 * h / t if fused else (8 + a) * h * seq_len / t
    none = a * (4 * d + qkv + h * hd / t + 4 * f / t) + 8 * d + scores
    if policy in ("none", "everything_saveable"):
        return none
    if policy == "full":
        return a * d
    if policy == "dots_saveable":
        return a * (3 * d + qkv + h * hd / t + 2 * f / t) + (0 if fused else a * h * seq_len / t)
    if policy == "dots_with_no_batch_dims_saveable":
        return a * (3 * d + qkv + 2 * f / t)
    return none


def analytic(model_cfg, params: list[dict], mesh_shape: dict, rules: dict, *, batch: int, seq_len: int,
             microbatches: int, opt_counters: int, pipeline: dict | None = None) -> dict:
    """The ZeRO-style estimate. `params`: [{"shape", "names", "bytes"}] (bytes = unsharded). `pipeline`: the
    config's pipeline group (stages, microbatches, repeats) when the layers are pipelined."""
    def active(name):
        return tuple(a for a in rules.get(name, ()) if mesh_shape[a] > 1)

    batch_axes, seq_axes, expert_axes = active("batch"), active("seq"), active("experts")
    dp = math.prod(mesh_shape[a] for a in batch_axes)
    seq_ways = math.prod(mesh_shape[a] for a in seq_axes)
    tensor = mesh_shape.get("tensor", 1) if any("tensor" in v for v in rules.values()) else 1
    a = 2 if model_cfg.dtype in ("bfloat16", "float16") else 4
    stages = pipeline["stages"] if pipeline else 1
    ticks = pipeline["repeats"] * pipeline["microbatches"] + stages - 1 if stages > 1 else 1
    param_bytes = 0.0
    from jaxtrain import step as step_lib  # noqa: PLC0415 (imports jax)
    from jaxtrain.parallel import mesh as mesh_lib
    replicas = mesh_lib.replica_axes(mesh_shape, rules)
    comms: dict[tuple, float] = {}

    def add(kind, axes, nbytes):
        if axes and nbytes:
            key = (kind, tuple(x for x in mesh_shape if x in axes))
            comms[key] = comms.get(key, 0.0) + nbytes

    for p in params:
        shards, axes = _param_shards(p["shape"], p["names"], mesh_shape, rules)
        param_bytes += p["bytes"] / shards
        # Experts are owned, not ZeRO-sharded: the tokens travel to them (all-to-all below), the weights never do.
        owned = [x for x in axes if x in expert_axes and "experts" in (p["names"] or ())]
        gather = [x for x in axes if x in batch_axes and x not in owned]
        reduce = [x for x in batch_axes if x not in axes]
        gathered = p["bytes"] / math.prod(mesh_shape[x] for x in axes if x not in gather)
        # A pipelined layer's gradient is reduced on every tick (each tick adds to the chunk each stage ran; a stage
        # holds `repeats` chunks), except over the replica axes: each replica keeps its own copy until the end.
        pipelined = stages > 1 and "layers" in (p["names"] or ())
        times = microbatches * (ticks / pipeline["repeats"] if pipelined else 1)
        # A tied table's gradient has two parts (lookup and head), which XLA reduces one after the other.
        tied = model_cfg.tie_embeddings and "vocab" in (p["names"] or ())
        # Gathered in the forward, and again in the backward where that needs the weight and nothing kept it: the
        # head's input gradient always, a layer's unless remat "none" keeps the forward's copy; the lookup table
        # never (its gradient is a scatter). Under a pipeline or per-replica accumulation XLA gathers once a step
        # for every tick and microbatch (the weight does not change in between); otherwise once per microbatch.
        lookup = not tied and (p["names"] or ("",))[0] == "vocab"
        # The fused loss (model.loss_chunk_tokens) uses the head once, for the logits and dx alike, gathered before
        # its chunk loop (cross_entropy._gathered_once).
        fused_head = not tied and not lookup and "vocab" in (p["names"] or ()) and model_cfg.loss_chunk_tokens > 0
        passes = 1 if lookup or fused_head or ("layers" in (p["names"] or ()) and model_cfg.remat == "none") else 2
        copies = pipelined or bool(replicas) and step_lib.accumulates_per_replica(model_cfg, microbatches)
        add("all-gather", gather, passes * (1 if copies else microbatches) * gathered)
        add("reduce-scatter", gather, (2 if tied else 1) * times * gathered)
        # Per-replica copies (mesh.per_replica) under a pipeline or gradient accumulation: once a step.
        once = [x for x in reduce if copies and x in replicas]
        add("all-reduce", once, p["bytes"] / shards)
        add("all-reduce", [x for x in reduce if x not in once], (2 if tied else 1) * times * p["bytes"] / shards)
        add("all-reduce", seq_axes, (2 if tied else 1) * times * p["bytes"] / shards)  # each slice's share
    rows = batch // (microbatches * dp)  # sequences per device per microbatch
    tokens_dev = rows * seq_len // seq_ways
    # Layer runs per device, in whole-batch layers: L without a pipeline; with one, every tick runs L/(P*R) layers
    # on a microbatch (bubble ticks included), ticks * L / (P * R * M).
    layer_runs = model_cfg.n_layers * (ticks / (stages * pipeline["repeats"] * pipeline["microbatches"])
                                       if stages > 1 else 1)
    if tensor > 1:
        per_layer = 6 if model_cfg.remat == "full" else 4
        add("all-reduce", ("tensor",), microbatches * per_layer * layer_runs * tokens_dev * model_cfg.d_model * a)
    # Vocabulary tables split along the vocab: the lookup's partial rows and the head's input gradient are summed,
    # and the loss combines each token's f32 max, sum of exponentials and target logit over the vocab shards.
    vocab_axes = _param_shards((model_cfg.vocab_size,), ("vocab",), mesh_shape, rules)[1]
    vocab_ways = math.prod(mesh_shape[x] for x in vocab_axes)
    add("all-reduce", vocab_axes, microbatches * tokens_dev * (2 * model_cfg.d_model * a + 3 * 4))
    kv_dim = model_cfg.n_kv_heads * model_cfg.head_dim // (tensor if model_cfg.n_kv_heads % tensor == 0 else 1)
    kv_whole = 2 * rows * seq_len * kv_dim * a  # one layer's K and V, the whole sequence
    if seq_axes:  # every layer gathers K and V whole; their gradients go back as a reduce-scatter
        # The backward gathers again what remat drops: both under `full`; K under the dots policies (RoPE is not a dot).
        again = {"full": 1.0, "dots_saveable": 0.5, "dots_with_no_batch_dims_saveable": 0.5}.get(model_cfg.remat, 0.0)
        add("all-gather", seq_axes, microbatches * layer_runs * (1 + again) * kv_whole)
        add("reduce-scatter", seq_axes, microbatches * layer_runs * kv_whole)
    if model_cfg.n_experts and expert_axes:  # tokens to their experts and back, forward and backward
        from jaxtrain.models import moe  # noqa: PLC0415 (imports jax)
        group = model_cfg.moe_group_tokens or seq_len
        local_groups = seq_len // group // seq_ways if group < seq_len else 1  # groups sit on one sequence shard
        slots = moe.capacity(model_cfg.moe_capacity_factor, group, model_cfg.moe_top_k, model_cfg.n_experts)
        buffer = model_cfg.n_experts * rows * local_groups * slots * model_cfg.d_model * a
        passes = 6 if model_cfg.remat == "full" else 4  # remat=full runs the forward's two again
        add("all-to-all", expert_axes, microbatches * layer_runs * passes * buffer)
    if stages > 1:  # each tick hands every stage's microbatch on (x and its int32 positions and segment ids)
        pipeline_axes = active("stages")
        micro_rows = rows // pipeline["microbatches"]
        x_bytes = micro_rows * seq_len // seq_ways * model_cfg.d_model * a
        add("collective-permute", pipeline_axes, microbatches * ticks * (
            x_bytes + 2 * micro_rows * seq_len // seq_ways * 4 + 2 * x_bytes))
        # The last stage's output is read on stage 0 and broadcast along the pipeline (and its gradient back).
        add("all-reduce", pipeline_axes, microbatches * 2 * rows * seq_len // seq_ways * model_cfg.d_model * a)
    opt = 2 * param_bytes + 4 * opt_counters

    def activations(cfg):
        act_bytes = 2 if cfg.dtype in ("bfloat16", "float16") else 4
        per_layer = _activation_bytes_per_token(cfg, cfg.remat, tensor, seq_len) * tokens_dev
        if seq_axes and cfg.remat != "full":  # the gathered K and V (the local slice is counted per token)
            per_layer += kv_whole / a * act_bytes * (1 - 1 / seq_ways)
        total = layer_runs * per_layer  # a pipeline stage keeps its layers for every tick's microbatch
        if cfg.remat == "full":  # one layer is recomputed at a time during backward
            total += _activation_bytes_per_token(cfg, "none", tensor, seq_len) * tokens_dev
        if cfg.loss_chunk_tokens:  # fused head + loss: one chunk's f32 logits, f32 gradient and its dtype copy
            from jaxtrain.models import cross_entropy  # noqa: PLC0415 (imports jax)
            chunk_tokens = tokens_dev // cross_entropy.n_chunks(rows, seq_len, cfg.loss_chunk_tokens, 1, seq_ways)
            logits = 8 + (act_bytes if act_bytes < 4 else 0)
            return total + chunk_tokens * cfg.vocab_size / vocab_ways * logits, per_layer
        logits = act_bytes + 4 + (4 if act_bytes < 4 else 0)  # logits, their f32 copy, softmax (f32)
        return total + tokens_dev * cfg.vocab_size / vocab_ways * logits, per_layer

    act, per_layer = activations(model_cfg)
    act_f32, _ = activations(dataclasses.replace(model_cfg, dtype="float32"))
    batch_bytes = 3 * 4 * batch * seq_len / dp
    return {
        "params": param_bytes, "gradients": param_bytes, "optimizer": opt,
        "activations": act, "activations_per_layer": per_layer,
        "temporaries": param_bytes + act, "temporaries_f32_activations": param_bytes + act_f32,
        "arguments": param_bytes + opt + 4 + batch_bytes,
        "collectives": [{"kind": k, "axes": axes, "bytes": v} for (k, axes), v in
                        sorted(comms.items(), key=lambda kv: (COLLECTIVES.index(kv[0][0]), kv[0][1]))],
        "batch_axes": batch_axes, "data_parallel": dp, "tokens_per_device_microbatch": tokens_dev,
    }


# ===== The plan ========================================================================================

def _per_device_bytes(tree) -> float:
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
    raise _error("device_kind", f"unknown {device_kind!r}; known: {', '.join(sorted(metrics.PEAK_FLOPS))}")


def plan(config, num_devices: int, backend: str = "cpu", *, device_kind: str | None = None, mfu: float = 0.5,
         peak_flops: float | None = None, hlo_path: str | None = None, compiler: str = "cpu") -> dict:
    """Compiles `config`'s train step for `num_devices` fake CPU devices with `backend`'s dtypes, and returns
    every figure of the report (bytes are per device). Raises config.ConfigError on bad input.

    The calling process must see at least `num_devices` CPU devices (XLA_FLAGS, before jax is imported).
    `compiler="gpu"` (with backend "gpu") compiles with XLA:GPU instead, for `num_devices` described GPUs of
    `device_kind` (`jaxtrain.tools.plan.topology`: needs the CUDA PJRT plugin, not a GPU): the memory, fusions and
    collectives are then the GPU compiler's own.
    `peak_flops`: peak FLOP/s per device, overriding the `backend` / `device_kind` lookup. `hlo_path`: also
    write the compiled HLO text there (to read the collectives' op names and shapes)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from jaxtrain import config as config_lib, optim, train  # noqa: PLC0415
    from jaxtrain.parallel import mesh as mesh_lib
    from jaxtrain.parallel import pipeline as pipeline_parallel
    from jaxtrain.models import transformer  # noqa: PLC0415

    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise config_lib.ConfigError("devices", f"must be an integer >= 1, got {num_devices!r}")
    if backend not in BACKENDS:
        raise config_lib.ConfigError("backend", f"unknown {backend!r}; choose one of {list(BACKENDS)}")
    if not 0 < mfu <= 1:
        raise config_lib.ConfigError("mfu", f"must be in (0, 1], got {mfu!r}")
    if compiler == "gpu":
        if backend != "gpu":
            raise config_lib.ConfigError("compiler", f"gpu compiles for a gpu target; --backend is {backend!r}")
        try:
            devices = gpu_topology.devices(device_kind, num_devices)
        except (ModuleNotFoundError, ValueError) as e:
            raise config_lib.ConfigError("compiler", str(e)) from None
        compiled_on = f"{num_devices} described {gpu_topology.spec_for(device_kind)[0].upper()} GPU(s), by XLA:GPU"
    elif compiler == "cpu":
        devices = jax.devices("cpu")[:num_devices]
        if len(devices) < num_devices:
            raise config_lib.ConfigError("devices", f"{num_devices} requested but this process has {len(devices)} "
                                         f"CPU device(s); set XLA_FLAGS=--xla_force_host_platform_device_count="
                                         f"{num_devices} before jax is imported (the CLI does)")
        compiled_on = f"{num_devices} fake CPU devices"
    else:
        raise config_lib.ConfigError("compiler", f"unknown {compiler!r}; choose cpu or gpu")
    facts = config_lib.validate(config, num_devices)
    config_lib.check_backend(config, backend)  # the target's: e.g. cuDNN attention needs a gpu target
    model_cfg = config_lib.model_config(config, backend)
    if peak_flops is None:  # an unknown device kind fails before the compile
        peak_dev, peak_source = peak_per_device(backend, device_kind, num_devices, model_cfg.dtype)
    else:
        peak_dev, peak_source = float(peak_flops), "--peak_tflops"
    mesh_shape, rules = facts["mesh_shape"], facts["rules"]

    # The target's dtypes, written into the config so that build_trainer (which resolves `auto` by the
    # platform it compiles for) builds exactly them. The CPU compiler has no cuDNN: its attention is XLA's (the
    # analytic counts the target's kernel).
    config = copy.deepcopy(config)
    config.model.dtype, config.model.param_dtype = model_cfg.dtype, model_cfg.param_dtype
    if compiler == "cpu":
        config.model.attention_impl = "xla"
    trainer = train.build_trainer(config, mesh_shape, rules, devices=devices)
    assert trainer.model_cfg == dataclasses.replace(model_cfg, attention_impl=config.model.attention_impl), \
        (trainer.model_cfg, model_cfg)

    t = config.train
    abstract_batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=trainer.batch_sharding)
                      for k in ("tokens", "segment_ids", "positions")}
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(trainer.abstract_state, abstract_batch).compile()
    compile_s = time.perf_counter() - t0

    state = trainer.abstract_state
    sharded = {"params": _per_device_bytes(state["params"]), "optimizer": _per_device_bytes(state["opt_state"]),
               "step": _per_device_bytes(state["step"]), "batch": _per_device_bytes(abstract_batch)}
    sharded["gradients"] = sharded["params"]

    # Analytic inventory: every parameter's shape and logical names (the model's own annotations).
    abstract_params = nnx.state(nnx.eval_shape(lambda: transformer.build(model_cfg, t.seed)))
    names = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    shapes = nnx.to_pure_dict(abstract_params)
    is_names = lambda v: v is None or isinstance(v, jax.sharding.PartitionSpec)  # noqa: E731
    inventory = [{"shape": x.shape, "names": tuple(n) if n is not None else None,
                  "bytes": math.prod(x.shape) * jnp.dtype(x.dtype).itemsize}
                 for n, x in zip(jax.tree.leaves(names, is_leaf=is_names), jax.tree.leaves(shapes))]
    optimizer = optim.make_optimizer(config.optim, t.steps)
    counters = sum(1 for x in jax.tree.leaves(jax.eval_shape(optimizer.init, shapes))
                   if x.shape == () and jnp.issubdtype(x.dtype, jnp.integer))
    est = analytic(model_cfg, inventory, mesh_shape, rules, batch=t.batch_size, seq_len=t.seq_len,
                   microbatches=t.microbatches, opt_counters=counters, pipeline=dict(config.pipeline))

    memory = _memory_analysis(compiled)
    text = compiled.as_text() or ""
    if hlo_path:
        Path(hlo_path).parent.mkdir(parents=True, exist_ok=True)
        Path(hlo_path).write_text(text)
    module = hlo_lib.parse_hlo(text)
    ops = collectives(module, mesh_shape, mesh_lib.replica_axes(mesh_shape, rules)) if text else []
    coll_rows = summarize_collectives(ops)
    analytic_by_key = {(r["kind"], r["axes"]): r["bytes"] for r in est["collectives"]}
    for row in coll_rows:
        row["analytic_bytes"] = analytic_by_key.pop((row["kind"], row["axes"]), None)
    for (kind, axes), nbytes in analytic_by_key.items():  # predicted but not in the compiled program
        coll_rows.append({"kind": kind, "axes": axes, "count": 0, "bytes": 0.0, "wire_bytes": 0.0,
                          "partial": False, "trip_count_unknown": False, "analytic_bytes": nbytes})

    n_params = sum(math.prod(p["shape"]) for p in inventory)
    tokens = t.batch_size * t.seq_len
    model_flops = transformer.train_flops_per_token(model_cfg, t.seq_len) * tokens
    cost = _cost_flops(compiled)
    dots = hlo_lib.dot_flops(module) if text else None
    step_s = model_flops / (peak_dev * num_devices * mfu)
    roof = None
    if compiler == "gpu" and text:
        roof = roofline(module, peak_dev, gpu_topology.spec_for(device_kind)[1]["memory_bandwidth"])
        roof["mfu"] = model_flops / num_devices / (peak_dev * roof["seconds"]) if roof["seconds"] else None

    def ratio(x, y):
        return x / y if x is not None and y else None

    rows = [
        ("params", sharded["params"], est["params"]),
        ("optimizer", sharded["optimizer"], est["optimizer"]),
        ("gradients", sharded["gradients"], est["gradients"]),
        ("arguments", (memory or {}).get("argument"), est["arguments"]),
        ("temporaries", (memory or {}).get("temp"), est["temporaries"]),
    ]
    return {
        "config": {"mesh": mesh_shape, "rules": config.mesh.rules, "batch_size": t.batch_size,
                   "seq_len": t.seq_len, "microbatches": t.microbatches, "remat": model_cfg.remat,
                   "dtype": model_cfg.dtype, "param_dtype": model_cfg.param_dtype,
                   "attention_impl": model_cfg.attention_impl, "compiled_attention": config.model.attention_impl},
        "target": {"backend": backend, "device_kind": device_kind or DEFAULT_DEVICE_KIND.get(backend, "this machine"),
                   "num_devices": num_devices, "compiler": compiler, "compiled_on": compiled_on,
                   "peak_flops_per_device": peak_dev, "peak_source": peak_source,
                   "memory_bytes": device_memory(backend, device_kind)},
        "model": {"params": n_params, "tokens_per_step": tokens, "layers": model_cfg.n_layers},
        "compile_s": compile_s,
        "memory": {"sharding": sharded, "compiled": memory, "analytic": est,
                   "rows": [{"name": n, "compiled": c, "analytic": a, "ratio": ratio(a, c)} for n, c, a in rows]},
        "flops": {"model_per_step": model_flops, "cost_analysis_per_device": cost,
                  "cost_analysis_total": cost * num_devices if cost is not None else None,
                  "hlo_dots_total": dots * num_devices if dots is not None else None,
                  "cost_analysis_vs_model": ratio(cost * num_devices if cost is not None else None, model_flops),
                  "hlo_dots_vs_model": ratio(dots * num_devices if dots is not None else None, model_flops)},
        "speed": {"mfu": mfu, "ideal_step_s": step_s, "tokens_per_s": tokens / step_s, "roofline": roof},
        "pipeline": {"stages": config.pipeline.stages, "microbatches": config.pipeline.microbatches,
                     "schedule": config.pipeline.schedule, "repeats": config.pipeline.repeats,
                     "bubble": pipeline_parallel.bubble_fraction(config.pipeline.stages, config.pipeline.microbatches,
                                                                 config.pipeline.repeats)},
        "collectives": [dict(r, axes=list(r["axes"]), ratio=ratio(r.get("analytic_bytes"), r["bytes"]))
                        for r in coll_rows],
    }


# ===== Report ==========================================================================================

def _b(x) -> str:
    if x is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _r(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _t(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 10 else f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-2 else \
        f"{seconds * 1e6:,.0f} us"


def _f(x) -> str:
    if x is None:
        return "-"
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} FLOP"


def format_report(r: dict) -> str:
    c, tg, m = r["config"], r["target"], r["model"]
    mesh = " ".join(f"{k}={v}" for k, v in c["mesh"].items())
    mem = r["memory"]
    lines = [
        f"plan: {m['params'] / 1e6:,.2f}M params, {m['layers']} layers | target {tg['backend']} "
        f"({tg['device_kind']}), {c['dtype']} compute, {c['param_dtype']} params | {tg['num_devices']} devices, "
        f"mesh {mesh}, rules {c['rules']!r}",
        f"compiled in {r['compile_s']:.1f}s for {tg['compiled_on']} (shapes only, nothing allocated; "
        + ("XLA:GPU's fusion, scheduling and buffer reuse, without autotuning" if tg["compiler"] == "gpu" else
           "the CPU compiler's fusion and buffer reuse") + f") | batch {c['batch_size']} x {c['seq_len']} = "
        f"{m['tokens_per_step']:,} tokens/step, {c['microbatches']} microbatch(es), remat {c['remat']}",
        "",
        f"{'memory per device':<28}{'sharding/compiled':>20}{'analytic':>14}{'analytic/compiled':>19}",
    ]
    labels = {"params": "params (shardings)", "optimizer": "optimizer state (shardings)",
              "gradients": "gradients (= params)", "arguments": "arguments (compiled)",
              "temporaries": "temporaries (compiled temp)"}
    for row in mem["rows"]:
        lines.append(f"  {labels[row['name']]:<26}{_b(row['compiled']):>20}{_b(row['analytic']):>14}"
                     f"{_r(row['ratio']):>19}")
    compiled = mem["compiled"]
    if compiled:
        lines.append(f"  {'outputs / aliased (donated)':<26}{_b(compiled.get('output')):>20} / "
                     f"{_b(compiled.get('alias'))}")
        if "peak" in compiled:
            lines.append(f"  {'peak = args+out-alias+temp':<26}{_b(compiled['peak']):>20}")
        if compiled.get("generated_code"):
            lines.append(f"  {'generated code':<26}{_b(compiled['generated_code']):>20}")
    else:
        lines.append("  (memory_analysis() not available on this backend)")
    hbm = tg.get("memory_bytes")
    if hbm:
        need = {"compiled peak": (compiled or {}).get("peak"),
                "analytic": mem["analytic"]["arguments"] + mem["analytic"]["temporaries"]}
        lines.append(f"  fits in {_b(hbm)} ({tg['device_kind']})? " + ", ".join(
            f"{k} {_b(v)}: {'yes' if v <= hbm else 'NO'}" for k, v in need.items() if v))
    a = mem["analytic"]
    lines.append(f"  analytic temporaries = gradients {_b(a['gradients'])} + activations {_b(a['activations'])} "
                 f"({_b(a['activations_per_layer'])} per layer, {a['tokens_per_device_microbatch']:,} tokens "
                 f"per device per microbatch)")
    if c["dtype"] != "float32" and tg["compiler"] == "cpu":
        temp = (compiled or {}).get("temp")
        lines.append(f"  note: the CPU compiler computes {c['dtype']} matmuls in f32 and keeps f32 activations; with "
                     f"f32 activations the analytic temporaries are {_b(a['temporaries_f32_activations'])}"
                     + (f" (analytic/compiled {_r(a['temporaries_f32_activations'] / temp)})" if temp else "")
                     + f"; on the {tg['backend']} expect about the {c['dtype']} figure")
    if c["attention_impl"] != c["compiled_attention"]:
        lines.append(f"  note: compiled with XLA's attention (the CPU has no {c['attention_impl']} kernel), which "
                     f"keeps [batch, heads, seq, seq] scores that the target's fused kernel does not; the analytic "
                     f"counts the fused kernel's (its softmax statistics only)")
    f = r["flops"]
    s = r["speed"]
    lines += [
        "",
        "compute per step (all devices)",
        f"  {'model FLOPs (6N + attention)':<38}{_f(f['model_per_step']):>16}",
        f"  {'XLA cost_analysis flops':<38}{_f(f['cost_analysis_total']):>16}   "
        f"x{_r(f['cost_analysis_vs_model'])} of model (while-loop bodies counted once)",
        f"  {'HLO dot FLOPs x trip counts':<38}{_f(f['hlo_dots_total']):>16}   "
        f"x{_r(f['hlo_dots_vs_model'])} of model (with remat, full attention)",
        f"  peak {_f(tg['peak_flops_per_device'])}/s per device x {tg['num_devices']} ({tg['peak_source']})",
        f"  at {s['mfu']:.0%} MFU: ideal step {_t(s['ideal_step_s'])}, {s['tokens_per_s']:,.0f} tokens/s",
    ]
    roof = s.get("roofline")
    if roof and roof["mfu"]:
        lines.append(f"  roofline of the XLA:GPU program: {_t(roof['seconds'])} a step, {roof['mfu']:.1%} MFU if each "
                     f"of its {roof['kernels']} kernels ran at max(FLOPs / peak, bytes / "
                     f"{roof['bandwidth'] / 1e12:.2f} TB/s), one after another (collectives overlapped)")
        lines.append(f"    matmuls {_t(roof['matmul_seconds'])} ({_f(roof['matmul_flops'])}); other kernels "
                     f"{_t(roof['other_seconds'])} moving {_b(roof['other_bytes'])}, the largest:")
        for k in roof["top"]:
            lines.append(f"      {_t(k['seconds']):>10}  {k['name']} x{k['runs']:g}  {k['op_name'][-70:]}")
    p = r["pipeline"]
    if p["stages"] > 1:
        lines.append(f"  pipeline {p['stages']} stages x {p['microbatches']} microbatches ({p['schedule']}"
                     f"{', %d repeats' % p['repeats'] if p['schedule'] == 'circular' else ''}): bubble "
                     f"{p['bubble']:.1%}, so at most {1 - p['bubble']:.0%} of that MFU")
    lines += [
        "",
        "collectives per step, per device (bytes = payload; wire = ring traffic)",
        f"  {'op':<20}{'axes':<16}{'count':>7}{'bytes':>14}{'wire bytes':>14}{'analytic':>14}{'analytic/compiled':>19}",
    ]
    for row in r["collectives"]:
        flags = "".join(note for key, note in (("as_all_reduce", "  (all-reduce + slice on CPU)"),
                                               ("partial", "  partial-axis"),
                                               ("trip_count_unknown", "  trip-count-unknown")) if row.get(key))
        count = row["count"]
        lines.append(f"  {row['kind']:<20}{','.join(row['axes']) or '-':<16}{count:>7.0f}{_b(row['bytes']):>14}"
                     f"{_b(row['wire_bytes']):>14}{_b(row.get('analytic_bytes')):>14}{_r(row['ratio']):>19}{flags}")
    if not r["collectives"]:
        lines.append("  (none: one device, or nothing is sharded)")
    return "\n".join(lines)


# ===== CLI =============================================================================================

def _prescan_devices(argv: list[str]) -> int | None:
    """--devices from the raw arguments (before absl parses them, which imports jax through the config)."""
    for i, arg in enumerate(argv[1:], 1):
        if arg in ("--devices", "-devices"):
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif arg.startswith(("--devices=", "-devices=")):
            value = arg.split("=", 1)[1]
        else:
            continue
        try:
            n = int(value)
        except ValueError:
            raise PlanError(f"devices: must be an integer >= 1, got {value!r}") from None
        if n < 1:
            raise PlanError(f"devices: must be an integer >= 1, got {n}")
        return n
    return None


def _force_host_devices(n: int) -> None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    try:
        devices = _prescan_devices(argv)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if devices is not None:
        _force_host_devices(devices)  # before jax is imported (the config file imports it)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a GPU host: don't grab its memory
    # A CPU host with the CUDA plugin (for --compiler gpu) has no driver: skip jax's check of its CUDA libraries.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

    from absl import app, flags, logging  # noqa: PLC0415

    from jaxtrain import main as main_cli  # noqa: PLC0415 (defines --config)

    flags.DEFINE_integer("devices", None, "Devices to plan for (fake CPU devices). Default: the mesh's "
                         "product when no axis is -1, else 1.")
    flags.DEFINE_string("backend", None, "Target platform for dtypes and peak: cpu, gpu or tpu "
                        "(default: this machine's).")
    flags.DEFINE_string("device_kind", None, "Target device for the peak FLOP/s and memory, e.g. H100, "
                        "'TPU v5p' (default: H100 on gpu, TPU v5p on tpu, the measured machine on cpu).")
    flags.DEFINE_enum("compiler", "auto", ["auto", "cpu", "gpu"], "Which XLA compiles the step: cpu (fake CPU "
                      "devices), gpu (XLA:GPU for described GPUs of --device_kind, no GPU needed: the CUDA PJRT plugin "
                      "must be installed, BUILD.md), auto (gpu for --backend gpu when the plugin is installed).")
    flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s per device, overriding --device_kind's.")
    flags.DEFINE_float("mfu", 0.5, "Model FLOPs utilisation for the ideal step time.")
    flags.DEFINE_string("json", None, "Also write the figures as JSON to this path.")
    flags.DEFINE_string("hlo", None, "Also write the compiled HLO text to this path.")
    FLAGS = flags.FLAGS

    def run(argv_rest):
        del argv_rest
        if not FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        config = main_cli.CONFIG_FLAG.value
        if config is None:
            print("error: --config: required (e.g. --config configs/bench_cpu.py)", file=sys.stderr)
            sys.exit(2)
        from jaxtrain import config as config_lib  # noqa: PLC0415
        from jaxtrain.parallel import mesh as mesh_lib

        n = devices
        try:
            if n is None:
                sizes = [config.mesh[a] for a in mesh_lib.AXES]
                n = math.prod(sizes) if all(isinstance(x, int) and x > 0 for x in sizes) else 1
                _force_host_devices(n)  # jax is imported, but its CPU backend has not started yet
            import jax  # noqa: PLC0415
            backend = FLAGS.backend or {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(),
                                                                          jax.default_backend())
            compiler = FLAGS.compiler
            if compiler == "auto":
                compiler = "gpu" if backend == "gpu" and gpu_topology.available() else "cpu"
            result = plan(config, n, backend, device_kind=FLAGS.device_kind, mfu=FLAGS.mfu,
                          peak_flops=FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else None, hlo_path=FLAGS.hlo,
                          compiler=compiler)
        except config_lib.ConfigError as e:
            print(f"error: {e}".splitlines()[0], file=sys.stderr)
            sys.exit(2)
        print(format_report(result))
        if FLAGS.json:
            path = Path(FLAGS.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1, default=str))
            print(f"json: {path}")
        sys.exit(0)

    app.run(run, argv=argv, flags_parser=main_cli.parse_flags)


if __name__ == "__main__":
    main()
