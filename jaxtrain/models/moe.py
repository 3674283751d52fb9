"""Mixture-of-experts feed-forward layer: top-k routing, with a capacity per expert (GShard) or dropless (Mixtral).

`MoE(cfg, rngs)(x) -> (y, stats)`: stats are each batch row's routing counts (`route`), which `summarize` turns
into {"load_balance_loss", "dropped_fraction"} of any set of rows, so a pipelined model, which routes each
microbatch on its own, still gets the whole batch's loss. Experts are gated MLPs (`mlp_activation`) stacked on an
"experts" axis. The router runs in float32; each token takes its top `moe_top_k` experts, gated by their
probabilities (renormalised to sum to 1 with `moe_renormalize`). "capacity": within a routing group of G tokens
(a row, or `moe_group_tokens` of it) an expert takes at most C = ceil(capacity_factor * G * k / E) tokens, first
choices before second ones; the rest are dropped (the residual carries them); dispatch and combine are one-hot
einsums with static shapes, so with experts on the `expert` mesh axis XLA inserts the all-to-alls. "dropless":
the call's assignments sorted by expert run through a ragged_dot, jax's or tokamax's (`model.moe_kernel`; on CPU
cpu_grouped's tiles; on GPUs its gradients may be gpu_grouped's: `model.moe_weight_grad`, `moe_input_grad`),
reaching experts on other devices by gather or all-to-all (`model.moe_dispatch`).
load_balance_loss = E * sum_e f_e * P_e (1 when balanced; only P_e carries a gradient). Every token counts,
padding included (docs/parallelism.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models import cpu_grouped, lora
from jaxtrain.models.config import WEIGHT_MATMUL, ModelConfig
from jaxtrain.models.layers import activation, param, split_last, weight
from jaxtrain.parallel import experts as expert_parallel
from jaxtrain.parallel.mesh import compile_platform, constrain, per_shard, split_ways


def capacity(capacity_factor: float, group_size: int, top_k: int, n_experts: int) -> int:
    """Slots per expert and group: ceil(capacity_factor * group_size * top_k / n_experts), within [1, group_size]."""
    c = math.ceil(round(capacity_factor * group_size * top_k / n_experts, 6))
    return max(1, min(group_size, c))


def _top_k(probs: jax.Array, k: int):
    """jax.lax.top_k over the last axis as k rounds of argmax (ties: the lower expert first). XLA's partitioner
    all-gathers a batch-sharded operand of top_k (jax 0.10 on 8 CPU devices); argmax stays sharded."""
    values, indices = [], []
    for _ in range(k):
        index = jnp.argmax(probs, axis=-1)
        values.append(jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0])
        indices.append(index)
        probs = jnp.where(jax.nn.one_hot(index, probs.shape[-1], dtype=jnp.bool_), -jnp.inf, probs)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1).astype(jnp.int32)


def choose(logits: jax.Array, top_k: int, renormalize: bool = True, score: str = "softmax", groups: int = 1,
           topk_groups: int = 1, scale: float = 1.0, bias: jax.Array | None = None):
    """Router logits [..., E] -> (probs [..., E] f32, experts [..., k] int32 best first, gates [..., k] f32).

    "softmax" (Mixtral, Qwen3-MoE): probs the softmax; gates the top-k probabilities, renormalised to sum to 1 if
    `renormalize` (norm_topk_prob). "sigmoid" (DeepSeek-V3): each expert's score its sigmoid; with `groups` > 1 the
    experts form that many groups, each scored by its two best, and only the best `topk_groups` groups' experts
    compete; gates are the chosen scores (renormalised: over their sum + 1e-20); probs, for the balance statistics,
    the scores normalised to sum to 1; `bias` [E] (e_score_correction_bias) is added to the scores that choose
    groups and experts, not to the gates. Either way the gates are then multiplied by `scale`
    (routed_scaling_factor)."""
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        top_probs, top_idx = _top_k(probs, top_k)
        gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True) if renormalize else top_probs
        return probs, top_idx, gates * scale
    scores = jax.nn.sigmoid(logits)
    # The bias only steers the choice (an argmax): it gets no gradient, and is balanced outside it.
    candidates = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if groups > 1:
        n_experts = scores.shape[-1]
        grouped = candidates.reshape(*scores.shape[:-1], groups, n_experts // groups)
        group_score = jnp.sum(_top_k(grouped, min(2, n_experts // groups))[0], axis=-1)  # [..., groups]
        kept = jnp.any(jax.nn.one_hot(_top_k(group_score, topk_groups)[1], groups, dtype=jnp.bool_), axis=-2)
        candidates = jnp.where(jnp.repeat(kept, n_experts // groups, axis=-1), candidates, -jnp.inf)
    _, top_idx = _top_k(candidates, top_k)
    gates = jnp.take_along_axis(scores, top_idx, axis=-1)
    if renormalize:
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    return scores / jnp.sum(scores, axis=-1, keepdims=True), top_idx, gates * scale


def routing_options(cfg: ModelConfig) -> dict:
    """`choose`'s options as the config sets them."""
    return {"renormalize": cfg.moe_renormalize, "score": cfg.moe_score, "groups": cfg.moe_groups,
            "topk_groups": cfg.moe_topk_groups, "scale": cfg.moe_routed_scale}


def route(logits: jax.Array, top_k: int, capacity: int, **routing):
    """Router logits [..., T, E] (f32; the leading dims index groups) -> (dispatch [..., T, E, C] f32 0/1,
    combine [..., T, E, C] f32, stats).

    dispatch[..., t, e, c] = 1 where token t of its group fills slot c of expert e; combine is dispatch times
    that assignment's gate weight. stats, f32 per group: "routed" [..., E] assignments that chose each expert
    (before capacity), "prob" [..., E] summed router probabilities, "dropped" [...] assignments past capacity,
    "tokens" [...]; `summarize` turns any set of them into the load-balancing loss and dropped fraction."""
    *groups, tokens, n_experts = logits.shape
    probs, top_idx, gates = choose(logits, top_k, **routing)  # [..., T, k], best first
    chosen = jax.nn.one_hot(top_idx, n_experts, dtype=jnp.int32)  # [..., T, k, E]

    # Slot of each assignment in its expert: count earlier assignments in priority order (choice rank, then token).
    by_priority = jnp.swapaxes(chosen, -3, -2).reshape(*groups, top_k * tokens, n_experts)
    slot = jnp.sum((jnp.cumsum(by_priority, axis=-2) - 1) * by_priority, axis=-1)  # [..., k*T]
    slot = jnp.swapaxes(slot.reshape(*groups, top_k, tokens), -1, -2)  # [..., T, k]
    kept = slot < capacity
    kept_chosen = chosen.astype(jnp.float32) * kept[..., None]
    slot_onehot = jax.nn.one_hot(jnp.where(kept, slot, 0), capacity, dtype=jnp.float32)  # [..., T, k, C]
    # A token's k choices are distinct experts, so each (t, e) pair receives at most one of them.
    dispatch = jnp.einsum("...tke,...tkc->...tec", kept_chosen, slot_onehot)
    combine = jnp.einsum("...tke,...tkc->...tec", kept_chosen * gates[..., None], slot_onehot)

    stats = {  # per group; sums and counts, so that any set of groups adds up (`summarize`)
        "routed": jnp.sum(chosen, axis=(-3, -2)).astype(jnp.float32),
        "prob": jnp.sum(probs, axis=-2),
        "dropped": (tokens * top_k - jnp.sum(kept, axis=(-2, -1), dtype=jnp.int32)).astype(jnp.float32),
        "tokens": jnp.full(groups, tokens, jnp.float32),
    }
    return dispatch, combine, stats


def dropless_route(logits: jax.Array, top_k: int, **routing):
    """Router logits [..., T, E] -> (experts [..., T, k] int32, gates [..., T, k] f32, stats): every assignment
    kept. stats are `route`'s per leading index ("dropped" 0)."""
    *groups, tokens, n_experts = logits.shape
    probs, top_idx, gates = choose(logits, top_k, **routing)
    routed = jnp.sum(jax.nn.one_hot(top_idx, n_experts, dtype=jnp.int32), axis=(-3, -2))
    stats = {"routed": routed.astype(jnp.float32), "prob": jnp.sum(probs, axis=-2),
             "dropped": jnp.zeros(groups, jnp.float32), "tokens": jnp.full(groups, tokens, jnp.float32)}
    return top_idx, gates, stats


@jax.custom_vjp
def _permute(x, order, inverse):
    """x[order] for a permutation `order` whose inverse is `inverse`: the backward is the gather x[inverse], not
    the scatter-add XLA would write for a general gather's transpose."""
    return jnp.take(x, order, axis=0, unique_indices=True, indices_are_sorted=False)


def _permute_fwd(x, order, inverse):
    return _permute(x, order, inverse), (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return _permute(g, inverse, order), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def _flat_batch(op):
    """`op(a, b, sizes)` (group sizes [E]) made safe to vmap any number of times: each vmap over it becomes one
    more leading dim of all three arguments, and those dims run as a single jax.vmap of op."""
    def batched(a, b, sizes):
        lead = sizes.shape[:-1]
        if not lead:
            return op(a, b, sizes)
        flat = [x.reshape(-1, *x.shape[len(lead):]) for x in (a, b, sizes)]
        out = jax.vmap(op)(*flat)
        return out.reshape(*lead, *out.shape[1:])

    # jax 0.10's ragged_dot fails to lower on CPU under two vmaps (a numpy int reaches vmap's in_axes); a pipeline
    # runs the layer under two (its stages, then the weight copies of each data replica).
    folded = jax.custom_batching.custom_vmap(batched)

    @folded.def_vmap
    def _(axis_size, in_batched, *args):
        return folded(*(x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched))), True

    return folded


# x [m, k] @ w [E, k, n] -> [m, n], row groups by `sizes`, and (ragged contracting) x [m, k], g [m, n] ->
# [E, k, n]: each group's x rows^T @ its g rows (the weight gradient). Those are the two forms tokamax's Mosaic
# GPU kernels take (the second as RAGGED_CONTRACTING_DOT_DIM_NUMS).
_RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])


def _kernel_ops(name: str, tiled: bool, weight_grad: str, input_grad: str):
    """(ragged_dot, weight gradient, input gradient or None) of the library `model.moe_kernel` names (tokamax
    imported only then), or jaxtrain.models.cpu_grouped's if `tiled`. tokamax's forward and input gradient, and
    XLA's weight gradient: tokamax 0.0.17's ragged-contracting kernel gave weight gradients off by 14-34% of their
    largest entry on an H200 with jax 0.11.2, where its other two equal XLA's (docs/performance.md;
    `scripts/bench_ragged_dot.py` checks it again). "pallas" for `weight_grad` (`model.moe_weight_grad`) or
    `input_grad` (`model.moe_input_grad`): jaxtrain.models.gpu_grouped's kernel instead; the input gradient's None
    is the forward kernel on the transposed weight."""
    if tiled:
        return cpu_grouped.ragged_dot, cpu_grouped.ragged_weight_grad, None
    if "pallas" in (weight_grad, input_grad):
        from jaxtrain.models import gpu_grouped  # Pallas's Triton API, imported only then
    if weight_grad == "pallas":
        grad = gpu_grouped.ragged_weight_grad
    else:
        grad = lambda x, g, sizes: jax.lax.ragged_dot_general(x, g, sizes, _RAGGED_CONTRACTING)  # noqa: E731
    dx = gpu_grouped.ragged_transposed_dot if input_grad == "pallas" else None
    if name == "tokamax":
        import tokamax  # optional: jaxtrain[kernels]; its absl flags: jaxtrain.compat.tokamax

        return tokamax.ragged_dot, grad, dx
    return jax.lax.ragged_dot, grad, dx


def tiled_here(kernel: str) -> bool:
    """Whether "xla" grouped matmuls traced now take cpu_grouped's tiles: on CPU (whose ragged_dot multiplies every
    row by every group's weight), where the weights hold whole experts. Not where XLA splits the experts itself
    (gather dispatch along `expert`): it cannot partition the tiles' weight lookups and would gather them all."""
    return kernel == "xla" and compile_platform() == "cpu" and split_ways("experts") == 1


@functools.cache
def grouped_matmul(kernel: str, tiled: bool, weight_grad: str, input_grad: str):
    """f(x [m, k], w [E, k, n], sizes [E]) -> [m, n] through `kernel`'s ragged_dot (cpu_grouped's if `tiled`), with
    its backward written out so that every grouped matmul, the gradients' too, goes through `_flat_batch` and the
    same kernels (the choice is made once, when the forward is traced: the backward may be traced elsewhere)."""
    dot, grad, dx = _kernel_ops(kernel, tiled, weight_grad, input_grad)
    forward, weight_grad = _flat_batch(dot), _flat_batch(grad)
    input_grad = _flat_batch(dx) if dx else lambda g, w, sizes: forward(g, jnp.swapaxes(w, -1, -2), sizes)

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return forward(x, w, sizes)

    def fwd(x, w, sizes):
        return forward(x, w, sizes), (x, w, sizes)

    def bwd(res, g):
        x, w, sizes = res
        return input_grad(g, w, sizes), weight_grad(x, g, sizes).astype(w.dtype), None

    matmul.defvjp(fwd, bwd)
    return matmul


def kernels_of(cfg: ModelConfig) -> tuple[str, str, str]:
    """Dropless's grouped-matmul kernels: (`model.moe_kernel`, `moe_weight_grad`, `moe_input_grad`)."""
    return cfg.moe_kernel, cfg.moe_weight_grad, cfg.moe_input_grad


DEFAULT_KERNELS = kernels_of(ModelConfig)  # the fields' defaults, as ModelConfig defines them


def dropless_experts(x, experts, gates, w_gate_up, w_down, act, adapters=(None, None),
                     kernels: tuple[str, str, str] = DEFAULT_KERNELS):
    """Every token through each of its k experts: x [N, d], experts [N, k] int, gates [N, k], w_gate_up
    [E, d, T, 2f/T] (`MoE.gate_up_weights`), w_down [E, f, d] -> sum_j gates[:, j] * down_e(act(x @ gate_e) *
    (x @ up_e)), e = experts[:, j], [N, d] in x's dtype. The N*k assignments sorted by expert (stable) run through
    `expert_mlp`: no capacity, nothing dropped. `adapters`: the LoRA factors (lora.factors) of gate-and-up
    (A [E, d, r], B [E, r, 2, f]) and of down, or None. `kernels` (`kernels_of`): whose ragged_dot, whose weight
    gradient and whose input gradient."""
    n, k = experts.shape
    flat = experts.reshape(n * k)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted position -> assignment (token * k + j)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32), unique_indices=True)
    sizes = jnp.sum(jax.nn.one_hot(flat, w_down.shape[0], dtype=jnp.int32), axis=0)
    # Each token's row repeated k times (the backward sums the copies), then sorted by expert.
    rows = _permute(jnp.broadcast_to(x[:, None], (n, k, x.shape[-1])).reshape(n * k, -1), order, inverse)
    out = expert_mlp(rows, sizes, w_gate_up, w_down, act, adapters, kernels)
    out = _permute(out, inverse, order).reshape(n, k, -1)  # back to assignment order
    return jnp.einsum("nk,nkd->nd", gates.astype(x.dtype), out)


def expert_mlp(rows, sizes, w_gate_up, w_down, act, adapters=(None, None),
               kernels: tuple[str, str, str] = DEFAULT_KERNELS):
    """rows [M, d] sorted by expert, `sizes` [E] rows per expert -> each row through its expert's gated MLP [M, d],
    one ragged_dot per projection (rows past sum(sizes) give zeros). Weights, adapters and kernels as
    `dropless_experts`."""
    tiled = tiled_here(kernels[0])
    if tiled and adapters == (None, None):  # the hidden activations of the routed rows only
        return cpu_grouped.expert_mlp(rows, sizes, w_gate_up, w_down, act)
    matmul = grouped_matmul(kernels[0], tiled, *kernels[1:])
    m = rows.shape[0]
    e, d, ways, width = w_gate_up.shape
    joined = matmul(rows, w_gate_up.reshape(e, d, ways * width), sizes).reshape(m, ways, width)
    gate, up = (h.reshape(m, -1) for h in split_last(joined, (width // 2,)))
    low_rank = lambda h, a, b: matmul(matmul(h, a, sizes), b.reshape(e, a.shape[-1], -1), sizes)
    if adapters[0] is not None:
        gate_up = low_rank(rows, *adapters[0]).reshape(m, 2, -1)
        gate, up = gate + gate_up[:, 0], up + gate_up[:, 1]
    hidden = act(gate) * up
    out = matmul(hidden, w_down, sizes)
    if adapters[1] is not None:
        out = out + low_rank(hidden, *adapters[1])
    return out


def zero_stats(leading: tuple[int, ...], n_experts: int) -> dict:
    """Routing statistics of no tokens, shaped like `route`'s with leading dims `leading`."""
    return {"routed": jnp.zeros((*leading, n_experts)), "prob": jnp.zeros((*leading, n_experts)),
            "dropped": jnp.zeros(leading), "tokens": jnp.zeros(leading)}


def summarize(stats: dict, per_sequence: bool = False) -> dict:
    """Routing statistics (`route`'s, any leading dims, all of which are summed) -> the f32 scalars
    {"load_balance_loss", "dropped_fraction", "max_load", "min_load"} of all those tokens together; max_load is
    the busiest expert's share of the assignments over an even share (1 when balanced, E when every token picks
    one), min_load the idlest's (1 when balanced, 0 when an expert gets nothing).
    `per_sequence`: the balance loss is each leading index's (a batch row's) own, averaged over them (DeepSeek-V3's
    sequence-wise loss); stats then have one leading dim."""
    routed, prob = (jnp.sum(stats[k], axis=tuple(range(stats[k].ndim - 1))) for k in ("routed", "prob"))
    assignments = jnp.sum(routed)
    fraction_routed = routed / assignments  # f_e
    if per_sequence:
        f = stats["routed"] / jnp.maximum(jnp.sum(stats["routed"], axis=-1, keepdims=True), 1)
        p = stats["prob"] / jnp.maximum(stats["tokens"], 1)[..., None]
        balance = routed.shape[-1] * jnp.mean(jnp.sum(f * p, axis=-1))
    else:
        balance = routed.shape[-1] * jnp.sum(fraction_routed * prob / jnp.sum(stats["tokens"]))  # E sum f_e P_e
    return {"load_balance_loss": balance, "dropped_fraction": jnp.sum(stats["dropped"]) / assignments,
            "max_load": routed.shape[-1] * jnp.max(fraction_routed),
            "min_load": routed.shape[-1] * jnp.min(fraction_routed)}


def check_config(cfg: ModelConfig) -> None:
    """ValueError naming the field when the MoE fields cannot build a layer."""
    if cfg.n_experts < 1:
        raise ValueError(f"n_experts: a mixture of experts needs at least 1 expert, got {cfg.n_experts}")
    if not 1 <= cfg.moe_top_k <= cfg.n_experts:
        raise ValueError(f"moe_top_k: must be between 1 and n_experts={cfg.n_experts}, got {cfg.moe_top_k}")
    if not cfg.moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor: must be positive, got {cfg.moe_capacity_factor}")


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        check_config(cfg)
        self.cfg = cfg
        d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
        self.w_router = param(rngs, (d, e), ("embed", None), cfg)
        if cfg.moe_score_bias:  # DeepSeek-V3's e_score_correction_bias: float32, as transformers keeps it
            self.score_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(None,), eager_sharding=False)
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), cfg,
                             std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        # LoRA: one A for gate and up (B's outputs [2, f]), as PEFT adapts Hugging Face's fused gate_up_proj.
        lora.add(self, "w_gate_up", "experts", (e, d, 2, f), ("experts", "embed", None, "mlp"), 1, cfg, rngs, lead=1)
        lora.add(self, "w_down", "experts", (e, f, d), ("experts", "mlp", "embed"), 1, cfg, rngs, lead=1)

    def routing(self) -> dict:
        """`choose`'s options: the config's, and the correction bias where the router has one."""
        bias = {"bias": self.score_bias[...]} if hasattr(self, "score_bias") else {}
        return {**routing_options(self.cfg), **bias}

    def gate_up_weights(self, dt, sharded: bool = False):
        """w_gate and w_up [E, d, f] joined as [E, d, T, 2f/T], T the ways "mlp" is split (1 if that does not divide
        f): each device's gate and up blocks side by side, so joining moves nothing and the input's gradient under
        tensor parallelism is one all-reduce (as layers.project_fused). `sharded` keeps the result split over
        "embed" as the weights are, so the join happens on each shard and one joined tensor is gathered: for
        tokamax's kernels, where XLA:GPU otherwise gathers both and copies them into one (docs/models.md). XLA:CPU
        gathers the joined weight beside the two, so the other kernels join after the gather."""
        w_gate, w_up = weight(self.w_gate, dt), weight(self.w_up, dt)
        e, d, f = w_gate.shape
        ways = split_ways("mlp") if f % split_ways("mlp") == 0 else 1
        joined = jnp.concatenate([w.reshape(e, d, ways, f // ways) for w in (w_gate, w_up)], axis=-1)
        return constrain(joined, ("experts", "embed" if sharded else None, "mlp", None))

    def gate_up(self, expert_in, dt):
        """The gate and up projections of the expert buffer [E, B, N, C, d] as one matmul per expert, joined as
        layers.project_fused joins them (one input-gradient all-reduce under tensor parallelism)."""
        if self.w_gate.shape[-1] % split_ways("mlp"):
            return [jnp.einsum("ebncd,edf->ebncf", expert_in, weight(w, dt)) for w in (self.w_gate, self.w_up)]
        y = jnp.einsum("ebncd,edtg->ebnctg", expert_in, self.gate_up_weights(dt))
        return [part.reshape(*y.shape[:4], -1) for part in split_last(y, (y.shape[-1] // 2,))]

    def __call__(self, x):
        """x [B, T, d] -> (y [B, T, d] in x's dtype, routing stats per row: `route`'s summed over each row's groups,
        leading dim B, which `summarize` turns into the load-balancing loss and dropped fraction)."""
        if self.cfg.moe_routing == "dropless":
            return self.dropless(x)
        cfg, dt = self.cfg, x.dtype
        batch, tokens, d = x.shape
        # Groups [B, N, G]: the sequence's groups N carry its sequence split (config validation: N divides it); one
        # group (N = 1, the default, and any T the group size does not divide, e.g. decoding) leaves it on G.
        group = cfg.moe_group_tokens if cfg.moe_group_tokens and tokens % cfg.moe_group_tokens == 0 else tokens
        seq = ("batch", "seq", None) if group < tokens else ("batch", None, "seq")
        x = constrain(x.reshape(batch, tokens // group, group, d), (*seq, "act_embed"))
        logits = checkpoint_name(jnp.einsum("bngd,de->bnge", x.astype(jnp.float32),
                                            weight(self.w_router, jnp.float32)), WEIGHT_MATMUL)
        dispatch, combine, stats = route(logits, cfg.moe_top_k,
                                         capacity(cfg.moe_capacity_factor, group, cfg.moe_top_k, cfg.n_experts),
                                         **self.routing())
        dispatch = constrain(dispatch.astype(dt), (*seq, None, None))
        combine = constrain(combine.astype(dt), (*seq, None, None))

        # The expert buffer [E, B, N, C, d]: with groups, each sequence shard fills and runs its own groups' slots.
        rows = ("act_experts", "batch", "seq" if group < tokens else None, None)
        expert_in = constrain(jnp.einsum("bngec,bngd->ebncd", dispatch, x), (*rows, "act_embed"))
        gate, up = self.gate_up(expert_in, dt)
        if (ab := lora.factors(self, "w_gate_up", dt)) is not None:
            low = jnp.einsum("ebncd,edr->ebncr", expert_in, ab[0])
            gate, up = (h + jnp.einsum("ebncr,erf->ebncf", low, ab[1][:, :, i]) for i, h in enumerate((gate, up)))
        hidden = constrain(activation(cfg.mlp_activation)(gate) * up, (*rows, "act_mlp"))
        expert_out = jnp.einsum("ebncf,efd->ebncd", hidden, weight(self.w_down, dt))
        if (ab := lora.factors(self, "w_down", dt)) is not None:
            expert_out = expert_out + jnp.einsum("ebncr,erd->ebncd", jnp.einsum("ebncf,efr->ebncr", hidden, ab[0]),
                                                 ab[1])
        expert_out = constrain(expert_out, (*rows, "act_embed"))
        # Back to the token layout here, so that the combine's backward keeps this copy for the gates' gradient (left
        # to XLA, a pipeline's tick loop moved the expert outputs once more in the backward).
        expert_out = constrain(expert_out, (None, "batch", rows[2], None, "act_embed"))
        y = jnp.einsum("bngec,ebncd->bngd", combine, expert_out).reshape(batch, tokens, d)
        return constrain(y, ("batch", "seq", "act_embed")), jax.tree.map(lambda v: jnp.sum(v, axis=1), stats)

    def dropless(self, x):
        """`__call__` with moe_routing="dropless": the whole call's B*T tokens routed together, none dropped."""
        cfg, dt = self.cfg, x.dtype
        batch, tokens, d = x.shape
        x = constrain(x, ("batch", "seq", "act_embed"))
        logits = checkpoint_name(jnp.einsum("btd,de->bte", x.astype(jnp.float32),
                                            weight(self.w_router, jnp.float32)), WEIGHT_MATMUL)
        experts, gates, stats = dropless_route(logits, cfg.moe_top_k, **self.routing())  # stats per row
        weights = (self.gate_up_weights(dt, sharded=cfg.moe_kernel == "tokamax"), weight(self.w_down, dt),
                   (lora.factors(self, "w_gate_up", dt), lora.factors(self, "w_down", dt)))

        def run(weights, x, experts, gates):  # one shard's tokens [b, t, ...], the weights whole
            b, t, _ = x.shape
            gate_up, down, adapters = weights
            return dropless_experts(x.reshape(b * t, d), experts.reshape(b * t, -1), gates.reshape(b * t, -1),
                                    gate_up, down, activation(cfg.mlp_activation), adapters,
                                    kernels_of(cfg)).reshape(b, t, d)

        if cfg.moe_dispatch == "all_to_all" and expert_parallel.can_dispatch(batch, tokens):
            # Each routed row sent once to its expert's device and back (parallel/experts.py).
            local = lambda w, rows, sizes: expert_mlp(rows, sizes, w[0], w[1], activation(cfg.mlp_activation), w[2],
                                                      kernels_of(cfg))
            y, dropped = expert_parallel.dispatch(local, cfg.n_experts, cfg.moe_dispatch_capacity)(
                weights, x, experts, gates)
            return constrain(y, ("batch", "seq", "act_embed")), {**stats, "dropped": jnp.sum(dropped, axis=1)}
        # Each batch and sequence shard sorts and runs only its own tokens; XLA would otherwise gather every
        # token onto every device and repeat the whole call's work on each data/fsdp replica. Along `expert` the
        # tokens are still gathered: each device multiplies them by its own experts (there XLA's ragged_dot, a
        # dense dot masked per expert on CPU) and the partial outputs are all-reduced over `expert`.
        y = per_shard(per_shard(run, "seq", dim=1, keep=("expert",)), "batch", dim=0, keep=("expert",))(
            weights, x, experts, gates)
        return constrain(y, ("batch", "seq", "act_embed")), stats
