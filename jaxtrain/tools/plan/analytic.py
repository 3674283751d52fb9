"""The analytic estimate: what a step should hold and move per device, from the config alone, in the manner of
the ZeRO paper's tables.

Memory (params, gradients, optimizer state, activations by remat policy, logits) and the collectives (FSDP gathers
and reduce-scatters, data-parallel reduces, tensor, vocabulary, sequence, expert and pipeline traffic) are counted
from each parameter's shape and logical axis names and the mesh's rules. The report sets each figure beside the
compiled one, so their ratio shows where XLA departs from the textbook. The formulas: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jaxtrain.observe import hlo as hlo_lib
from jaxtrain.tools.plan import pipeline_model


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


def _activation_bytes_per_token(cfg, policy: str, tensor: int, seq_len: int, flash: bool = False) -> float:
    """Saved-for-backward bytes per token for one layer (docs/planning.md); `flash`: attention saves softmax
    statistics, not scores, whatever model.attention_impl (ring attention's custom_vjp)."""
    a = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    d, h, kv, hd, f, t = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, tensor
    qkv = (h + 2 * kv) * hd / t
    fused = flash or cfg.attention_impl != "xla"  # a flash kernel keeps f32 softmax statistics per query
    scores = 4 * h / t if fused else (8 + a) * h * seq_len / t
    none = a * (4 * d + qkv + h * hd / t + 4 * f / t) + 8 * d + scores
    if policy in ("none", "everything_saveable"):
        return none
    if policy in ("full", "offload_dots"):  # offload_dots: the matmul outputs wait in host memory (host_bytes)
        return a * d
    if policy == "dots_saveable":
        return a * (3 * d + qkv + h * hd / t + 2 * f / t) + (0 if fused else a * h * seq_len / t)
    if policy == "dots_with_no_batch_dims_saveable":
        return a * (3 * d + qkv + 2 * f / t)
    return none


def _host_activation_bytes_per_token(cfg, remat: str, tensor: int, seq_len: int) -> float:
    """What remat "offload_dots" keeps per token and layer in host memory: the weight matmuls' outputs."""
    dots = _activation_bytes_per_token(cfg, "dots_with_no_batch_dims_saveable", tensor, seq_len)
    return dots - _activation_bytes_per_token(cfg, "full", tensor, seq_len) if remat == "offload_dots" else 0.0


def _active_axes(name: str, mesh_shape: dict, rules: dict) -> tuple[str, ...]:
    """The mesh axes (> 1) that the rules map the logical name `name` to."""
    return tuple(a for a in rules.get(name, ()) if mesh_shape[a] > 1)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One device's share of a step: the mesh axes that split the batch, sequence, experts, vocabulary and pipeline,
    the sizes that follow, and how the model runs (remat, the gradients' reduction dtype: models.config.Layout).
    Every memory and traffic term below reads it."""
    remat: str
    grad_reduce_dtype: str
    mesh_shape: dict
    batch_axes: tuple[str, ...]
    seq_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    pipeline_axes: tuple[str, ...]
    vocab_axes: tuple[str, ...]
    replicas: tuple[str, ...]  # mesh.replica_axes: pure data-parallel replicas
    dp: int
    seq_ways: int
    vocab_ways: int
    tensor: int
    act_size: int  # bytes of an activation element in the compute dtype
    seq_len: int
    microbatches: int
    stages: int
    repeats: int  # the pipeline's repeats and microbatches (1 without a pipeline)
    pipe_microbatches: int
    ticks: int
    schedule: str
    explicit: bool  # run by pipeline_exec (pipeline.EXPLICIT), not under autodiff
    in_flight: int  # explicit: the (microbatch, chunk) inputs a stage holds at once (pipeline_model.executor)
    exec_ticks: int  # explicit: the executor's ticks (every action one tick)
    rows: int  # sequences per device per microbatch
    tokens_dev: int
    layer_runs: float
    kv_whole: float  # one layer's K and V, the whole sequence
    ring: int = 0  # model.context_parallel ring or usp over a split sequence: the ring's size (0: none)
    ulysses: int = 1  # Ulysses' group size (ulysses: the whole sequence axis; usp: model.ulysses_ways)
    sub_block: int = 0  # tokens a side of the ring's sub-blocks (jaxtrain.parallel.context._chunks)


def _layout(model_cfg, run, mesh_shape: dict, rules: dict, *, batch: int, seq_len: int,
            microbatches: int) -> _Layout:
    """The step's layout from the model run as `run` (models.config.Layout), the mesh, its rules and the sizes."""
    from jaxtrain.parallel import mesh as mesh_lib, pipeline as pipeline_parallel  # noqa: PLC0415 (imports jax)
    batch_axes = _active_axes("batch", mesh_shape, rules)
    seq_axes = _active_axes("seq", mesh_shape, rules)
    dp = math.prod(mesh_shape[a] for a in batch_axes)
    seq_ways = math.prod(mesh_shape[a] for a in seq_axes)
    tensor = mesh_shape.get("tensor", 1) if any("tensor" in v for v in rules.values()) else 1
    a = 2 if model_cfg.dtype in ("bfloat16", "float16") else 4
    stages = run.pipeline_stages
    repeats, pipe_microbatches = (run.pipeline_repeats, run.pipeline_microbatches) if stages > 1 else (1, 1)
    ticks = repeats * pipe_microbatches + stages - 1 if stages > 1 else 1
    schedule = run.pipeline_schedule if stages > 1 else "gpipe"
    explicit = stages > 1 and schedule in pipeline_parallel.EXPLICIT
    ex = pipeline_model.executor(schedule, stages, pipe_microbatches, repeats) if explicit else None
    rows = batch // (microbatches * dp)
    vocab_axes = _param_shards((model_cfg.vocab_size,), ("vocab",), mesh_shape, rules)[1]
    kv_dim = model_cfg.n_kv_heads * model_cfg.head_dim // (tensor if model_cfg.n_kv_heads % tensor == 0 else 1)
    ring, ulysses, sub_block = _context(model_cfg, seq_ways, seq_len)
    return _Layout(
        remat=run.remat, grad_reduce_dtype=run.grad_reduce_dtype, mesh_shape=mesh_shape, batch_axes=batch_axes,
        seq_axes=seq_axes,
        # Experts are owned along `expert` only; split over fsdp too, they are ZeRO-gathered like any weight.
        expert_axes=tuple(x for x in _active_axes("experts", mesh_shape, rules) if x == "expert"),
        pipeline_axes=_active_axes("stages", mesh_shape, rules) if stages > 1 else (),
        vocab_axes=vocab_axes, replicas=mesh_lib.replica_axes(mesh_shape, rules), dp=dp, seq_ways=seq_ways,
        vocab_ways=math.prod(mesh_shape[x] for x in vocab_axes), tensor=tensor, act_size=a, seq_len=seq_len,
        microbatches=microbatches, stages=stages, repeats=repeats, pipe_microbatches=pipe_microbatches, ticks=ticks,
        schedule=schedule, explicit=explicit, in_flight=ex["in_flight"] if ex else 0,
        exec_ticks=ex["ticks"] if ex else ticks, rows=rows, tokens_dev=rows * seq_len // seq_ways,
        # Layer runs per device, in whole-batch layers: L without a pipeline; with one under autodiff, every tick
        # runs L/(P*R) layers on a microbatch (bubble ticks included), ticks * L / (P * R * M); an explicit
        # schedule's idle ticks run nothing, L / P. (L: the stacked layers; dense first ones run on every stage.)
        layer_runs=model_cfg.first_dense_layers + model_cfg.stacked_layers * (
            1 if stages == 1 else 1 / stages if explicit else ticks / (stages * repeats * pipe_microbatches)),
        kv_whole=2 * rows * seq_len * kv_dim * a, ring=ring, ulysses=ulysses, sub_block=sub_block)


def _context(model_cfg, seq_ways: int, seq_len: int) -> tuple[int, int, int]:
    """(ring size, Ulysses group size, ring sub-block tokens) of model.context_parallel on `seq_ways` devices."""
    mode = model_cfg.context_parallel
    if seq_ways == 1 or mode == "allgather":
        return 0, 1, 0
    from jaxtrain.parallel import context  # noqa: PLC0415 (imports jax)
    if mode == "ulysses":
        return 0, seq_ways, 0
    u = 1 if mode == "ring" else context.ulysses_ways(model_cfg.ulysses_ways, seq_ways, model_cfg.n_heads,
                                                     model_cfg.n_kv_heads)
    block = seq_len // (seq_ways // u)  # a ring member's tokens
    return seq_ways // u, u, block // context._chunks(block, 0)


def _param_memory(placed: list[tuple]) -> tuple[float, float]:
    """Per-device bytes of every parameter, and of those with gradients and optimizer state (LoRA: the adapters)."""
    param_bytes = trained_bytes = 0.0
    for p, shards, _ in placed:
        param_bytes += p["bytes"] / shards
        trained_bytes += p["bytes"] / shards if p.get("trained", True) else 0.0
    return param_bytes, trained_bytes


def _grad_scales(model_cfg, grad_reduce_dtype: str) -> tuple[float, float, float]:
    """Gradient bytes per param byte as reduced: (the per-replica sums', a weight matmul's, the head's). A weight
    matmul's gradient comes out of its matmul in the compute dtype, or narrower where optim.grad_reduce_dtype asks
    (layers.weight_grad_in); the fused loss's head in f32 or that dtype; lookup tables, norms and biases in the param
    dtype; the per-replica sums in that dtype."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    g_size, p_size = size[grad_reduce_dtype], size[model_cfg.param_dtype]
    matmul_scale = min(g_size, size[model_cfg.dtype]) / p_size
    head_scale = g_size / p_size if model_cfg.loss_chunk_tokens and not model_cfg.final_softcap else matmul_scale
    return g_size / p_size, matmul_scale, head_scale


def _weight_terms(model_cfg, placed: list[tuple], lay: _Layout, per_replica: bool):
    """(kind, axes, bytes) of the weights' gathers and their gradients' reduces, parameter by parameter."""
    for p, shards, axes in placed:
        yield from _param_terms(model_cfg, p, shards, axes, lay, per_replica)


def _param_terms(model_cfg, p: dict, shards: int, axes: tuple, lay: _Layout, per_replica: bool):
    """One parameter's: gathered over the batch axes that shard it, its gradient reduced over the rest."""
    from jaxtrain import step as step_lib  # noqa: PLC0415 (imports jax)
    mesh_shape, batch_axes, microbatches = lay.mesh_shape, lay.batch_axes, lay.microbatches
    names = tuple(p["names"] or ())
    # Experts are owned, not ZeRO-sharded: the tokens travel to them (all-to-all below), the weights never do.
    owned = [x for x in axes if x in lay.expert_axes and "experts" in names]
    # ZeRO-3 over every token-splitting axis: a weight split over sequence is gathered over it too.
    gather = [x for x in axes if (x in batch_axes or x in lay.seq_axes) and x not in owned]
    reduce = [x for x in batch_axes if x not in axes]
    gathered = p["bytes"] / math.prod(mesh_shape[x] for x in axes if x not in gather)
    if lay.explicit and "layers" in names:
        # The explicit executor (batch axes manual) gathers a stage's weights once a schedule and sums their
        # gradients whole over the batch axes after its tick loop, in the param dtype.
        yield "all-gather", gather, microbatches * gathered
        if p.get("trained", True):
            yield "all-reduce", [x for x in batch_axes if x not in owned], microbatches * gathered
        return
    # A pipelined layer's gradient is reduced on every tick (each tick adds to the chunk each stage ran; a stage
    # holds `repeats` chunks), except over the replica axes: each replica keeps its own copy until the end.
    pipelined = lay.stages > 1 and "layers" in names
    times = microbatches * (lay.ticks / lay.repeats if pipelined else 1)
    # A tied table's gradient has two parts (lookup and head), which XLA reduces one after the other.
    tied = model_cfg.tie_embeddings and "vocab" in names
    # Gathered in the forward, and again in the backward where that needs the weight and nothing kept it: the
    # head's input gradient always, a layer's unless remat "none" keeps the forward's copy; the lookup table
    # never (its gradient is a scatter). Under a pipeline or per-replica accumulation XLA gathers once a step
    # for every tick and microbatch (the weight does not change in between); otherwise once per microbatch.
    lookup = not tied and names[:1] == ("vocab",)
    # The fused loss (model.loss_chunk_tokens) uses the head once, for the logits and dx alike, gathered before
    # its chunk loop (cross_entropy._gathered_once).
    fused_head = not tied and not lookup and "vocab" in names and model_cfg.loss_chunk_tokens > 0
    passes = 1 if lookup or fused_head or ("layers" in names and lay.remat == "none") else 2
    copies = pipelined or bool(lay.replicas) and (per_replica or not lay.explicit and step_lib.accumulates_per_replica(
        model_cfg, microbatches))
    yield "all-gather", gather, passes * (1 if copies else microbatches) * gathered
    if not p.get("trained", True):  # a frozen weight (LoRA's base): gathered, never reduced
        return
    reduced_scale, matmul_scale, head_scale = _grad_scales(model_cfg, lay.grad_reduce_dtype)
    matmul = len(p["shape"]) - ("layers" in names) >= 2 and "experts" not in names and not lookup
    scale = 1 if lookup else head_scale if "vocab" in names else matmul_scale if matmul else 1
    parts = (scale + 1) if tied else scale  # a tied table: the head's part and the lookup's
    yield "reduce-scatter", gather, parts * times * gathered
    # Per-replica copies (mesh.per_replica) under a pipeline or gradient accumulation: once a step.
    once = [x for x in reduce if copies and x in lay.replicas]
    yield "all-reduce", once, reduced_scale * p["bytes"] / shards
    # XLA sums a vocabulary table's gradient whole over the other batch axes before slicing it over sequence.
    whole = "vocab" in names and any(x in lay.seq_axes for x in gather)
    summed = gathered if whole else p["bytes"] / shards
    yield "all-reduce", [x for x in reduce if x not in once], parts * times * summed
    if not any(x in lay.seq_axes for x in axes):
        yield "all-reduce", lay.seq_axes, parts * times * p["bytes"] / shards  # each slice's share


def _tensor_terms(model_cfg, lay: _Layout):
    """Megatron's activation all-reduces over `tensor`."""
    if lay.tensor > 1:
        per_layer = 6 if lay.remat == "full" else 4
        yield "all-reduce", ("tensor",), (lay.microbatches * per_layer * lay.layer_runs * lay.tokens_dev
                                          * model_cfg.d_model * lay.act_size)


def _vocab_terms(model_cfg, lay: _Layout):
    """Vocabulary tables split along the vocab: the lookup's partial rows and the head's input gradient are summed,
    and the loss combines each token's f32 max, sum of exponentials and target logit over the vocab shards. The
    lookup's rows are in the table's dtype (cast after the sum), the fused loss's input gradient in f32."""
    d, tokens = model_cfg.d_model, lay.microbatches * lay.tokens_dev
    lookup = d * {"float32": 4, "bfloat16": 2, "float16": 2}[model_cfg.param_dtype]
    head = d * (4 if model_cfg.loss_chunk_tokens and not model_cfg.final_softcap else lay.act_size) + 3 * 4
    if lay.explicit:  # the executor's head enters whole over the pipeline: its own sums only over the other axes
        yield "all-reduce", lay.vocab_axes, tokens * lookup
        yield "all-reduce", [x for x in lay.vocab_axes if x not in lay.pipeline_axes], tokens * head
        return
    yield "all-reduce", lay.vocab_axes, tokens * (lookup + head)


def _sequence_terms(model_cfg, lay: _Layout):
    """allgather: every layer gathers K and V whole along the sequence axes, their gradients going back as a
    reduce-scatter. ring (and usp's ring): each K/V shard goes round by permutes, again in the backward with its
    f32 gradient accumulators and a last hop home. ulysses (and usp's groups): all-to-alls of q, k, v and the
    output, forward and backward."""
    if not lay.seq_axes:
        return
    runs = lay.microbatches * lay.layer_runs
    # The backward runs again what remat drops: the whole layer under `full`; K under the dots policies (RoPE is
    # not a dot).
    again = {"full": 1.0, "dots_saveable": 0.5, "dots_with_no_batch_dims_saveable": 0.5,
             "offload_dots": 0.5}.get(lay.remat, 0.0)
    if not lay.ring and lay.ulysses == 1:
        yield "all-gather", lay.seq_axes, runs * (1 + again) * lay.kv_whole
        yield "reduce-scatter", lay.seq_axes, runs * lay.kv_whole
        return
    # The segment ids and positions of the whole sequence (int32), gathered once a microbatch for every layer.
    yield "all-gather", lay.seq_axes, lay.microbatches * 2 * lay.rows * lay.seq_len * 4
    forwards = 2.0 if lay.remat == "full" else 1.0  # the custom_vjp's forward runs again under full remat
    if lay.ring > 1:  # usp whose groups take the whole axis is a ring of one: nothing goes round
        shard = lay.kv_whole / lay.seq_ways  # a device's K and V (usp: its group's block, its share of the heads)
        hops = lay.ring - 1
        yield "collective-permute", lay.seq_axes, runs * (forwards * hops * shard + hops * shard
                                                          + lay.ring * shard * 4 / lay.act_size)
    if lay.ulysses > 1:
        q_out = 2 * lay.tokens_dev * model_cfg.n_heads * model_cfg.head_dim / lay.tensor * lay.act_size
        kv = lay.kv_whole / lay.seq_ways
        yield "all-to-all", lay.seq_axes, runs * (forwards + 1) * (q_out + kv)


def _expert_terms(model_cfg, lay: _Layout):
    """The tokens' trips to their experts along `expert`, forward and backward."""
    a, expert_axes, microbatches = lay.act_size, lay.expert_axes, lay.microbatches
    if model_cfg.n_experts and expert_axes and model_cfg.moe_routing == "dropless":
        # Each shard's assignments (tokens x top_k rows) are gathered along `expert`, every device runs its own
        # experts on them and the partial outputs are summed; the backward does the same with the gradients.
        ways = math.prod(lay.mesh_shape[x] for x in expert_axes if x in lay.batch_axes)
        rows_bytes = lay.tokens_dev * ways * model_cfg.moe_top_k * model_cfg.d_model * a
        passes = 3 if lay.remat == "full" else 2  # remat=full runs the forward's again
        if ways > 1:
            yield "all-gather", expert_axes, microbatches * lay.layer_runs * passes * rows_bytes
        yield "all-reduce", expert_axes, microbatches * lay.layer_runs * passes * rows_bytes
    elif model_cfg.n_experts and expert_axes:  # tokens to their experts and back, forward and backward
        from jaxtrain.models import moe  # noqa: PLC0415 (imports jax)
        seq_len = lay.seq_len
        group = model_cfg.moe_group_tokens or seq_len
        local_groups = seq_len // group // lay.seq_ways if group < seq_len else 1  # groups sit on one sequence shard
        slots = moe.capacity(model_cfg.moe_capacity_factor, group, model_cfg.moe_top_k, model_cfg.n_experts)
        buffer = model_cfg.n_experts * lay.rows * local_groups * slots * model_cfg.d_model * a
        passes = 6 if lay.remat == "full" else 4  # remat=full runs the forward's two again
        yield "all-to-all", expert_axes, microbatches * lay.layer_runs * passes * buffer


def _pipeline_terms(model_cfg, lay: _Layout):
    """Each tick hands every stage's microbatch on (x and its int32 positions and segment ids), under autodiff;
    the explicit executor sends x on and its gradient back (`pipeline_model`)."""
    if lay.explicit:
        # Every tick, idle ones too, one ppermute each way of a microbatch's x; after the loop stage 0's input
        # gradients are summed over the pipeline (the others' are zeros).
        yield "collective-permute", lay.pipeline_axes, lay.microbatches * 2 * lay.exec_ticks * _micro_x(model_cfg, lay)
        yield "all-reduce", lay.pipeline_axes, lay.microbatches * lay.tokens_dev * model_cfg.d_model * lay.act_size
    elif lay.stages > 1:
        a, seq_len, seq_ways = lay.act_size, lay.seq_len, lay.seq_ways
        micro_rows = lay.rows // lay.pipe_microbatches
        x_bytes = micro_rows * seq_len // seq_ways * model_cfg.d_model * a
        yield "collective-permute", lay.pipeline_axes, lay.microbatches * lay.ticks * (
            x_bytes + 2 * micro_rows * seq_len // seq_ways * 4 + 2 * x_bytes)
        # The last stage's output is read on stage 0 and broadcast along the pipeline (and its gradient back).
        yield "all-reduce", lay.pipeline_axes, (lay.microbatches * 2 * lay.rows * seq_len // seq_ways
                                                * model_cfg.d_model * a)


def _executor_table_terms(placed: list[tuple], lay: _Layout):
    """The vocabulary tables around an explicit executor, whose head enters every stage whole: the head is
    gathered over the pipeline axes that split it and its gradient reduce-scattered back; the lookup table's
    gradient (from the input gradients, summed over the pipeline) is reduce-scattered too."""
    for p, _, axes in placed if lay.explicit else ():
        names = tuple(p["names"] or ())
        over = [x for x in axes if x in lay.pipeline_axes]
        if "vocab" not in names or "layers" in names or not over:
            continue
        whole = p["bytes"] / math.prod(lay.mesh_shape[x] for x in axes if x not in over)
        if names[:1] != ("vocab",):  # the head
            yield "all-gather", over, lay.microbatches * whole
        if p.get("trained", True):
            yield "reduce-scatter", over, lay.microbatches * whole


def _micro_x(model_cfg, lay: _Layout) -> float:
    """Bytes of one pipeline microbatch's hidden states on a device: what a stage sends or holds per microbatch."""
    return lay.tokens_dev / lay.pipe_microbatches * model_cfg.d_model * lay.act_size


def _pipeline_sends(model_cfg, lay: _Layout) -> dict:
    """Bytes a device sends by ppermute a step under an explicit schedule: what the schedule needs (an output on
    and an input gradient back per microbatch and chunk, the busiest stage's) and what the executor sends."""
    x = _micro_x(model_cfg, lay)
    need = pipeline_model.permute_payload(lay.schedule, lay.stages, lay.pipe_microbatches, lay.repeats)
    return {"microbatch_bytes": x, "needed": lay.microbatches * need * x, "hand_offs": need, "ticks": lay.exec_ticks,
            "sent": lay.microbatches * 2 * lay.exec_ticks * x}


def _pipeline_estimate(model_cfg, lay: _Layout, parts: dict, buffers: float) -> dict | None:
    """The pipeline's share of the estimate: the chunk activations a stage holds at once (the schedule's), what
    they cost, and its ppermute bytes."""
    if lay.stages == 1:
        return None
    out = {"schedule": lay.schedule, "explicit": lay.explicit, "ticks": lay.exec_ticks}
    if lay.explicit:
        out.update(in_flight=lay.in_flight, activation_parts=parts, gradient_buffers=buffers,
                   sends=_pipeline_sends(model_cfg, lay))
    else:  # autodiff saves every tick's chunk activations, bubble ticks too
        out.update(in_flight=lay.ticks)
    return out


def _sum_collectives(terms, mesh_shape: dict) -> list[dict]:
    """The (kind, axes, bytes) terms summed by kind and mesh axes (in mesh order), in hlo.COLLECTIVES' order."""
    comms: dict[tuple, float] = {}
    for kind, axes, nbytes in terms:
        if axes and nbytes:
            key = (kind, tuple(x for x in mesh_shape if x in axes))
            comms[key] = comms.get(key, 0.0) + nbytes
    return [{"kind": k, "axes": axes, "bytes": v} for (k, axes), v in
            sorted(comms.items(), key=lambda kv: (hlo_lib.COLLECTIVES.index(kv[0][0]), kv[0][1]))]


def _activations(cfg, lay: _Layout) -> tuple[float, float, dict]:
    """Activation bytes a device holds in the backward (every layer's saved tensors, the layer being recomputed or
    brought back, the logits), one layer's share, and the parts of an explicit schedule's (`_explicit_parts`)."""
    act_bytes = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    tensor, seq_len, tokens_dev, flash = lay.tensor, lay.seq_len, lay.tokens_dev, lay.ring > 0
    per_layer = _activation_bytes_per_token(cfg, lay.remat, tensor, seq_len, flash) * tokens_dev
    if lay.seq_axes and lay.remat != "full" and not flash:  # the gathered K and V (the local slice is per token)
        per_layer += lay.kv_whole / lay.act_size * act_bytes * (1 - 1 / lay.seq_ways)
    parts = _explicit_parts(cfg, lay, per_layer, act_bytes) if lay.explicit else {}
    total = sum(parts.values()) if lay.explicit else lay.layer_runs * per_layer  # autodiff: every tick's layers
    if lay.remat == "offload_dots" and not lay.explicit:  # one layer's, back from the host, during its backward
        total += _activation_bytes_per_token(cfg, "dots_with_no_batch_dims_saveable", tensor, seq_len,
                                             flash) * tokens_dev
    if lay.remat == "full" and not lay.explicit:  # one layer is recomputed at a time during backward
        total += _activation_bytes_per_token(cfg, "none", tensor, seq_len, flash) * tokens_dev
    if flash:  # the ring's working set: a sub-block pair's f32 logits, probabilities and their gradient
        total += 3 * 4 * lay.rows * cfg.n_heads / tensor / lay.ulysses * lay.sub_block ** 2
    # The explicit executor runs the head and loss a pipeline microbatch at a time, its head whole over the pipeline.
    rows, vocab_ways = lay.rows, lay.vocab_ways
    if lay.explicit:
        rows //= lay.pipe_microbatches
        vocab_ways = math.prod(lay.mesh_shape[x] for x in lay.vocab_axes if x not in lay.pipeline_axes)
    tokens = rows * seq_len // lay.seq_ways
    if cfg.loss_chunk_tokens:  # fused head + loss: one chunk's f32 logits, f32 gradient and its dtype copy
        from jaxtrain.models import cross_entropy  # noqa: PLC0415 (imports jax)
        chunk_tokens = tokens // cross_entropy.n_chunks(rows, seq_len, cfg.loss_chunk_tokens, 1, lay.seq_ways)
        logits = 8 + (act_bytes if act_bytes < 4 else 0)
        return total + chunk_tokens * cfg.vocab_size / vocab_ways * logits, per_layer, parts
    logits = act_bytes + 4 + (4 if act_bytes < 4 else 0)  # logits, their f32 copy, softmax (f32)
    return total + tokens * cfg.vocab_size / vocab_ways * logits, per_layer, parts


def _explicit_parts(cfg, lay: _Layout, per_layer: float, act_bytes: int) -> dict:
    """An explicit schedule's activations (pipeline_exec): its in-flight inputs, each with the output gradient it
    waits for; one chunk's layers for one microbatch, saved by the recompute in its backward, with one layer's
    remat "none" activations while that layer is differentiated; and the stage's inputs and input gradients for
    the whole batch. (`per_layer`: one layer's saved bytes for all the device's tokens.)"""
    M, K = lay.pipe_microbatches, cfg.stacked_layers // (lay.stages * lay.repeats)
    x = lay.tokens_dev / M * cfg.d_model * act_bytes
    none = _activation_bytes_per_token(cfg, "none", lay.tensor, lay.seq_len) * lay.tokens_dev
    return {"in_flight": lay.in_flight * 2 * x, "chunk": (K * per_layer + none) / M,
            "stage_io": 2 * lay.tokens_dev * cfg.d_model * act_bytes}


def _executor_gradients(placed: list[tuple], lay: _Layout) -> float:
    """The explicit executor's extra gradient buffers: each tick's weight gradient and the accumulator beside the
    step's gradients, of the stage's layers whole over the (manual) batch axes and of the head and final norm
    whole over the pipeline (they enter every stage whole)."""
    total = 0.0
    for p, shards, axes in placed:
        names = tuple(p["names"] or ())
        if not p.get("trained", True) or (names[:1] == ("vocab",) and "layers" not in names):
            continue  # frozen, or the lookup table (outside the executor)
        inside = [x for x in axes if x not in lay.batch_axes and ("layers" in names or x not in lay.pipeline_axes)]
        total += 2 * p["bytes"] / math.prod(lay.mesh_shape[x] for x in inside)
    return total


def analytic(model_cfg, params: list[dict], mesh_shape: dict, rules: dict, *, batch: int, seq_len: int,
             microbatches: int, opt_counters: int, opt_moments: float = 2.0, layout=None, offload: bool = False,
             per_replica: bool = False) -> dict:
    """The ZeRO-style estimate. `params`: [{"shape", "names", "bytes", "trained"}] (bytes = unsharded; trained: has a
    gradient and optimizer state, false for LoRA's frozen base, default true). `opt_moments`: the
    optimizer state's bytes per parameter byte (AdamW in f32: 2; bf16 moments: 1; Muon: fewer). `layout`: how the
    model runs (models.config.Layout: pipeline, remat, gradient-reduction dtype; default plain). `offload`
    (optim.offload): the optimizer state is counted in host memory, as remat offload_dots' activations are.
    `per_replica`: the step differentiates per-replica weight copies even without accumulation (error feedback)."""
    from jaxtrain.models.config import Layout  # noqa: PLC0415 (imports jax)
    lay = _layout(model_cfg, layout or Layout(), mesh_shape, rules, batch=batch, seq_len=seq_len,
                  microbatches=microbatches)
    placed = [(p, *_param_shards(p["shape"], p["names"], mesh_shape, rules)) for p in params]
    param_bytes, trained_bytes = _param_memory(placed)
    collectives = _sum_collectives(itertools.chain(
        _weight_terms(model_cfg, placed, lay, per_replica), _tensor_terms(model_cfg, lay),
        _vocab_terms(model_cfg, lay), _sequence_terms(model_cfg, lay), _expert_terms(model_cfg, lay),
        _pipeline_terms(model_cfg, lay), _executor_table_terms(placed, lay)), mesh_shape)
    opt = opt_moments * trained_bytes + 4 * opt_counters
    act, per_layer, parts = _activations(model_cfg, lay)
    act_f32, _, _ = _activations(dataclasses.replace(model_cfg, dtype="float32"), lay)
    # Offloaded matmul outputs: every layer run's; an explicit schedule's one chunk's for one microbatch.
    host_runs = model_cfg.stacked_layers / (lay.stages * lay.repeats * lay.pipe_microbatches) if lay.explicit \
        else lay.layer_runs
    host_act = host_runs * _host_activation_bytes_per_token(model_cfg, lay.remat, lay.tensor, seq_len) * lay.tokens_dev
    batch_bytes = 3 * 4 * batch * seq_len / lay.dp
    buffers = _executor_gradients(placed, lay) if lay.explicit else 0.0
    return {
        "params": param_bytes, "gradients": trained_bytes, "optimizer": 0.0 if offload else opt,
        "host": {"optimizer": opt if offload else 0.0, "activations": host_act},
        "activations": act, "activations_per_layer": per_layer,
        "temporaries": trained_bytes + buffers + act, "temporaries_f32_activations": trained_bytes + buffers + act_f32,
        "pipeline": _pipeline_estimate(model_cfg, lay, parts, buffers),
        "arguments": param_bytes + (0.0 if offload else opt) + 4 + batch_bytes,
        "collectives": collectives,
        "batch_axes": lay.batch_axes, "data_parallel": lay.dp, "tokens_per_device_microbatch": lay.tokens_dev,
    }
