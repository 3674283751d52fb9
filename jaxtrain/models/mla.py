"""Multi-head latent attention (DeepSeek-V2/V3, `model.kv_lora_rank` > 0).

Queries: W_qb · norm(W_qa · x) (or W_q · x when `q_lora_rank` is 0), each head a `qk_nope_head_dim` part and a
`head_dim` part that RoPE rotates. Keys and values come from one latent per token, c = norm(W_kva · x)
[kv_lora_rank], and one rotated key part k_r [head_dim] that every head shares; W_kvb expands c into each head's
key part and its value [v_head_dim]. Training expands the latent and runs plain attention. Decoding caches only c
and k_r per position and folds W_kvb into the query and the output instead (the absorbed form), so the cache is
kv_lora_rank + head_dim wide per token whatever the number of heads.

`rope_interleave` (DeepSeek's checkpoints): the rotated part's pairs are interleaved (x0, x1), (x2, x3), ...; both
queries and keys are de-interleaved before the rotate-half RoPE, as transformers does, which leaves q·k unchanged.
LoRA (model.lora_targets q, kv, o) adapts the query projections, the two key-value ones, and the output.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxtrain.models import lora
from jaxtrain.models.attention import causal_attention, masked_softmax
from jaxtrain.models.config import ModelConfig
from jaxtrain.models.layers import RMSNorm, adapted, param, project, rope, weight, yarn_mscale
from jaxtrain.parallel.mesh import constrain

# The latent norms' epsilon: transformers builds them with its RMSNorm's default, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def logit_scale(cfg: ModelConfig) -> float:
    """The attention logits' scale: (qk_nope_head_dim + head_dim)^-0.5, times YaRN's mscale(mscale_all_dim)^2
    where the RoPE is YaRN with `rope_mscale_all_dim` (DeepSeek-V3), or `attn_scale` when set."""
    if cfg.attn_scale:
        return cfg.attn_scale
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def deinterleave(x):
    """[..., (d/2 pairs) x 2] -> [..., evens, odds]: DeepSeek's interleaved rotary pairs in rotate-half order."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nnx.Module):
    """`Attention`'s interface (`__call__`, `decode`) for multi-head latent attention."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str = "float32"):
        self.cfg, self.grad_dtype = cfg, grad_dtype
        d, h, rope_dim, nope = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_nope_head_dim
        if cfg.q_lora_rank:
            self.wq_a = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), cfg)
            self.q_norm = RMSNorm(cfg, rngs, dim=cfg.q_lora_rank, names=("q_lora",), eps=LATENT_NORM_EPS)
            self.wq_b = param(rngs, (cfg.q_lora_rank, h, nope + rope_dim), ("q_lora", "q_heads", "head_dim"), cfg)
        else:
            self.wq = param(rngs, (d, h, nope + rope_dim), ("embed", "q_heads", "head_dim"), cfg)
        self.wkv_a = param(rngs, (d, cfg.kv_lora_rank + rope_dim), ("embed", "kv_lora"), cfg)
        self.kv_norm = RMSNorm(cfg, rngs, dim=cfg.kv_lora_rank, names=("kv_lora",), eps=LATENT_NORM_EPS)
        self.wkv_b = param(rngs, (cfg.kv_lora_rank, h, nope + cfg.v_head_dim), ("kv_lora", "q_heads", "head_dim"),
                           cfg)
        self.wo = param(rngs, (h, cfg.v_head_dim, d), ("q_heads", "head_dim", "embed"), cfg,
                        std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        for name, target in (("wq_a", "q"), ("wq_b", "q"), ("wq", "q"), ("wkv_a", "kv"), ("wkv_b", "kv"), ("wo", "o")):
            if hasattr(self, name):
                w = getattr(self, name)
                lora.add(self, name, target, w.shape, w.get_metadata()["out_sharding"], 2 if name == "wo" else 1,
                         cfg, rngs)

    def _project(self, x, name: str, keys=None):
        """x through the weight `name`, plus its LoRA adapters' term where it has them."""
        contract = 2 if name == "wo" else 1
        y = project(x, weight(getattr(self, name), x.dtype), contract=contract, quant=self.cfg.quant,
                    grad_dtype=self.grad_dtype)
        return adapted(self, name, x, y, contract, keys)

    def queries(self, x, tables, keys=None):
        """(q_nope [B, T, heads, qk_nope_head_dim], q_rope [B, T, heads, head_dim] rotated)."""
        if self.cfg.q_lora_rank:
            q = self._project(self.q_norm(self._project(x, "wq_a", keys)), "wq_b", keys)
        else:
            q = self._project(x, "wq", keys)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        q_nope, q_rope = q[..., :self.cfg.qk_nope_head_dim], q[..., self.cfg.qk_nope_head_dim:]
        return q_nope, rope(self._rope_order(q_rope), tables)

    def latent(self, x, tables, keys=None):
        """(c [B, T, kv_lora_rank] normed, k_rope [B, T, head_dim] rotated): what the cache holds per position."""
        c_and_rope = self._project(x, "wkv_a", keys)
        c, k_rope = c_and_rope[..., :self.cfg.kv_lora_rank], c_and_rope[..., self.cfg.kv_lora_rank:]
        return self.kv_norm(c), rope(self._rope_order(k_rope)[:, :, None], tables)[:, :, 0]

    def _rope_order(self, x):
        return deinterleave(x) if self.cfg.rope_interleave else x

    def __call__(self, x, rotary_tables, mask, keys=None):
        cfg = self.cfg
        q_nope, q_rope = self.queries(x, rotary_tables, keys)
        c, k_rope = self.latent(x, rotary_tables, keys)
        kv = self._project(c, "wkv_b", keys)  # [B, T, heads, nope + v]
        k_nope, v = kv[..., :cfg.qk_nope_head_dim], kv[..., cfg.qk_nope_head_dim:]
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], cfg.head_dim))],
                            axis=-1)
        # Every query needs every earlier key: along the sequence K/V are gathered whole (as Attention).
        k = constrain(k, ("batch", None, "act_heads", None))
        v = constrain(v, ("batch", None, "act_heads", None))
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        if v_dim != qk_dim and not cfg.attention_block:  # the library call wants one head width: pad V, then cut
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qk_dim - v_dim)))
        out = causal_attention(q, k, v, constrain(mask, ("batch", None, "seq", None)), cfg.attention_block,
                               cfg.attention_impl, logit_scale(cfg))[..., :v_dim]
        out = constrain(out, ("batch", "seq", "act_heads", None))
        return self._project(out, "wo", keys)

    def decode(self, x, tables, mask, cache: dict, slots, ring_from=None):
        """The absorbed form against the latent cache {"latent": [B, L, kv_lora_rank], "rope_key": [B, L,
        head_dim]}: the new positions go to `slots`; returns (output [B, T, d], cache). No sliding window
        (`ring_from` is never set: config validation refuses windows with latent attention)."""
        cfg, dt = self.cfg, x.dtype
        q_nope, q_rope = self.queries(x, tables)
        c, k_rope = self.latent(x, tables)
        cache = {"latent": cache["latent"].at[:, slots].set(c.astype(cache["latent"].dtype)),
                 "rope_key": cache["rope_key"].at[:, slots].set(k_rope.astype(cache["rope_key"].dtype))}
        latents, rope_keys = cache["latent"].astype(dt), cache["rope_key"].astype(dt)
        w_kv = weight(self.wkv_b, dt)
        if (ab := lora.factors(self, "wkv_b", dt)) is not None:  # absorbed: the adapted weight, folded in
            w_kv = w_kv + jnp.einsum("rk,khn->rhn", ab[0], ab[1])
        w_k, w_v = w_kv[..., :cfg.qk_nope_head_dim], w_kv[..., cfg.qk_nope_head_dim:]
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w_k, preferred_element_type=jnp.float32)
        logits = (jnp.einsum("bthr,bsr->bhts", q_latent, latents, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthd,bsd->bhts", q_rope, rope_keys, preferred_element_type=jnp.float32))
        mask = jnp.broadcast_to(mask, (x.shape[0], 1, x.shape[1], latents.shape[1]))
        probs = masked_softmax(logits, mask, logit_scale(cfg))
        out_latent = jnp.einsum("bhts,bsr->bthr", probs.astype(dt), latents, preferred_element_type=jnp.float32)
        out = jnp.einsum("bthr,rhv->bthv", out_latent.astype(dt), w_v, preferred_element_type=jnp.float32)
        return self._project(out.astype(dt), "wo"), cache


def init_cache(cfg: ModelConfig, layers: int, batch: int, length: int) -> dict:
    """An empty latent cache for `layers` layers: {"latent": [layers, B, length, kv_lora_rank], "rope_key":
    [layers, B, length, head_dim]}."""
    return {"latent": jnp.zeros((layers, batch, length, cfg.kv_lora_rank), cfg.dtype),
            "rope_key": jnp.zeros((layers, batch, length, cfg.head_dim), cfg.dtype)}

