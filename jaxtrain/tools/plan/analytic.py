"""The analytic estimate: what a step should hold and move per device, from the config alone, in the manner of
the ZeRO paper's tables.

Memory (params, gradients, optimizer state, activations by remat policy, logits) and the collectives (FSDP gathers
and reduce-scatters, data-parallel reduces, tensor, vocabulary, sequence, expert and pipeline traffic) are counted
from each parameter's shape and logical axis names and the mesh's rules. The report sets each figure beside the
compiled one, so their ratio shows where XLA departs from the textbook. The formulas: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import math

from jaxtrain.observe import hlo as hlo_lib


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
    """Saved-for-backward bytes per token for one layer (docs/planning.md)."""
    a = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    d, h, kv, hd, f, t = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, tensor
    qkv = (h + 2 * kv) * hd / t
    fused = cfg.attention_impl != "xla"  # a flash kernel keeps f32 softmax statistics per query, not the scores
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


def _host_activation_bytes_per_token(cfg, tensor: int, seq_len: int) -> float:
    """What remat "offload_dots" keeps per token and layer in host memory: the weight matmuls' outputs."""
    dots = _activation_bytes_per_token(cfg, "dots_with_no_batch_dims_saveable", tensor, seq_len)
    return dots - _activation_bytes_per_token(cfg, "full", tensor, seq_len) if cfg.remat == "offload_dots" else 0.0


def analytic(model_cfg, params: list[dict], mesh_shape: dict, rules: dict, *, batch: int, seq_len: int,
             microbatches: int, opt_counters: int, opt_moments: float = 2.0,
             pipeline: dict | None = None, offload: bool = False, per_replica: bool = False) -> dict:
    """The ZeRO-style estimate. `params`: [{"shape", "names", "bytes", "trained"}] (bytes = unsharded; trained: has a
    gradient and optimizer state, false for LoRA's frozen base, default true). `opt_moments`: the
    optimizer state's bytes per parameter byte (AdamW in f32: 2; bf16 moments: 1; Muon: fewer). `pipeline`: the
    config's pipeline group (stages, microbatches, repeats) when the layers are pipelined. `offload`
    (optim.offload): the optimizer state is counted in host memory, as remat offload_dots' activations are.
    `per_replica`: the step differentiates per-replica weight copies even without accumulation (error feedback)."""
    def active(name):
        return tuple(a for a in rules.get(name, ()) if mesh_shape[a] > 1)

    batch_axes, seq_axes, expert_axes = active("batch"), active("seq"), active("experts")
    dp = math.prod(mesh_shape[a] for a in batch_axes)
    seq_ways = math.prod(mesh_shape[a] for a in seq_axes)
    tensor = mesh_shape.get("tensor", 1) if any("tensor" in v for v in rules.values()) else 1
    a = 2 if model_cfg.dtype in ("bfloat16", "float16") else 4
    stages = pipeline["stages"] if pipeline else 1
    ticks = pipeline["repeats"] * pipeline["microbatches"] + stages - 1 if stages > 1 else 1
    param_bytes = trained_bytes = 0.0  # every parameter's; those with gradients and optimizer state (LoRA: adapters)
    from jaxtrain import step as step_lib  # noqa: PLC0415 (imports jax)
    from jaxtrain.parallel import mesh as mesh_lib
    replicas = mesh_lib.replica_axes(mesh_shape, rules)
    comms: dict[tuple, float] = {}
    # Gradient bytes per param byte as reduced. A weight matmul's gradient comes out of its matmul in the compute
    # dtype, or narrower where optim.grad_reduce_dtype asks (layers.weight_grad_in); the fused loss's head in f32
    # or that dtype; lookup tables, norms and biases in the param dtype; the per-replica sums in that dtype.
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    g_size, p_size = size[model_cfg.grad_reduce_dtype], size[model_cfg.param_dtype]
    matmul_scale = min(g_size, size[model_cfg.dtype]) / p_size
    head_scale = g_size / p_size if model_cfg.loss_chunk_tokens and not model_cfg.final_softcap else matmul_scale

    def add(kind, axes, nbytes):
        if axes and nbytes:
            key = (kind, tuple(x for x in mesh_shape if x in axes))
            comms[key] = comms.get(key, 0.0) + nbytes

    for p in params:
        names = tuple(p["names"] or ())
        shards, axes = _param_shards(p["shape"], p["names"], mesh_shape, rules)
        param_bytes += p["bytes"] / shards
        trained = p.get("trained", True)
        trained_bytes += p["bytes"] / shards if trained else 0.0
        # Experts are owned, not ZeRO-sharded: the tokens travel to them (all-to-all below), the weights never do.
        owned = [x for x in axes if x in expert_axes and "experts" in names]
        gather = [x for x in axes if x in batch_axes and x not in owned]
        reduce = [x for x in batch_axes if x not in axes]
        gathered = p["bytes"] / math.prod(mesh_shape[x] for x in axes if x not in gather)
        # A pipelined layer's gradient is reduced on every tick (each tick adds to the chunk each stage ran; a stage
        # holds `repeats` chunks), except over the replica axes: each replica keeps its own copy until the end.
        pipelined = stages > 1 and "layers" in names
        times = microbatches * (ticks / pipeline["repeats"] if pipelined else 1)
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
        passes = 1 if lookup or fused_head or ("layers" in names and model_cfg.remat == "none") else 2
        copies = pipelined or bool(replicas) and (per_replica or step_lib.accumulates_per_replica(model_cfg,
                                                                                                  microbatches))
        add("all-gather", gather, passes * (1 if copies else microbatches) * gathered)
        if not trained:  # a frozen weight (LoRA's base): gathered, never reduced
            continue
        matmul = len(p["shape"]) - ("layers" in names) >= 2 and "experts" not in names and not lookup
        scale = 1 if lookup else head_scale if "vocab" in names else matmul_scale if matmul else 1
        parts = (scale + 1) if tied else scale  # a tied table: the head's part and the lookup's
        add("reduce-scatter", gather, parts * times * gathered)
        # Per-replica copies (mesh.per_replica) under a pipeline or gradient accumulation: once a step.
        once = [x for x in reduce if copies and x in replicas]
        add("all-reduce", once, g_size / p_size * p["bytes"] / shards)
        add("all-reduce", [x for x in reduce if x not in once], parts * times * p["bytes"] / shards)
        add("all-reduce", seq_axes, parts * times * p["bytes"] / shards)  # each slice's share
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
        again = {"full": 1.0, "dots_saveable": 0.5, "dots_with_no_batch_dims_saveable": 0.5,
                 "offload_dots": 0.5}.get(model_cfg.remat, 0.0)
        add("all-gather", seq_axes, microbatches * layer_runs * (1 + again) * kv_whole)
        add("reduce-scatter", seq_axes, microbatches * layer_runs * kv_whole)
    if model_cfg.n_experts and expert_axes and model_cfg.moe_routing == "dropless":
        # Each shard's assignments (tokens x top_k rows) are gathered along `expert`, every device runs its own
        # experts on them and the partial outputs are summed; the backward does the same with the gradients.
        ways = math.prod(mesh_shape[x] for x in expert_axes if x in batch_axes)
        rows_bytes = tokens_dev * ways * model_cfg.moe_top_k * model_cfg.d_model * a
        passes = 3 if model_cfg.remat == "full" else 2  # remat=full runs the forward's again
        if ways > 1:
            add("all-gather", expert_axes, microbatches * layer_runs * passes * rows_bytes)
        add("all-reduce", expert_axes, microbatches * layer_runs * passes * rows_bytes)
    elif model_cfg.n_experts and expert_axes:  # tokens to their experts and back, forward and backward
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
    opt = opt_moments * trained_bytes + 4 * opt_counters

    def activations(cfg):
        act_bytes = 2 if cfg.dtype in ("bfloat16", "float16") else 4
        per_layer = _activation_bytes_per_token(cfg, cfg.remat, tensor, seq_len) * tokens_dev
        if seq_axes and cfg.remat != "full":  # the gathered K and V (the local slice is counted per token)
            per_layer += kv_whole / a * act_bytes * (1 - 1 / seq_ways)
        total = layer_runs * per_layer  # a pipeline stage keeps its layers for every tick's microbatch
        if cfg.remat == "offload_dots":  # one layer's, back from the host, during its backward
            total += _activation_bytes_per_token(cfg, "dots_with_no_batch_dims_saveable", tensor, seq_len) * tokens_dev
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
    host_act = layer_runs * _host_activation_bytes_per_token(model_cfg, tensor, seq_len) * tokens_dev
    act_f32, _ = activations(dataclasses.replace(model_cfg, dtype="float32"))
    batch_bytes = 3 * 4 * batch * seq_len / dp
    return {
        "params": param_bytes, "gradients": trained_bytes, "optimizer": 0.0 if offload else opt,
        "host": {"optimizer": opt if offload else 0.0, "activations": host_act},
        "activations": act, "activations_per_layer": per_layer,
        "temporaries": trained_bytes + act, "temporaries_f32_activations": trained_bytes + act_f32,
        "arguments": param_bytes + (0.0 if offload else opt) + 4 + batch_bytes,
        "collectives": [{"kind": k, "axes": axes, "bytes": v} for (k, axes), v in
                        sorted(comms.items(), key=lambda kv: (hlo_lib.COLLECTIVES.index(kv[0][0]), kv[0][1]))],
        "batch_axes": batch_axes, "data_parallel": dp, "tokens_per_device_microbatch": tokens_dev,
    }
