"""Gemma 3 (text): GeGLU, RMSNorm scaled by (1 + w) before and after each sublayer, q/k norms, embeddings times
sqrt(d), query_pre_attn_scalar, and sliding layers with a global one every `sliding_window_pattern` (their own
RoPE base, unscaled). The multimodal `gemma3` checkpoints hold this model as their text part."""

from __future__ import annotations

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "gemma3", ("gemma3_text",), "Gemma3ForCausalLM"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
NORMS = {("attn_norm", "scale"): ("input_layernorm.weight", None),
         ("attn_post_norm", "scale"): ("post_attention_layernorm.weight", None),
         ("mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", None),
         ("mlp_post_norm", "scale"): ("post_feedforward_layernorm.weight", None)}


def gemma_fields(c: base.HFConfig) -> dict:
    """What Gemma 2 and 3 share: the norms, GeGLU, the embedding scale, the caps and the window pattern."""
    act = c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in GELU_TANH:
        c.refuse("hidden_activation", f"{act!r}; Gemma's MLP is GeGLU with tanh-approximated GELU")
    c.absent("attention_bias", why="the model has no attention biases")
    c.absent("use_bidirectional_attention", why="the decoder is causal")
    fields = base.dense_fields(c, tie_default=True, swiglu=False)
    fields = {**fields, "mlp_activation": "gelu_tanh", "norm_offset": True, "post_norms": True, "embed_scale": True,
              "attn_scale": c.number("query_pre_attn_scalar", fields["head_dim"]) ** -0.5,
              "attn_softcap": c.number("attn_logit_softcapping", 0.0, positive=False),
              "final_softcap": c.number("final_logit_softcapping", 0.0, positive=False)}
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is None or window is None:
        if window is not None and types is None:
            c.refuse("layer_types", "missing; which layers slide is not known")
        return fields
    n = fields["n_layers"]
    if not isinstance(types, list) or len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        c.refuse("layer_types", f"expected {n} of 'sliding_attention' / 'full_attention'")
    every = next((k for k in range(1, n + 1) if types == pattern(n, k)), None) if "full_attention" in types else 0
    if every is None:
        c.refuse("layer_types", "not a global layer every n-th layer with sliding ones between; not supported")
    if "sliding_attention" in types:
        fields.update(sliding_window=c.size("sliding_window"), global_every=every)
    return fields


def pattern(n_layers: int, every: int) -> list[str]:
    return ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]


def gemma_hf(cfg, architecture: str, model_type: str) -> dict:
    scalar = cfg.attn_scale ** -2 if cfg.attn_scale else cfg.head_dim
    out = {**base.dense_hf(cfg, architecture, model_type), "hidden_activation": "gelu_pytorch_tanh",
           "hidden_act": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
           "attn_logit_softcapping": cfg.attn_softcap or None,
           "final_logit_softcapping": cfg.final_softcap or None, "attention_bias": False}
    if cfg.sliding_window:
        out.update(sliding_window=cfg.sliding_window, layer_types=pattern(cfg.n_layers, cfg.global_every))
    else:
        out.update(sliding_window=None, layer_types=["full_attention"] * cfg.n_layers)
    return out


def from_hf(c: base.HFConfig) -> dict:
    fields = gemma_fields(c)
    fields["qk_norm"] = True
    if isinstance(c.get("rope_parameters"), dict) and "sliding_attention" in c.values["rope_parameters"]:
        fields.update(base.rope_fields(c, base.rope_parameters(c, "full_attention")))
        local = base.rope_fields(c, base.rope_parameters(c, "sliding_attention"))
        if local["rope_scaling"] != "none":
            c.refuse("rope_parameters.sliding_attention.rope_type", "the sliding layers' RoPE must be unscaled")
        fields["rope_local_theta"] = local["rope_theta"]
    else:  # transformers 4.x
        fields["rope_local_theta"] = c.number("rope_local_base_freq", 10000.0)
    return fields


def to_hf(cfg) -> dict:
    out = gemma_hf(cfg, ARCHITECTURE, "gemma3_text")
    out["rope_parameters"] = {"full_attention": base.rope_hf(cfg), "sliding_attention": {
        "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
    out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    return out


def weights(cfg) -> dict:
    return base.table({**NORMS, **base.ATTENTION, **base.QK_NORM, **base.MLP})
