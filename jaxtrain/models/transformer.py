"""Llama-style decoder in Flax NNX: RoPE, RMSNorm, SwiGLU, grouped-query attention.

Every parameter names its dimensions with logical axes (`out_sharding`), which `jaxtrain.mesh`
turns into shardings. Layers are created stacked (leading "layers" axis) and run with `lax.scan`,
so compile time does not grow with depth.

Packed batches: `segment_ids` (0 = padding) keep attention inside each document and `positions`
restart at every document, so RoPE sees each document as if it were alone.

Decoding (`Transformer.decode`) runs the same blocks on a few new tokens against a per-layer K/V cache
(`init_cache`) used as a ring buffer: position p lives in slot p % cache_len, and a query sees the
newest cache_len positions up to itself. A cache shorter than the sequence is therefore a sliding window;
RoPE only sees relative distances, so absolute positions past the trained length stay in range.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtrain.mesh import constrain, split_ways
from jaxtrain.models import cpu_bf16
from jaxtrain.models.attention import attention_mask, causal_attention

# Every matmul against a weight (`project`, the MoE router) names its output WEIGHT_MATMUL, and
# "dots_with_no_batch_dims_saveable" saves by that name. Those are the dots jax's policy of that name saves in our
# layers, but it tells them apart by their batch dimensions, and under a vmap over weight copies (per-replica
# gradient accumulation, pipeline stages) every weight matmul has one: it then saved nothing, i.e. ran full remat.
WEIGHT_MATMUL = "weight_matmul"

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL),
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


# jax.nn.dot_product_attention's kernels that model.attention_impl may name (config.check_backend says where each
# runs). cuDNN's is unmeasured on jaxtrain so far: no GPU was lent when it was added (BUILD.md, GPU).
ATTENTION_IMPLS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    tie_embeddings: bool = True
    remat: str = "none"
    # Layers per iteration of the layer loop (lax.scan's `unroll`): 1 compiles in the same time at any depth;
    # n_layers removes the loop, which saves the stacked per-layer buffers (faster steps on CPU, slower compiles).
    scan_unroll: int = 1
    # Causal attention written out (einsums + softmax) in query blocks of this many positions, skipping the blocks
    # above the diagonal; 0 = one jax.nn.dot_product_attention call.
    attention_block: int = 0
    # That call's kernel: "xla" (jax's default, on every backend: [B, heads, T, T] logits) or "cudnn" (cuDNN's fused
    # flash attention, GPU only, bf16/fp16; the packed-document mask goes in as a bias). See ATTENTION_IMPLS.
    attention_impl: str = "xla"
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Mixture of experts (jaxtrain.models.moe): 0 = every block has a dense MLP. Otherwise every block's MLP is
    # `n_experts` experts of width d_ff, each token routed to its top `moe_top_k`; an expert takes at most
    # capacity = ceil(moe_capacity_factor * tokens_per_group * moe_top_k / n_experts) tokens per group.
    n_experts: int = 0
    moe_top_k: int = 2
    moe_capacity_factor: float = 1.25
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss added to the training loss
    # Tokens per routing group (0 = a whole sequence): capacity is per group and a group's tokens meet only their
    # own. Under sequence parallelism a group must sit on one sequence shard (seq_len / mesh.sequence or a divisor),
    # else every shard repeats its experts' work.
    moe_group_tokens: int = 0
    # Pipeline parallelism (jaxtrain.pipeline_parallel): how the layer stack runs, not what the model is. 1 stage = a
    # plain scan over the layers.
    pipeline_stages: int = 1
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = 1
    # The training loss: the output projection and cross-entropy run fused, about `loss_chunk_tokens` tokens per
    # device at a time (jaxtrain.models.cross_entropy), so the [B, T, vocab] logits never exist whole. 0 = unfused.
    loss_chunk_tokens: int = 0


def project(x, w, contract: int = 1, preferred_element_type=None):
    """x [..., K1..Kc] @ w [K1..Kc, N...] -> [..., N...] as one 2-D matmul. Same as the einsum, but XLA:CPU runs a
    dot with several free dimensions (e.g. "btd,df->btf") about 1.6x slower than the 2-D one; reshapes are free.
    Not when the sequence is split over devices: merging batch and sequence into one dimension made XLA gather
    every projection's input whole along the sequence (each device then computed every position)."""
    if split_ways("seq") > 1:
        dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
        y = jax.lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)
    else:
        k = math.prod(w.shape[:contract])
        if preferred_element_type is None and cpu_bf16.applies(x, w):
            y = cpu_bf16.matmul(x.reshape(-1, k), w.reshape(k, -1))
        else:
            y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=preferred_element_type)
        y = y.reshape(*x.shape[:x.ndim - contract], *w.shape[contract:])
    return checkpoint_name(y, WEIGHT_MATMUL)


def project_fused(x, weights, name: str, act_name: str):
    """[project(x, w) for w in weights] as one matmul, x [B, T, d]. Each w is [d, N_i, ...], its N_i split over the
    mesh axes the logical `name` maps to (`act_name` is the outputs' twin). Each is viewed as [d, T, N_i/T * ...]
    (T = those axes' size: each device's block of N_i stays whole) and the views are joined along the last
    dimension, which no device has to move. Under tensor parallelism the input's gradient is then one matmul and one
    all-reduce, not one per weight (Megatron's fused QKV and gate/up projections); without it, one wider matmul
    instead of several."""
    ways = split_ways(name)
    if any(w.shape[1] % ways for w in weights):  # some N_i not split evenly: nothing to join locally
        return [project(x, w) for w in weights]
    blocks = [w.reshape(w.shape[0], ways, -1) for w in weights]
    joined = constrain(jnp.concatenate(blocks, axis=-1), (None, name, None))
    y = constrain(project(x, joined), ("batch", "seq", act_name, None))
    parts = split_last(y, tuple(int(c) for c in np.cumsum([b.shape[-1] for b in blocks])[:-1]))
    return [part.reshape(*x.shape[:-1], *w.shape[1:]) for part, w in zip(parts, weights)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_last(y, cuts: tuple[int, ...]):
    """jnp.split(y, cuts, axis=-1), whose backward joins 16-bit cotangents as their raw bits. Joined as floats, XLA
    moved their narrowing converts below the concatenation: it and the fusions feeding it (RoPE's and SwiGLU's
    backward) wrote f32, twice the bytes (~13 ms of the bf16 bench_cpu step). Same values either way."""
    return jnp.split(y, cuts, axis=-1)


def _split_last_fwd(y, cuts):
    return split_last(y, cuts), None


def _split_last_bwd(cuts, _, grads):
    dtype = grads[0].dtype
    if dtype.itemsize != 2:
        return (jnp.concatenate(grads, axis=-1),)
    bits = jnp.concatenate([jax.lax.bitcast_convert_type(g, jnp.uint16) for g in grads], axis=-1)
    return (jax.lax.bitcast_convert_type(bits, dtype),)


split_last.defvjp(_split_last_fwd, _split_last_bwd)


def weight(param: nnx.Param, dtype):
    """A layer's weight in `dtype`, gathered whole over the axes FSDP splits it on (its "embed" dimension) and still
    split over the others (tensor, expert): the FSDP schedule, made explicit. Left to XLA, a projection whose input
    is split along the sequence could contract over the split d_model instead, regathering the activations along
    the sequence every layer. The gradient goes straight back to the parameter's own sharding, in its dtype, so
    the reduction over every batch axis is one reduce-scatter (a plain constraint's transpose would all-reduce
    the whole gradient over the sequence or expert axis first)."""
    value = param[...]
    names = tuple(param.get_metadata()["out_sharding"][-value.ndim:])  # a scanned layer's lead with "layers"
    return _gathered(value, jnp.dtype(dtype), names, value.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gathered(value, dtype, names, value_dtype):
    return constrain(value.astype(dtype), tuple(None if n == "embed" else n for n in names))


def _gathered_fwd(value, dtype, names, value_dtype):
    return _gathered(value, dtype, names, value_dtype), None


def _gathered_bwd(dtype, names, value_dtype, _, grad):
    return (constrain(grad.astype(value_dtype), names),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def _param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float | None = None, ones: bool = False):
    dtype = jnp.dtype(cfg.param_dtype)
    value = (jnp.ones(shape, dtype) if ones else
             jax.random.normal(rngs.params(), shape, dtype) * (cfg.init_std if std is None else std))
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.scale = _param(rngs, (cfg.d_model,), ("norm",), cfg, ones=True)
        self.eps = cfg.norm_eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's angle per unit of position for each of the head_dim // 2 rotated pairs, f32."""
    half = head_dim // 2
    return np.float32(theta) ** (-np.arange(half, dtype=np.float32) / half)


def rotary(positions, head_dim: int, theta: float):
    """RoPE's (cos, sin) at `positions` [B, T]: f32 [B, T, 1, head_dim // 2] each."""
    angle = positions.astype(jnp.float32)[:, :, None, None] * _frequencies(head_dim, theta)
    return jnp.cos(angle), jnp.sin(angle)


def rotary_lookup(positions, head_dim: int, theta: float):
    """`rotary` for positions that index their row, 0 <= p < T (the data pipeline restarts them at each document),
    read from a table of positions 0..T-1 built at trace time; a position outside it reads NaN. XLA fuses a sine
    into every op that reads it, so even computed once per step the sines were recomputed in each of the ~20
    fusions that apply or differentiate RoPE (~15 ms of the bf16 bench_cpu step); a lookup fuses as a load."""
    t = positions.shape[1]
    angle = np.arange(t, dtype=np.float32)[:, None] * _frequencies(head_dim, theta)
    index = jnp.where(positions < 0, t, positions)  # take would wrap a negative index around
    return tuple(jnp.take(table, index, axis=0, mode="fill", fill_value=np.nan)[:, :, None, :]
                 for table in (np.cos(angle), np.sin(angle)))


def rope(x, rotary_tables):
    """Rotary embedding, rotate-half form. x: [B, T, N, D]; rotary_tables: (cos, sin) from `rotary` or
    `rotary_lookup`."""
    cos, sin = rotary_tables
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), cfg)
        self.wk = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), cfg)
        self.wv = _param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), cfg)
        # Scaled down like GPT-2 so the residual stream does not grow with depth.
        self.wo = _param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"), cfg,
                         std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def qkv(self, x):
        """Q [B, T, heads, hd], K and V [B, T, kv_heads, hd]: one matmul when the heads split alike."""
        if split_ways("kv_heads") != split_ways("q_heads"):
            return [project(x, weight(w, x.dtype)) for w in (self.wq, self.wk, self.wv)]
        return project_fused(x, [weight(w, x.dtype) for w in (self.wq, self.wk, self.wv)], "q_heads", "act_heads")

    def __call__(self, x, rotary_tables, mask):
        dt = x.dtype
        q, k, v = self.qkv(x)
        q = constrain(rope(q, rotary_tables), ("batch", "seq", "act_heads", None))
        # Every query needs every earlier key: under sequence parallelism the queries stay split along the
        # sequence and K/V are gathered whole (None = not split), so attention is exact across shards.
        k = constrain(rope(k, rotary_tables), ("batch", None, "act_kv_heads", None))
        v = constrain(v, ("batch", None, "act_kv_heads", None))
        out = causal_attention(q, k, v, constrain(mask, ("batch", None, "seq", None)), self.cfg.attention_block,
                               self.cfg.attention_impl)
        out = constrain(out, ("batch", "seq", "act_heads", None))
        return project(out, weight(self.wo, dt), contract=2)

    def decode(self, x, positions, mask, cache_k, cache_v, slots):
        """x: [B, T, d] at `positions` [B, T]; cache_k/v: one layer's [B, L, kv, hd]; the new K/V go to `slots` [T].
        Returns (output [B, T, d], cache_k, cache_v)."""
        dt = x.dtype
        q, k, v = self.qkv(x)
        tables = rotary(positions, self.cfg.head_dim, self.cfg.rope_theta)  # positions past T: no table
        q, k = rope(q, tables), rope(k, tables)
        cache_k = cache_k.at[:, slots].set(k.astype(cache_k.dtype))
        cache_v = cache_v.at[:, slots].set(v.astype(cache_v.dtype))
        out = jax.nn.dot_product_attention(q, cache_k.astype(dt), cache_v.astype(dt), mask=mask)
        return project(out, weight(self.wo, dt), contract=2), cache_k, cache_v


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), cfg, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x):
        dt = x.dtype
        gate, up = project_fused(x, [weight(self.w_gate, dt), weight(self.w_up, dt)], "mlp", "act_mlp")
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "act_mlp"))
        return project(hidden, weight(self.w_down, dt))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        if cfg.n_experts:
            from jaxtrain.models.moe import MoE  # noqa: PLC0415 (moe builds on this module)
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg, rngs)

    def feed_forward(self, x):
        """(output, stats): stats are the MoE's routing counts per batch row (moe.route), or nothing."""
        out = self.mlp(self.mlp_norm(x))
        return out if isinstance(out, tuple) else (out, {})

    def __call__(self, x, rotary_tables, mask):
        """rotary_tables: RoPE's (cos, sin) (`rotary_lookup`). -> (x, this layer's MoE routing stats per row)."""
        x = x + self.attn(self.attn_norm(x), rotary_tables, mask)
        out, stats = self.feed_forward(x)
        return constrain(x + out, ("batch", "seq", "act_embed")), stats

    def decode(self, x, positions, mask, cache_k, cache_v, slots):
        attn_out, cache_k, cache_v = self.attn.decode(self.attn_norm(x), positions, mask, cache_k, cache_v, slots)
        x = x + attn_out
        return x + self.feed_forward(x)[0], cache_k, cache_v


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)

    def __call__(self, tokens, positions, segment_ids):
        """tokens, positions, segment_ids: int [B, T] -> logits [B, T, vocab] in the compute dtype. Positions index
        their row, 0 <= p < T (`rotary_lookup`); one outside gives NaN logits."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens, positions, segment_ids):
        """-> (logits, aux): aux holds per-layer means of the MoE's scalars over the batch (empty for a dense
        model)."""
        x, aux = self.hidden(tokens, positions, segment_ids)
        logits = project(x, self.head().astype(x.dtype))
        return constrain(logits, ("batch", "seq", "act_vocab")), aux

    def embed_tokens(self, tokens):
        """The embedding rows of `tokens` [B, T] -> [B, T, d_model] in the param dtype. The table is gathered whole
        along d_model first (FSDP shards it there, like every weight): left to XLA, a lookup into a table split
        along d_model against tokens split along the batch looked up every device's tokens in its d_model slice,
        then all-gathered and all-to-all'ed those activations back to the batch layout ("involuntary full
        rematerialization"), traffic that grows with the batch where the table's gather does not."""
        return jnp.take(constrain(self.embed[...], ("vocab", None)), tokens, axis=0)

    def head(self):
        """The output projection [d_model, vocab] in the param dtype (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.unembed[...]

    def hidden(self, tokens, positions, segment_ids):
        """-> (final-normed hidden states [B, T, d_model] in the compute dtype, aux): `forward` before the head."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        x = constrain(self.embed_tokens(tokens).astype(dt), ("batch", "seq", "act_embed"))
        block_def, block_state = nnx.split(self.blocks)
        policy = REMAT_POLICIES[cfg.remat]
        remat = (lambda f: f) if cfg.remat == "none" else (
            lambda f: jax.checkpoint(f, policy=policy, prevent_cse=False))

        if cfg.pipeline_stages == 1:
            mask, tables = attention_mask(segment_ids), rotary_lookup(positions, cfg.head_dim, cfg.rope_theta)

            def layer(x, state):
                return nnx.merge(block_def, state)(x, tables, mask)

            x, stats = jax.lax.scan(remat(layer), x, block_state, unroll=cfg.scan_unroll)  # stats [L, B, ...]
        else:
            from jaxtrain import pipeline_parallel  # noqa: PLC0415 (it imports jaxtrain.mesh, as we do)

            def pipelined_layer(state, carry):
                # The mask is rebuilt per microbatch from its segment ids: [T, T] per row, cheap next to attention.
                x, stats = nnx.merge(block_def, state)(
                    carry["x"], rotary_lookup(carry["positions"], cfg.head_dim, cfg.rope_theta),
                    attention_mask(carry["segment_ids"]))
                # Each row's MoE stats ride along as a shift register [rows, L, ...]: after the L layers, which a
                # microbatch always runs in order, slot l holds layer l's.
                routing = jax.tree.map(lambda buf, s: jnp.concatenate([buf[:, 1:], s[:, None]], axis=1),
                                       carry["moe"], stats)
                return {**carry, "x": x, "moe": routing}

            routing = {}
            if cfg.n_experts:
                from jaxtrain.models.moe import zero_stats  # noqa: PLC0415 (moe builds on this module)
                routing = zero_stats((tokens.shape[0], cfg.n_layers), cfg.n_experts)
            carry = pipeline_parallel.run(remat(pipelined_layer), block_state,
                                          {"x": x, "positions": positions, "segment_ids": segment_ids, "moe": routing},
                                          stages=cfg.pipeline_stages, microbatches=cfg.pipeline_microbatches,
                                          schedule=cfg.pipeline_schedule, repeats=cfg.pipeline_repeats)
            x = constrain(carry["x"], ("batch", "seq", "act_embed"))
            stats = jax.tree.map(lambda v: jnp.swapaxes(v, 0, 1), carry["moe"])

        return self.final_norm(x), layer_means(stats)

    def decode(self, tokens, cache, start, last_index=None):
        """Runs `tokens` [B, T] at positions start..start+T-1 (every row alike) against `cache` (`init_cache`),
        T <= cache length. Returns (logits [B, vocab] of the token at `last_index` (default T-1), new cache).

        The cache is a ring buffer: each query attends to the newest cache-length positions up to its own."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        batch, t = tokens.shape
        cache_len = cache["k"].shape[2]
        positions = start + jnp.arange(t, dtype=jnp.int32)
        slots = positions % cache_len
        # The position each slot holds once this call has written: the newest p <= end with p % L == slot.
        end = start + t - 1
        slot_positions = end - (end - jnp.arange(cache_len, dtype=jnp.int32)) % cache_len
        query, key = positions[:, None], slot_positions[None, :]
        # key >= 0: slots not written yet (or written with a padded prefill's future) stay invisible.
        mask = (key >= 0) & (key <= query) & (query - key < cache_len)

        x = self.embed_tokens(tokens).astype(dt)
        batch_positions = jnp.broadcast_to(positions, (batch, t))
        block_def, block_state = nnx.split(self.blocks)
        # The blocks may be stored in a pipeline's order (layer_order): the loop runs the model's layers in order,
        # each read from where it is stored, and the cache holds them in the model's order.
        stored_at = np.argsort(layer_order(cfg)).astype(np.int32)

        def layer(x, layer_in):
            at, cache_k, cache_v = layer_in
            state = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, at, keepdims=False), block_state)
            x, cache_k, cache_v = nnx.merge(block_def, state).decode(
                x, batch_positions, mask[None, None], cache_k, cache_v, slots)
            return x, (cache_k, cache_v)

        x, (new_k, new_v) = jax.lax.scan(layer, x, (stored_at, cache["k"], cache["v"]))
        x = x[:, t - 1 if last_index is None else last_index]
        x = self.final_norm(x)
        return project(x, self.head().astype(dt)), {"k": new_k, "v": new_v}


def layer_means(stats) -> dict:
    """MoE routing stats [layers, rows, ...] -> each layer's load-balancing loss and dropped fraction over all the
    rows, averaged over the layers; {} for a dense model."""
    if not stats:
        return {}
    from jaxtrain.models.moe import summarize  # noqa: PLC0415 (moe builds on this module)
    return jax.tree.map(jnp.mean, jax.vmap(summarize)(stats))


def layer_order(cfg: ModelConfig) -> tuple[int, ...]:
    """The model's layer at each position of the stacked blocks in a training state for `cfg`: its own order,
    unless the pipeline is circular (jaxtrain.pipeline_parallel.layer_order)."""
    from jaxtrain import pipeline_parallel  # noqa: PLC0415 (it imports jaxtrain.mesh, as we do)
    return pipeline_parallel.layer_order(cfg.n_layers, cfg.pipeline_stages, cfg.pipeline_repeats)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Empty K/V cache for `Transformer.decode`: {"k", "v"}: [layers, batch, length, kv_heads, head_dim]."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def build(cfg: ModelConfig, seed: int) -> Transformer:
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, nnx.Rngs(params=seed))


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token (the input embedding is a gather, not counted;
    the output projection is, tied or not; of a mixture of experts, the top-k experts only)."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * cfg.d_model * cfg.d_ff
    if cfg.n_experts:  # the router, and the experts a token is routed to (MoE FLOPs count active params)
        mlp = cfg.d_model * cfg.n_experts + cfg.moe_top_k * mlp
    return cfg.n_layers * (attn + mlp) + cfg.d_model * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token, counted as MaxText does for a dense decoder:
    6 * N_matmul (forward 2, backward 4) plus causal attention 6 * L * S * H * d_head
    (QK^T and AV are 2 * 2 * S * H * d_head per token forward, halved for causality, times 3 for fwd+bwd).
    Remat recomputation is not counted: MFU measures useful work."""
    return 6.0 * matmul_params(cfg) + 6.0 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
