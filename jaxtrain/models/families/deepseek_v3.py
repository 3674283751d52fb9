"""DeepSeek-V3 (and Moonlight, whose config.json says deepseek_v3): multi-head latent attention
(jaxtrain.models.mla), the first `first_k_dense_replace` layers dense, the rest a sigmoid-scored mixture of routed
experts with group-limited top-k, a correction bias on the choice, routed_scaling_factor, and shared experts.

The multi-token prediction modules after the last layer (`num_nextn_predict_layers`, model.mtp_layers) are read
and written under DeepSeek's names: `model.layers.<n_layers + k>.` {enorm, hnorm, eh_proj, shared_head.norm} and
the block's own. Their copies of the embedding and the head (`embed_tokens`, `shared_head.head`) are written from
the model's and not read back: the modules share the model's.
"""

from __future__ import annotations

import re

from jaxtrain.models.families import base

NAME, MODEL_TYPES, ARCHITECTURE = "deepseek_v3", ("deepseek_v3",), "DeepseekV3ForCausalLM"
NORMS = base.NORMS
LATENT = {("attn", "wkv_a"): ("self_attn.kv_a_proj_with_mqa.weight", 1),
          ("attn", "kv_norm", "scale"): ("self_attn.kv_a_layernorm.weight", None),
          ("attn", "wkv_b"): ("self_attn.kv_b_proj.weight", 1),
          ("attn", "wo"): ("self_attn.o_proj.weight", 2)}
LOW_RANK_Q = {("attn", "wq_a"): ("self_attn.q_a_proj.weight", 1),
              ("attn", "q_norm", "scale"): ("self_attn.q_a_layernorm.weight", None),
              ("attn", "wq_b"): ("self_attn.q_b_proj.weight", 1)}
FULL_Q = {("attn", "wq"): ("self_attn.q_proj.weight", 1)}
EXPERTS = {
    ("mlp", "w_router"): ("mlp.gate.weight", 1),
    ("mlp", "score_bias"): ("mlp.gate.e_score_correction_bias", None),
    ("mlp", "w_gate"): ("mlp.experts.{e}.gate_proj.weight", 1),
    ("mlp", "w_up"): ("mlp.experts.{e}.up_proj.weight", 1),
    ("mlp", "w_down"): ("mlp.experts.{e}.down_proj.weight", 1),
}
SHARED = {("shared_mlp", f"w_{p}"): (f"mlp.shared_experts.{p}_proj.weight", 1) for p in ("gate", "up", "down")}


# A prediction module's own tensors (transformer.Predictor), beside its block's.
PREDICTOR = {("enorm", "scale"): ("enorm.weight", None), ("hnorm", "scale"): ("hnorm.weight", None),
             ("eh_proj",): ("eh_proj.weight", 1), ("norm", "scale"): ("shared_head.norm.weight", None)}
SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def from_hf(c: base.HFConfig) -> dict:
    c.absent("attention_bias", why="the model has no attention biases")
    if c.get("scoring_func", "sigmoid") != "sigmoid":
        c.refuse("scoring_func", f"{c.values['scoring_func']!r}; DeepSeek-V3 scores experts by sigmoid")
    if c.get("topk_method", "noaux_tc") != "noaux_tc":
        c.refuse("topk_method", f"{c.values['topk_method']!r}; DeepSeek-V3 routes by 'noaux_tc'")
    if c.get("moe_layer_freq", 1) != 1:
        c.refuse("moe_layer_freq", f"{c.values['moe_layer_freq']}; every layer after the dense ones must be a "
                                   f"mixture of experts")
    fields = base.dense_fields(c)
    n_experts, groups = c.size("n_routed_experts"), c.size("n_group", 1)
    if n_experts % groups:
        c.refuse("n_group", f"{groups} does not divide n_routed_experts={n_experts}")
    if not 1 <= (topk_groups := c.size("topk_group", 1)) <= groups:
        c.refuse("topk_group", f"{topk_groups} must be between 1 and n_group={groups}")
    dense = c.get("first_k_dense_replace", 0)
    if dense:
        dense = c.size("first_k_dense_replace")
        if dense >= fields["n_layers"]:
            c.refuse("first_k_dense_replace", f"{dense} leaves no mixture-of-experts layer of "
                                              f"num_hidden_layers={fields['n_layers']}")
    rope_dim = c.size("qk_rope_head_dim")
    if rope_dim % 2:
        c.refuse("qk_rope_head_dim", f"{rope_dim} is odd; RoPE needs an even width")
    return {**fields, "head_dim": rope_dim,
            "kv_lora_rank": c.size("kv_lora_rank"), "q_lora_rank": c.size("q_lora_rank") if c.get("q_lora_rank") else 0,
            "qk_nope_head_dim": c.size("qk_nope_head_dim"), "v_head_dim": c.size("v_head_dim"),
            "rope_interleave": bool(c.get("rope_interleave", True)),
            "d_ff": c.size("moe_intermediate_size"), "dense_d_ff": c.size("intermediate_size") if dense else 0,
            "first_dense_layers": dense, "n_experts": n_experts, "moe_top_k": c.size("num_experts_per_tok"),
            "n_shared_experts": c.size("n_shared_experts") if c.get("n_shared_experts") else 0,
            "moe_score": "sigmoid", "moe_score_bias": True, "moe_groups": groups, "moe_topk_groups": topk_groups,
            "moe_routed_scale": c.number("routed_scaling_factor", 1.0),
            "moe_renormalize": bool(c.get("norm_topk_prob", True)), "moe_routing": "dropless",
            "mtp_layers": c.size("num_nextn_predict_layers") if c.get("num_nextn_predict_layers") else 0}


def to_hf(cfg) -> dict:
    out = base.dense_hf(cfg, ARCHITECTURE, "deepseek_v3")
    return {**out, "intermediate_size": cfg.dense_d_ff or cfg.d_ff, "moe_intermediate_size": cfg.d_ff,
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_rope_head_dim": cfg.head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.rope_interleave, "n_routed_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.moe_top_k, "n_shared_experts": cfg.n_shared_experts or None,
            "n_group": cfg.moe_groups, "topk_group": cfg.moe_topk_groups,
            "routed_scaling_factor": cfg.moe_routed_scale, "norm_topk_prob": cfg.moe_renormalize,
            "first_k_dense_replace": cfg.first_dense_layers, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "num_nextn_predict_layers": cfg.mtp_layers, "attention_bias": False}


def weights(cfg) -> dict:
    attention = {**(LOW_RANK_Q if cfg.q_lora_rank else FULL_Q), **LATENT}
    table = base.table({**NORMS, **attention, **EXPERTS, **(SHARED if cfg.n_shared_experts else {})})
    dense = {("dense_blocks", *path): (f"model.layers.{{i}}.{name}", layout)
             for path, (name, layout) in {**NORMS, **attention, **base.MLP}.items()}
    block = {**NORMS, **attention, **EXPERTS, **(SHARED if cfg.n_shared_experts else {})}
    mtp = {("mtp", *path): (f"model.layers.{{i}}.{name}", layout)
           for path, (name, layout) in {**PREDICTOR, **{("block", *p): v for p, v in block.items()}}.items()}
    return {**table, **dense, **mtp}


def copies(cfg) -> dict:
    """Tensors an export writes as copies of others ({name: the name it copies}): each prediction module's
    embedding and head, which DeepSeek's checkpoints hold."""
    return {f"model.layers.{i}.{name}": source for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_layers)
            for name, source in SHARED_COPIES.items()}


def skipped(name: str, fields: dict) -> bool:
    """Not read: the prediction modules' copies of the embedding and head, and the modules past
    fields["mtp_layers"] (those a run leaves out)."""
    match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
    if match is None or int(match.group(1)) < fields["n_layers"]:
        return False
    return match.group(2) in SHARED_COPIES or int(match.group(1)) >= fields["n_layers"] + fields["mtp_layers"]
