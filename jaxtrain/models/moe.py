"""Mixture-of-experts feed-forward layer (GShard / Switch style): top-k routing with a capacity per expert.

`MoE(cfg, rngs)(x) -> (y, stats)`: stats are each batch row's routing counts (`route`), which `summarize` turns
into {"load_balance_loss", "dropped_fraction"} of any set of rows, so a pipelined model, which routes each
microbatch on its own, still gets the whole batch's loss. Experts are SwiGLU MLPs stacked on an "experts" axis.
The router runs in float32; each token takes its top `moe_top_k` experts with their probabilities renormalised
(Mixtral). Within a routing group of G tokens (a row, or `moe_group_tokens` of it) an expert takes at most
C = ceil(capacity_factor * G * k / E) tokens, first choices before second ones; the rest are dropped (the
residual carries them). Dispatch and combine are one-hot einsums with static shapes, so with experts on the
`expert` mesh axis XLA inserts the all-to-alls. load_balance_loss = E * sum_e f_e * P_e (1 when balanced; only
P_e carries a gradient). Every token counts, padding included (docs/parallelism.md).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.models.config import WEIGHT_MATMUL, ModelConfig
from jaxtrain.models.layers import param, split_last, weight
from jaxtrain.parallel.mesh import constrain, split_ways


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


def route(logits: jax.Array, top_k: int, capacity: int):
    """Router logits [..., T, E] (f32; the leading dims index groups) -> (dispatch [..., T, E, C] f32 0/1,
    combine [..., T, E, C] f32, stats).

    dispatch[..., t, e, c] = 1 where token t of its group fills slot c of expert e; combine is dispatch times
    that assignment's gate weight. stats, f32 per group: "routed" [..., E] assignments that chose each expert
    (before capacity), "prob" [..., E] summed router probabilities, "dropped" [...] assignments past capacity,
    "tokens" [...]; `summarize` turns any set of them into the load-balancing loss and dropped fraction."""
    *groups, tokens, n_experts = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_probs, top_idx = _top_k(probs, top_k)  # [..., T, k], best first
    gates = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
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


def zero_stats(leading: tuple[int, ...], n_experts: int) -> dict:
    """Routing statistics of no tokens, shaped like `route`'s with leading dims `leading`."""
    return {"routed": jnp.zeros((*leading, n_experts)), "prob": jnp.zeros((*leading, n_experts)),
            "dropped": jnp.zeros(leading), "tokens": jnp.zeros(leading)}


def summarize(stats: dict) -> dict:
    """Routing statistics (`route`'s, any leading dims, all of which are summed) -> the f32 scalars
    {"load_balance_loss", "dropped_fraction"} of all those tokens together."""
    routed, prob = (jnp.sum(stats[k], axis=tuple(range(stats[k].ndim - 1))) for k in ("routed", "prob"))
    assignments = jnp.sum(routed)
    fraction_routed = routed / assignments  # f_e
    mean_prob = prob / jnp.sum(stats["tokens"])  # P_e
    return {"load_balance_loss": routed.shape[-1] * jnp.sum(fraction_routed * mean_prob),
            "dropped_fraction": jnp.sum(stats["dropped"]) / assignments}


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
        self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), cfg)
        self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), cfg,
                             std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def gate_up(self, expert_in, dt):
        """The gate and up projections of the expert buffer [E, B, N, C, d] as one matmul per expert, joined as
        layers.project_fused joins them (one input-gradient all-reduce under tensor parallelism)."""
        w_gate, w_up = weight(self.w_gate, dt), weight(self.w_up, dt)
        ways = split_ways("mlp")
        if w_gate.shape[-1] % ways:
            return [jnp.einsum("ebncd,edf->ebncf", expert_in, w) for w in (w_gate, w_up)]
        e, d, f = w_gate.shape
        joined = jnp.concatenate([w.reshape(e, d, ways, f // ways) for w in (w_gate, w_up)], axis=-1)
        joined = constrain(joined, ("experts", None, "mlp", None))
        y = jnp.einsum("ebncd,edtg->ebnctg", expert_in, joined)
        return [part.reshape(*y.shape[:4], f) for part in split_last(y, (y.shape[-1] // 2,))]

    def __call__(self, x):
        """x [B, T, d] -> (y [B, T, d] in x's dtype, routing stats per row: `route`'s summed over each row's groups,
        leading dim B, which `summarize` turns into the load-balancing loss and dropped fraction)."""
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
                                         capacity(cfg.moe_capacity_factor, group, cfg.moe_top_k, cfg.n_experts))
        dispatch = constrain(dispatch.astype(dt), (*seq, None, None))
        combine = constrain(combine.astype(dt), (*seq, None, None))

        # The expert buffer [E, B, N, C, d]: with groups, each sequence shard fills and runs its own groups' slots.
        rows = ("act_experts", "batch", "seq" if group < tokens else None, None)
        expert_in = constrain(jnp.einsum("bngec,bngd->ebncd", dispatch, x), (*rows, "act_embed"))
        gate, up = self.gate_up(expert_in, dt)
        hidden = constrain(jax.nn.silu(gate) * up, (*rows, "act_mlp"))
        expert_out = constrain(jnp.einsum("ebncf,efd->ebncd", hidden, weight(self.w_down, dt)),
                               (*rows, "act_embed"))
        # Back to the token layout here, so that the combine's backward keeps this copy for the gates' gradient (left
        # to XLA, a pipeline's tick loop moved the expert outputs once more in the backward).
        expert_out = constrain(expert_out, (None, "batch", rows[2], None, "act_embed"))
        y = jnp.einsum("bngec,ebncd->bngd", combine, expert_out).reshape(batch, tokens, d)
        return constrain(y, ("batch", "seq", "act_embed")), jax.tree.map(lambda v: jnp.sum(v, axis=1), stats)
