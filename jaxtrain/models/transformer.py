"""One decoder in Flax NNX for every family: RoPE, RMSNorm, gated MLP, grouped-query attention, and the
options the open families add (ModelConfig: biases, q/k norms, sliding windows, Gemma's norms and caps, MoE).

Every parameter names its dimensions with logical axes (`out_sharding`), which `jaxtrain.parallel.mesh`
turns into shardings. Layers are created stacked (leading "layers" axis) and run with `lax.scan`,
so compile time does not grow with depth.

Packed batches: `segment_ids` (0 = padding) keep attention inside each document and `positions`
restart at every document, so RoPE sees each document as if it were alone.

Decoding (`Transformer.decode`) runs the same blocks on a few new tokens against a per-layer K/V cache
(`init_cache`) used as a ring buffer: position p lives in slot p % cache_len, and a query sees the
newest cache_len positions up to itself. A cache shorter than the sequence is therefore a sliding window;
RoPE only sees relative distances, so absolute positions past the trained length stay in range. Sliding-window
layers keep a ring of their own window only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models import gpu_flash, lora, mla, moe, tpu_flash
from jaxtrain.models.attention import attention_mask, causal_attention, layer_mask, self_attention
from jaxtrain.models.config import REMAT_POLICIES, Layout, ModelConfig
from jaxtrain.models.layers import (
    RMSNorm,
    activation,
    adapted,
    ahead,
    param,
    project,
    project_fused,
    rope,
    rope_frequencies,
    rotary,
    rotary_lookup,
    weight,
)
from jaxtrain.errors import ConfigError
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline as pipeline_parallel
from jaxtrain.parallel import pipeline_exec
from jaxtrain.parallel.mesh import constrain, split_ways


class Attention(nnx.Module):
    """`grad_dtype`: Layout.grad_reduce_dtype, what its weights' gradients are reduced in."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str = "float32"):
        self.cfg, self.grad_dtype = cfg, grad_dtype
        d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), cfg)
        self.wk = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), cfg)
        self.wv = param(rngs, (d, kv, hd), ("embed", "kv_heads", "head_dim"), cfg)
        # Scaled down like GPT-2 so the residual stream does not grow with depth.
        self.wo = param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"), cfg,
                         std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        for name, contract in (("wq", 1), ("wk", 1), ("wv", 1), ("wo", 2)):
            w = getattr(self, name)
            lora.add(self, name, name[1], w.shape, w.get_metadata()["out_sharding"], contract, cfg, rngs)
        if cfg.qkv_bias:
            zeros = lambda n, names: nnx.Param(jnp.zeros((n, hd), cfg.param_dtype), out_sharding=names,
                                               eager_sharding=False)
            self.bq = zeros(h, ("q_heads", "head_dim"))
            self.bk, self.bv = zeros(kv, ("kv_heads", "head_dim")), zeros(kv, ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, rngs, dim=hd, names=("head_dim",))
            self.k_norm = RMSNorm(cfg, rngs, dim=hd, names=("head_dim",))

    def qkv(self, x, keys=None):
        """Q [B, T, heads, hd], K and V [B, T, kv_heads, hd]: one matmul when the heads split alike; then the
        biases and q/k norms where the family has them (before RoPE). `keys`: LoRA dropout's (lora.dropout)."""
        if split_ways("kv_heads") != split_ways("q_heads"):
            q, k, v = [project(x, weight(w, x.dtype), quant=self.cfg.quant, grad_dtype=self.grad_dtype)
                       for w in (self.wq, self.wk, self.wv)]
        else:
            q, k, v = project_fused(x, [weight(w, x.dtype) for w in (self.wq, self.wk, self.wv)], "q_heads",
                                    "act_heads", quant=self.cfg.quant, grad_dtype=self.grad_dtype)
        q, k, v = (adapted(self, name, x, y, keys=keys) for name, y in (("wq", q), ("wk", k), ("wv", v)))
        if self.cfg.qkv_bias:
            q, k, v = (y + weight(b, x.dtype) for y, b in zip((q, k, v), (self.bq, self.bk, self.bv)))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, mask, decoding: bool = False):
        """Decoding reads a ring buffer whose slots are not in query order: the plain XLA kernel, mask only."""
        cfg = self.cfg
        block, impl = (0, "xla") if decoding else (cfg.attention_block, cfg.attention_impl)
        return causal_attention(q, k, v, mask, block, impl, cfg.attn_scale, cfg.attn_softcap)

    def __call__(self, x, rotary_tables, mask, keys=None):
        dt = x.dtype
        q, k, v = self.qkv(x, keys)
        q = constrain(rope(q, rotary_tables), ("batch", "seq", "act_heads", None))
        out = self_attention(q, rope(k, rotary_tables), v, mask, self.attend, self.cfg.context_parallel,
                             self.cfg.attn_scale, self.cfg.ulysses_ways,
                             _ring_kernel() if self.cfg.attention_impl == "pallas" else None)
        out = constrain(out, ("batch", "seq", "act_heads", None))
        return adapted(self, "wo", out, project(out, weight(self.wo, dt), contract=2, quant=self.cfg.quant,
                                                grad_dtype=self.grad_dtype), contract=2, keys=keys)

    def decode(self, x, tables, mask, cache: dict, slots, ring_from=None):
        """x: [B, T, d] rotated by `tables` (`rotary` at its positions); cache: one layer's {"k", "v"} [B, L, kv, hd];
        the new K/V go to `slots` [T]. Returns (output [B, T, d], cache). `ring_from`: the cache is a sliding
        window's ring, maybe shorter than T, so the queries attend to what it held before this call followed by the
        new keys (mask [.., T, L + T]); then the len(slots) new K/V from `ring_from` on are kept."""
        dt = x.dtype
        cache_k, cache_v = cache["k"], cache["v"]
        q, k, v = self.qkv(x)
        q, k = rope(q, tables), rope(k, tables)
        if ring_from is not None:
            keys, values = (jnp.concatenate([c.astype(dt), new], axis=1) for c, new in ((cache_k, k), (cache_v, v)))
            k, v = (jax.lax.dynamic_slice_in_dim(new, ring_from, len(slots), axis=1) for new in (k, v))
        cache_k = cache_k.at[:, slots].set(k.astype(cache_k.dtype))
        cache_v = cache_v.at[:, slots].set(v.astype(cache_v.dtype))
        if ring_from is None:
            keys, values = cache_k.astype(dt), cache_v.astype(dt)
        mask = jnp.broadcast_to(mask, (q.shape[0], 1, q.shape[1], keys.shape[1]))
        out = self.attend(q, keys, values, mask, decoding=True)
        out = adapted(self, "wo", out, project(out, weight(self.wo, dt), contract=2, quant=self.cfg.quant), contract=2)
        return out, {"k": cache_k, "v": cache_v}


class MLP(nnx.Module):
    """The gated MLP, `width` wide (default d_ff)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str = "float32", width: int | None = None):
        d, f = cfg.d_model, cfg.d_ff if width is None else width
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), cfg, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        for name in ("w_gate", "w_up", "w_down"):
            w = getattr(self, name)
            lora.add(self, name, name[2:], w.shape, w.get_metadata()["out_sharding"], 1, cfg, rngs)
        self.act = activation(cfg.mlp_activation)
        self.cfg, self.quant, self.grad_dtype = cfg, cfg.quant, grad_dtype

    def __call__(self, x, keys=None):
        dt = x.dtype
        gate, up = project_fused(x, [weight(self.w_gate, dt), weight(self.w_up, dt)], "mlp", "act_mlp",
                                 quant=self.quant, grad_dtype=self.grad_dtype)
        gate, up = adapted(self, "w_gate", x, gate, keys=keys), adapted(self, "w_up", x, up, keys=keys)
        hidden = constrain(self.act(gate) * up, ("batch", "seq", "act_mlp"))
        return adapted(self, "w_down", hidden, project(hidden, weight(self.w_down, dt), quant=self.quant,
                                                       grad_dtype=self.grad_dtype), keys=keys)


class Block(nnx.Module):
    """Attention (latent attention with model.kv_lora_rank), then the MLP: a mixture of experts where the model has
    one, plus its shared experts, or a dense MLP (`dense`: DeepSeek-V3's first layers, dense_d_ff wide)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str = "float32", dense: bool = False):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = (mla.LatentAttention if cfg.kv_lora_rank else Attention)(cfg, rngs, grad_dtype)
        self.mlp_norm = RMSNorm(cfg, rngs)
        if cfg.n_experts and not dense:
            self.mlp = moe.MoE(cfg, rngs)
            if cfg.n_shared_experts:
                self.shared_mlp = MLP(cfg, rngs, grad_dtype, width=cfg.n_shared_experts * cfg.d_ff)
        else:
            self.mlp = MLP(cfg, rngs, grad_dtype, width=cfg.dense_d_ff if dense else None)
        if cfg.post_norms:  # Gemma: each sublayer's output is normed before the residual add
            self.attn_post_norm = RMSNorm(cfg, rngs)
            self.mlp_post_norm = RMSNorm(cfg, rngs)

    def feed_forward(self, x, keys=None):
        """(output, stats): stats are the MoE's routing counts per batch row (moe.route), or nothing."""
        h = self.mlp_norm(x)
        out, stats = self.mlp(h) if self.mlp_is_moe else (self.mlp(h, keys), {})
        if hasattr(self, "shared_mlp"):
            out = out + self.shared_mlp(h, keys)
        return (self.mlp_post_norm(out) if self.post_norms else out), stats

    @property
    def mlp_is_moe(self):
        return isinstance(self.mlp, moe.MoE)

    @property
    def post_norms(self):
        return hasattr(self, "attn_post_norm")

    def __call__(self, x, rotary_tables, mask, keys=None):
        """rotary_tables: RoPE's (cos, sin) (`rotary_lookup`); keys: LoRA dropout's per-row keys (lora.dropout),
        None outside training. -> (x, this layer's MoE routing stats per row)."""
        out = self.attn(self.attn_norm(x), rotary_tables, mask, keys)
        x = x + (self.attn_post_norm(out) if self.post_norms else out)
        out, stats = self.feed_forward(x, keys)
        return constrain(x + out, ("batch", "seq", "act_embed")), stats

    def decode(self, x, tables, mask, cache: dict, slots, ring_from=None):
        """One layer's cache in and out: {"k", "v"}, or latent attention's {"latent", "rope_key"}."""
        out, cache = self.attn.decode(self.attn_norm(x), tables, mask, cache, slots, ring_from)
        x = x + (self.attn_post_norm(out) if self.post_norms else out)
        return x + self.feed_forward(x)[0], cache


class Predictor(nnx.Module):
    """One multi-token prediction module (DeepSeek-V3): the embedding of the token it looks ahead to and the
    previous hidden state, each normed, projected together to d_model, then a block (of experts where the model has
    them) and a final norm, whose output the model's head reads and the next module takes (as transformers' MtpModel
    chains them)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str = "float32"):
        self.enorm, self.hnorm = RMSNorm(cfg, rngs), RMSNorm(cfg, rngs)
        self.eh_proj = param(rngs, (2 * cfg.d_model, cfg.d_model), ("mlp", "embed"), cfg)
        self.block = Block(cfg, rngs, grad_dtype)
        self.norm = RMSNorm(cfg, rngs)
        self.grad_dtype = grad_dtype

    def __call__(self, h, embedded, rotary_tables, mask):
        """h: the previous hidden state [B, T, d]; embedded: the looked-ahead tokens' embeddings -> (this module's
        hidden state, its block's MoE routing stats)."""
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(h)], axis=-1)
        x = project(x, weight(self.eh_proj, h.dtype), grad_dtype=self.grad_dtype)
        x, stats = self.block(constrain(x, ("batch", "seq", "act_embed")), rotary_tables, mask)
        return self.norm(x), stats


class Transformer(nnx.Module):
    """The decoder `cfg` describes, run as `layout` says (pipeline, remat, gradient-reduction dtype)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layout: Layout = Layout()):
        self.cfg, self.layout = cfg, layout
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)
        if cfg.first_dense_layers:  # DeepSeek-V3: a stack of its own, run before `blocks`
            self.dense_blocks = stacked_blocks(cfg, rngs, layout, cfg.first_dense_layers, dense=True)
        self.blocks = stacked_blocks(cfg, rngs, layout, cfg.stacked_layers)
        self.final_norm = RMSNorm(cfg, rngs)
        if cfg.mtp_layers:  # after the model, a stack of their own (Predictor)
            self.mtp = stacked(cfg, rngs, cfg.mtp_layers, lambda r: Predictor(cfg, r, layout.grad_reduce_dtype))
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)

    def __call__(self, tokens, positions, segment_ids):
        """tokens, positions, segment_ids: int [B, T] -> logits [B, T, vocab] in the compute dtype. Positions index
        their row, 0 <= p < T (`rotary_lookup`); one outside gives NaN logits."""
        return self.forward(tokens, positions, segment_ids)[0]

    def forward(self, tokens, positions, segment_ids, dropout_keys=None):
        """-> (logits, aux): aux holds per-layer means of the MoE's scalars over the batch (empty for a dense
        model). dropout_keys: uint32 key data [B, ...], one per row, which turn LoRA's dropout on (training)."""
        x, aux = self.hidden(tokens, positions, segment_ids, dropout_keys)
        return self.logits(x), aux

    def logits(self, x):
        """The head on hidden states [B, T, d_model] (`hidden`'s, or a prediction module's: `mtp`)."""
        logits = self.cap(project(x, self.head().astype(x.dtype), grad_dtype=self.layout.grad_reduce_dtype))
        return constrain(logits, ("batch", "seq", "act_vocab"))

    def cap(self, logits):
        """The final logit soft-cap (Gemma 2), where the family has one."""
        c = self.cfg.final_softcap
        return logits if not c else (c * jnp.tanh(logits.astype(jnp.float32) / c)).astype(logits.dtype)

    def embed_tokens(self, tokens):
        """The embedding rows of `tokens` [B, T] -> [B, T, d_model] in the param dtype. The table is gathered whole
        along d_model first (FSDP shards it there, like every weight): left to XLA, a lookup into a table split
        along d_model against tokens split along the batch looked up every device's tokens in its d_model slice,
        then all-gathered and all-to-all'ed those activations back to the batch layout ("involuntary full
        rematerialization"), traffic that grows with the batch where the table's gather does not."""
        x = jnp.take(constrain(self.embed[...], ("vocab", None)), tokens, axis=0)
        if self.cfg.embed_scale:  # Gemma: times sqrt(d_model), rounded to the weights' dtype as Gemma's own code does
            x = x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype)
        return x

    def head(self):
        """The output projection [d_model, vocab] in the param dtype (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.unembed[...]

    def hidden(self, tokens, positions, segment_ids, dropout_keys=None):
        """-> (final-normed hidden states [B, T, d_model] in the compute dtype, aux): `forward` before the head."""
        x, stats = self.layers(tokens, positions, segment_ids, dropout_keys)
        return x, layer_means(stats, self.cfg.moe_aux_loss == "sequence")

    def hidden_and_mtp(self, tokens, positions, segment_ids, dropout_keys=None):
        """-> (`hidden`'s hidden states, aux, the prediction modules' [mtp_layers, B, T, d_model]): module k (from 0)
        at position i has seen the tokens up to i + k + 1 and predicts the one after (`mtp`). aux counts the
        modules' routing after the model's layers."""
        x, stats = self.layers(tokens, positions, segment_ids, dropout_keys)
        predicted, mtp_stats = self.mtp_states(x, tokens, positions, segment_ids)
        stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)
        return x, layer_means(stats, self.cfg.moe_aux_loss == "sequence"), predicted

    def mtp_states(self, x, tokens, positions, segment_ids):
        """The prediction modules run in turn from the final-normed hidden states `x` (DeepSeek-V3 and
        transformers' MtpModel chain from the model's normed output): module k takes the embedding of the token
        k + 1 ahead (`ahead`; 0 past the row's end) at each position. A module stays within each document: its
        block's mask is the model's, and a position whose look-ahead crosses into the next document is not scored
        (objectives.next_token_targets). -> (states [mtp_layers, B, T, d], their MoE stats [mtp_layers, B, ...])."""
        mask = layer_mask(segment_ids, positions, 0, self.cfg.context_parallel)
        tables = rotary_lookup(positions, rope_frequencies(self.cfg))
        looked_ahead = jnp.stack([ahead(tokens, k + 1) for k in range(self.cfg.mtp_layers)])
        embedded = self.embed_tokens(looked_ahead).astype(x.dtype)
        mtp_def, mtp_state = nnx.split(self.mtp)

        def module(h, xs):
            h, stats = nnx.merge(mtp_def, xs[0])(h, xs[1], tables, mask)
            return h, (h, stats)

        _, (states, stats) = jax.lax.scan(self.remat(module), x, (mtp_state, embedded))
        return states, stats

    def dense_first(self, x, positions, segment_ids, dropout_keys):
        """DeepSeek-V3's dense first layers (a stack of their own, global attention: config refuses windows) ->
        (x, the dropout keys folded past them). They run before `blocks`, outside any pipeline, as the embedding
        does: every stage holds them."""
        cfg = self.cfg
        if not cfg.first_dense_layers:
            return x, dropout_keys
        tables = rotary_lookup(positions, rope_frequencies(cfg))
        mask = layer_mask(segment_ids, positions, 0, cfg.context_parallel)
        dense_def, dense_state = nnx.split(self.dense_blocks)
        (x, dropout_keys), _ = jax.lax.scan(self.remat(stack_layer(dense_def, tables, mask)), (x, dropout_keys),
                                            dense_state, unroll=cfg.scan_unroll)
        return x, dropout_keys

    def remat(self, f):
        """`f` under the layout's rematerialization policy."""
        if self.layout.remat == "none":
            return f
        return jax.checkpoint(f, policy=REMAT_POLICIES[self.layout.remat], prevent_cse=False)

    def layers(self, tokens, positions, segment_ids, dropout_keys=None):
        """The embedding and the layers -> (final-normed hidden states, the MoE layers' routing stats [L, B, ...])."""
        cfg, run = self.cfg, self.layout
        dt = jnp.dtype(cfg.dtype)
        x = constrain(self.embed_tokens(tokens).astype(dt), ("batch", "seq", "act_embed"))
        x, dropout_keys = self.dense_first(x, positions, segment_ids, dropout_keys)
        block_def, block_state = nnx.split(self.blocks)
        local = local_layers(cfg)
        remat = self.remat

        if run.pipeline_stages == 1:
            if local is None or local.all():  # every layer alike
                uniform = local is not None
                mask = layer_mask(segment_ids, positions, cfg.sliding_window if uniform else 0, cfg.context_parallel)
                tables = rotary_lookup(positions, rope_frequencies(cfg, local=uniform))
                layer, xs = stack_layer(block_def, tables, mask), block_state
            else:  # sliding and global layers: each layer picks its mask and RoPE tables
                masks = (layer_mask(segment_ids, positions, cfg.sliding_window, cfg.context_parallel),
                         layer_mask(segment_ids, positions, 0, cfg.context_parallel))
                tables = (rotary_lookup(positions, rope_frequencies(cfg, local=True)),
                          rotary_lookup(positions, rope_frequencies(cfg)))

                def layer(carry, xs):
                    state, slides = xs
                    pick = lambda a, b: jnp.where(slides, a, b)
                    x, stats = nnx.merge(block_def, state)(carry[0], jax.tree.map(pick, *tables),
                                                           jax.tree.map(pick, *masks), carry[1])
                    return (x, lora.next_keys(carry[1])), stats

                xs = (block_state, jnp.asarray(local))
            # Each layer's LoRA dropout keys are the previous layer's, folded (lora.next_keys), as in a pipeline.
            (x, _), stats = jax.lax.scan(remat(layer), (x, dropout_keys), xs, unroll=cfg.scan_unroll)  # [L, B, ...]
        else:  # every layer alike (config validation refuses mixed sliding and global layers in a pipeline)
            window = cfg.sliding_window if local is not None else 0
            freqs = rope_frequencies(cfg, local=local is not None)

            def pipelined_layer(state, carry):
                # The mask is rebuilt per microbatch from its segment ids: [T, T] per row, cheap next to attention.
                x, stats = nnx.merge(block_def, state)(
                    carry["x"], rotary_lookup(carry["positions"], freqs), attention_mask(carry["segment_ids"], window),
                    carry.get("dropout"))
                # Each row's MoE stats ride along as a shift register [rows, L, ...]: after the L layers, which a
                # microbatch always runs in order, slot l holds layer l's.
                routing = jax.tree.map(lambda buf, s: jnp.concatenate([buf[:, 1:], s[:, None]], axis=1),
                                       carry["moe"], stats)
                if "dropout" in carry:
                    carry = {**carry, "dropout": lora.next_keys(carry["dropout"])}
                return {**carry, "x": x, "moe": routing}

            routing = {}
            if cfg.n_experts:
                routing = moe.zero_stats((tokens.shape[0], cfg.stacked_layers), cfg.n_experts)
            carry = {"x": x, "positions": positions, "segment_ids": segment_ids, "moe": routing}
            if dropout_keys is not None:
                carry["dropout"] = dropout_keys
            # An explicit schedule (pipeline_exec) trains through `hidden_loss`; here it runs forwards only.
            carry = pipeline_parallel.run(remat(pipelined_layer), block_state, carry,
                                          stages=run.pipeline_stages, microbatches=run.pipeline_microbatches,
                                          schedule=pipeline_exec.FORWARD[run.pipeline_schedule],
                                          repeats=run.pipeline_repeats)
            if run.pipeline_schedule in pipeline_parallel.EXPLICIT:
                carry = _not_differentiated(carry, run.pipeline_schedule)
            x = constrain(carry["x"], ("batch", "seq", "act_embed"))
            stats = jax.tree.map(lambda v: jnp.swapaxes(v, 0, 1), carry["moe"])

        return self.final_norm(x), stats

    def hidden_loss(self, tokens, positions, segment_ids, dropout_keys, loss_fn, rows):
        """(loss_fn(self, `hidden`'s states, rows), aux) for a loss that sums over rows (`rows`: its per-row inputs
        [B, ...]). Under an explicit pipeline schedule (pipeline.EXPLICIT) the executor runs the layers and, in
        the last stage, the final norm and loss_fn, a microbatch at a time (jaxtrain.parallel.pipeline_exec)."""
        run = self.layout
        if run.pipeline_stages == 1 or run.pipeline_schedule not in pipeline_parallel.EXPLICIT:
            x, aux = self.hidden(tokens, positions, segment_ids, dropout_keys)
            return loss_fn(self, x, rows), aux
        cfg = self.cfg  # config.validate refuses a load-balancing loss here (its batch-wide routing comes too late)
        mesh, rules = mesh_lib.active_sharding()
        S, R = run.pipeline_stages, run.pipeline_repeats
        K = cfg.stacked_layers // (S * R)
        x = constrain(self.embed_tokens(tokens).astype(jnp.dtype(cfg.dtype)), ("batch", "seq", "act_embed"))
        x, dropout_keys = self.dense_first(x, positions, segment_ids, dropout_keys)
        # Under LoRA the base weights are not differentiated: only the adapters' weight gradients are computed.
        if cfg.lora_rank:
            block_def, block_state, frozen = nnx.split(self.blocks, lambda path, _: lora.is_adapter(str(path[-1])), ...)
        else:
            (block_def, block_state), frozen = nnx.split(self.blocks), nnx.State({})
        stacks = nnx.Any(nnx.PathContains("blocks"), nnx.PathContains("dense_blocks"))  # dense ones ran above
        graphdef, tail, blocks = nnx.split(self, nnx.Not(stacks), ...)
        window = cfg.sliding_window if local_layers(cfg) is not None else 0
        freqs = rope_frequencies(cfg, local=window > 0)

        def stage_fn(params, frozen, x, side, chunk):  # chunk (stored stage-major) of K layers -> (x, MoE stats)
            keys = side.get("dropout")
            if keys is not None:  # the keys the model's layer chunk * K draws from
                keys = jax.lax.fori_loop(0, chunk * K, lambda _, k: lora.next_keys(k), keys)
            tables, mask = rotary_lookup(side["positions"], freqs), attention_mask(side["segment_ids"], window)

            def layer(carry, state):
                x, stats = nnx.merge(block_def, *state)(carry[0], tables, mask, carry[1])
                return (x, lora.next_keys(carry[1])), stats

            (x, _), stats = jax.lax.scan(self.remat(layer), (x, keys), (params, frozen))
            return x, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), stats)  # [rows, K, ...]

        def tail_fn(tail, y, side):  # the blocks' values are not read: placeholders
            model = nnx.merge(graphdef, tail, jax.tree.map(lambda a: jnp.zeros((), a.dtype), blocks))
            return loss_fn(model, model.final_norm(y), side["rows"])

        staged = [jax.tree.map(lambda w: constrain(w.reshape(S, R, K, *w.shape[1:]), ("stages",)), t)
                  for t in (block_state, frozen)]
        side = {"positions": positions, "segment_ids": segment_ids, "rows": rows}
        if dropout_keys is not None:
            side["dropout"] = dropout_keys
        # Every batch axis is manual (fsdp too: the stage weights are gathered once a step), so that the auto
        # axes are at most tensor's: XLA's partitioner failed a check with fsdp and tensor both auto (jax 0.10.2).
        batch_axes = tuple(a for a in rules.get("batch", ()) if mesh.shape[a] > 1)
        loss, stats = pipeline_exec.pipelined_loss(
            stage_fn, tail_fn, *staged, tail, x, side, mesh=mesh, schedule=run.pipeline_schedule,
            microbatches=run.pipeline_microbatches, repeats=R, batch_axes=batch_axes)
        # [S, R, M, rows, K, ...] (stage s, chunk r holds layers ((r*S + s)*K + k)) -> [L, B, ...], model order.
        stats = jax.tree.map(lambda a: a.transpose(1, 0, 4, 3, 2, *range(5, a.ndim)).reshape(
            S * R * K, a.shape[2] * a.shape[3], *a.shape[5:]), stats)
        return loss, layer_means(stats, cfg.moe_aux_loss == "sequence")

    def init_cache(self, batch: int, length: int) -> dict:
        """An empty K/V cache for `decode` (the module-level `init_cache` for this model's config)."""
        return init_cache(self.cfg, batch, length)

    def decode(self, tokens, cache, start, last_index=None, left_pad=None):
        """Runs `tokens` [B, T] at positions start..start+T-1 (every row alike) against `cache` (`init_cache`),
        T <= cache length. Returns (logits [B, vocab] of the token at `last_index` (default T-1), new cache).

        The cache is a ring buffer: each query attends to the newest cache-length positions up to its own. With
        "k_local" (`init_cache`) the sliding-window layers have their own ring of `sliding_window` slots.
        `left_pad` (int [B], default none): rows of different lengths end together, row b's first left_pad[b]
        positions being padding that no other query sees; its RoPE positions are shifted down by left_pad[b], so
        each row computes what it would alone from position 0 (jaxtrain.models.rollout)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        batch, t = tokens.shape
        cache_len = cache["latent" if "latent" in cache else "k"].shape[2]
        positions = start + jnp.arange(t, dtype=jnp.int32)
        slots = positions % cache_len
        # The position each slot holds once this call has written: the newest p <= end with p % L == slot.
        end = start + t - 1
        slot_positions = end - (end - jnp.arange(cache_len, dtype=jnp.int32)) % cache_len
        query, key = positions[:, None], slot_positions[None, :]
        # key >= 0: slots not written yet (or written with a padded prefill's future) stay invisible.
        mask = hide_left_pad((key >= 0) & (key <= query) & (query - key < cache_len), query, key, left_pad)

        x = self.embed_tokens(tokens).astype(dt)
        batch_positions = jnp.broadcast_to(positions, (batch, t))
        if left_pad is not None:
            batch_positions = batch_positions - jnp.asarray(left_pad, jnp.int32)[:, None]
        block_def, block_state = nnx.split(self.blocks)
        # The blocks may be stored in a pipeline's order (layer_order): the loop runs the model's layers in order,
        # each read from where it is stored, and the cache holds them in the model's order.
        stored_at = np.argsort(layer_order(cfg, self.layout)).astype(np.int32)
        dense = cfg.first_dense_layers  # their own stack, before `blocks`: the first `dense` layers of the cache
        block = lambda at: nnx.merge(block_def, jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, at, keepdims=False), block_state))
        local = local_layers(cfg)
        # Positions past the trained length have no lookup table: computed here.
        tables = rotary(batch_positions, rope_frequencies(cfg)), rotary(batch_positions, rope_frequencies(cfg, True))
        if "k_local" in cache:
            x, cache = self._layers_with_rings(x, cache, block, stored_at, tables, mask, slots, positions, last_index,
                                               left_pad)
            return self._logits(x, last_index), cache

        slides = np.zeros(cfg.n_layers, bool) if local is None else local
        masks = mask, (mask & (query - key < cfg.sliding_window)) if local is not None else mask

        def layer(x, layer_in):
            at, slide, layer_cache = layer_in
            pick = lambda a, b: jnp.where(slide, b, a)
            return block(at).decode(x, jax.tree.map(pick, *tables), pick(*masks)[:, None], layer_cache, slots)

        if dense:  # no sliding windows with them (config validation)
            dense_def, dense_state = nnx.split(self.dense_blocks)
            first_cache = jax.tree.map(lambda c: c[:dense], cache)
            x, first = jax.lax.scan(lambda x, xs: nnx.merge(dense_def, xs[0]).decode(
                x, tables[0], mask[:, None], xs[1], slots), x, (dense_state, first_cache))
            cache = jax.tree.map(lambda c: c[dense:], cache)
        x, cache = jax.lax.scan(layer, x, (stored_at, jnp.asarray(slides[dense:]), cache))
        if dense:
            cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), first, cache)
        return self._logits(x, last_index), cache

    def _layers_with_rings(self, x, cache, block, stored_at, tables, mask, slots, positions, last_index, left_pad):
        """`decode`'s layers when the sliding-window layers keep only their window: a global layer reads and
        writes cache["k"/"v"] as there; a local layer attends to its ring (the `sliding_window` positions before
        this call) and the new keys, then keeps the newest real ones. A lax.cond per layer picks the kind."""
        cfg = self.cfg
        t, window = x.shape[1], cache["k_local"].shape[2]
        before = positions[0] - 1  # the ring holds, in slot s, the newest p <= before with p % window == s
        ring_positions = before - (before - jnp.arange(window, dtype=jnp.int32)) % window
        query, key = positions[:, None], jnp.concatenate([ring_positions, positions])[None, :]
        ring_mask = hide_left_pad((key >= 0) & (key <= query) & (query - key < cfg.sliding_window), query, key,
                                  left_pad)
        # The ring keeps the newest `keep` new tokens up to the last real one (a padded prefill's padding would
        # push the prompt out); padding it keeps sits in slots that read as unwritten until decoding fills them.
        keep = min(t, window)
        last = t - 1 if last_index is None else last_index
        ring_from = jnp.clip(last + 1 - keep, 0, t - keep).astype(jnp.int32)
        ring_slots = (positions[0] + ring_from + jnp.arange(keep, dtype=jnp.int32)) % window
        local = local_layers(cfg)
        index = np.where(local, np.cumsum(local) - 1, np.cumsum(~local) - 1).astype(np.int32)  # within its kind

        def layer(carry, layer_in):
            x, caches = carry
            at, slide, i = layer_in

            def run(kind, table, mask, slots, ring_from):
                def branch(x, caches):
                    names = f"k{kind}", f"v{kind}"
                    k, v = (jax.lax.dynamic_index_in_dim(caches[n], i, keepdims=False) for n in names)
                    x, new = block(at).decode(x, table, mask[:, None], {"k": k, "v": v}, slots, ring_from)
                    return x, {**caches, **{n: jax.lax.dynamic_update_index_in_dim(caches[n], new[n[0]], i, 0)
                                            for n in names}}
                return branch

            return jax.lax.cond(slide, run("_local", tables[1], ring_mask, ring_slots, ring_from),
                                run("", tables[0], mask, slots, None), x, caches), None

        (x, cache), _ = jax.lax.scan(layer, (x, dict(cache)), (stored_at, jnp.asarray(local), index))
        return x, cache

    def _logits(self, x, last_index):
        x = self.final_norm(x[:, x.shape[1] - 1 if last_index is None else last_index])
        return self.cap(project(x, self.head().astype(jnp.dtype(self.cfg.dtype))))


def _ring_kernel():
    """model.attention_impl=pallas: the flash kernels per ring step of the platform the step compiles for."""
    return {"gpu": gpu_flash.RingKernel, "tpu": tpu_flash.RingKernel}[mesh_lib.compile_platform()]()


def hide_left_pad(mask, query, key, left_pad):
    """`decode`'s mask [T, keys] -> [1 or B, T, keys]: with `left_pad` [B], row b's keys before left_pad[b] hidden.
    A padding query still sees itself, so that no softmax runs over nothing."""
    if left_pad is None:
        return mask[None]
    left_pad = jnp.asarray(left_pad, jnp.int32)[:, None, None]
    return mask[None] & ((key[None] >= left_pad) | (key == query)[None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _not_differentiated(carry, schedule):
    """`carry`; differentiating it is a ConfigError: an explicit schedule trains through `hidden_loss` only."""
    return carry


def _refuse_forward(carry, schedule):
    return carry, None


def _refuse_backward(schedule, _, cotangent):
    raise ConfigError("pipeline.schedule", f"{schedule} trains the losses that sum over rows through the model's "
                      f"hidden_loss (the lm objective); this objective differentiates the hidden states themselves: "
                      f"use gpipe or circular")


_not_differentiated.defvjp(_refuse_forward, _refuse_backward)


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, layout: Layout, count: int, dense: bool = False):
    """`count` Blocks stacked on a leading "layers" axis (one scan runs them)."""
    return stacked(cfg, rngs, count, lambda r: Block(cfg, r, layout.grad_reduce_dtype, dense))


def stacked(cfg: ModelConfig, rngs: nnx.Rngs, count: int, make):
    """`count` modules `make(rngs)` stacked on a leading "layers" axis."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_stack(rngs):
        return make(rngs)

    return make_stack(rngs)


def stack_layer(block_def, tables, mask):
    """The scan body over stacked blocks of `block_def` whose layers share RoPE tables and mask: carry (x, LoRA
    dropout keys, folded per layer: lora.next_keys), xs one layer's state, out its MoE routing stats."""
    def layer(carry, state):
        x, stats = nnx.merge(block_def, state)(carry[0], tables, mask, carry[1])
        return (x, lora.next_keys(carry[1])), stats

    return layer


def local_layers(cfg: ModelConfig) -> np.ndarray | None:
    """Which layers (model order) attend through the sliding window: None when none does."""
    if not cfg.sliding_window:
        return None
    index = np.arange(cfg.n_layers)
    return (index + 1) % cfg.global_every != 0 if cfg.global_every else np.ones(cfg.n_layers, bool)


def layer_means(stats, per_sequence: bool = False) -> dict:
    """MoE routing stats [layers, rows, ...] -> each layer's load-balancing loss (each row's, averaged, if
    `per_sequence`) and dropped fraction over all the rows, averaged over the layers, and "expert_load" [layers,
    experts]: the assignments each expert took; {} for a dense model."""
    if not stats:
        return {}
    means = jax.tree.map(jnp.mean, jax.vmap(functools.partial(moe.summarize, per_sequence=per_sequence))(stats))
    return {**means, "expert_load": jnp.sum(stats["routed"], axis=1)}


def router_balancer(cfg: ModelConfig, layout: Layout = Layout()):
    """DeepSeek-V3's auxiliary-loss-free balancing as the train step's hook (model.moe_bias_rate), or None:
    f(params, expert_load [layers, experts] in the model's order (`layer_means`; the prediction modules' after the
    model's layers, when the loss ran them), apply) -> the params with each layer's router correction bias moved by
    the rate toward its under-loaded experts where `apply` (a finite step): +rate where an expert took fewer
    assignments than the layer's mean, -rate where more."""
    if not (cfg.moe_score_bias and cfg.moe_bias_rate):
        return None
    stored = np.asarray(layer_order(cfg, layout))  # the stacked blocks may be in a pipeline's order

    def balance(params, expert_load, apply):
        loads = {("blocks", "mlp", "score_bias"): expert_load[stored]}
        if expert_load.shape[0] > len(stored):  # the prediction modules' blocks follow (hidden_and_mtp)
            loads[("mtp", "block", "mlp", "score_bias")] = expert_load[len(stored):]

        def moved(path, leaf):
            load = loads.get(tuple(str(getattr(k, "key", k)) for k in path))
            if load is None:
                return leaf
            move = cfg.moe_bias_rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
            return leaf + jnp.where(apply, move, 0.0).astype(leaf.dtype)

        return jax.tree_util.tree_map_with_path(moved, params)

    return balance


def layer_order(cfg: ModelConfig, layout: Layout = Layout()) -> tuple[int, ...]:
    """The model's layer at each position of the stacked `blocks` (counted after DeepSeek-V3's dense first layers,
    a stack of their own) in a training state for `cfg` run as `layout`: its own order, unless the pipeline is
    circular (jaxtrain.parallel.pipeline.layer_order). `cfg` may be the config's `model` group too (a ConfigDict,
    which has no stacked_layers)."""
    return pipeline_parallel.layer_order(cfg.n_layers - cfg.first_dense_layers, layout.pipeline_stages,
                                         layout.pipeline_repeats)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """Empty K/V cache for `Transformer.decode`: {"k", "v"}: [layers, batch, length, kv_heads, head_dim]. When
    the sliding window is shorter than `length`, those layers get their own ring instead, {"k_local",
    "v_local"}: [local layers, batch, sliding_window, ...], and "k", "v" hold the global layers (a 1-slot
    placeholder when there are none). Latent attention caches its latents instead (jaxtrain.models.mla.init_cache).
    Traced inside `activation_sharding`, the cache is split like the activations: rows over the batch axes, heads
    over the tensor axis."""
    if cfg.kv_lora_rank:
        cache = mla.init_cache(cfg, cfg.n_layers, batch, length)
        return {name: constrain(c, (None, "batch")) for name, c in cache.items()}
    local = local_layers(cfg)
    tail = (cfg.n_kv_heads, cfg.head_dim)
    if local is None or cfg.sliding_window >= length:
        shapes = {"": (cfg.n_layers, batch, length, *tail)}
    else:
        n_global = cfg.n_layers - int(local.sum())
        shapes = {"": (max(n_global, 1), batch, length if n_global else 1, *tail),
                  "_local": (int(local.sum()), batch, cfg.sliding_window, *tail)}
    return {f"{kv}{kind}": constrain(jnp.zeros(shape, cfg.dtype), (None, "batch", None, "act_kv_heads"))
            for kind, shape in shapes.items() for kv in "kv"}


def build(cfg: ModelConfig, seed: int, layout: Layout = Layout()) -> Transformer:
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, nnx.Rngs(params=seed), layout)


def from_params(cfg: ModelConfig, params: dict, layout: Layout = Layout()):
    """(graphdef, state) of the model holding `params` (a pure dict, e.g. imported weights), run as `layout`; the
    initializers never run."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build(cfg, 0, layout)))
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state


def matmul_params(cfg: ModelConfig, stored: bool = False) -> int:
    """Parameters that take part in a matmul per token (the input embedding is a gather, not counted;
    the output projection is, tied or not; of a mixture of experts, the top-k experts only, and its shared ones).
    `stored`: every expert instead, i.e. the matmul weights the state holds."""
    d, (qk, v) = cfg.d_model, head_widths(cfg)
    if cfg.kv_lora_rank:  # latent attention: the low-rank projections
        q = cfg.q_lora_rank * (d + cfg.n_heads * qk) if cfg.q_lora_rank else d * cfg.n_heads * qk
        attn = q + d * (cfg.kv_lora_rank + cfg.head_dim) + cfg.kv_lora_rank * cfg.n_heads * (cfg.qk_nope_head_dim + v)
        attn += cfg.n_heads * v * d
    else:
        attn = d * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    mlp = 3 * d * cfg.d_ff
    if cfg.n_experts:  # the router, and the experts a token is routed to (MoE FLOPs count active params)
        mlp = d * cfg.n_experts + (cfg.n_experts if stored else cfg.moe_top_k) * mlp + cfg.n_shared_experts * mlp
    dense = cfg.first_dense_layers
    # A prediction module: its projection, a block, and the shared head once more per token (stored once).
    mtp = cfg.mtp_layers * (2 * d * d + attn + mlp + (0 if stored else d * cfg.vocab_size))
    return (cfg.n_layers - dense) * (attn + mlp) + dense * (attn + 3 * d * cfg.dense_d_ff) + d * cfg.vocab_size + mtp


def head_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(a head's query/key width, its value width): head_dim both, or latent attention's nope + rope and v."""
    if cfg.kv_lora_rank:
        return cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token, counted as MaxText does for a dense decoder:
    6 * N_matmul (forward 2, backward 4) plus causal attention 6 * L * S * H * d_head
    (QK^T and AV are 2 * 2 * S * H * d_head per token forward, halved for causality, times 3 for fwd+bwd; with
    latent attention's wider keys than values, 3 * L * S * H * (d_qk + d_v)).
    A sliding-window layer (window w < S) counts the keys its queries see: about w - w^2 / 2S on average, not
    S / 2. Remat recomputation is not counted: MFU measures useful work."""
    spans = np.full(cfg.n_layers, float(seq_len))  # twice the average keys per query
    local, w = local_layers(cfg), cfg.sliding_window
    if local is not None and w < seq_len:
        spans[local] = 2.0 * w - w * w / seq_len
    return 6.0 * matmul_params(cfg) + 3.0 * float(spans.sum()) * cfg.n_heads * sum(head_widths(cfg))
