"""What the families share: a checked reader of a Hugging Face config.json, RoPE's settings both ways, and the
Llama layout of attention and MLP weights that most families start from.

A weight table maps a param path to (HF tensor name, layout). The name holds `{i}` for the layer (stacked
params) and `{e}` for the expert; the layout is an int (how many leading axes of the jaxtrain array form the
matmul's input: HF stores [out, in]), "vector" (flattened as it is) or None (copied as it is).
"""

from __future__ import annotations

import json

from jaxtrain.errors import HFError
from jaxtrain.models.config import ModelConfig


# The largest value read from a config.json field (SIZE_LIMIT unless listed): far above any released model's, so
# that a damaged or hostile file is refused before anything is built from it (an absurd num_hidden_layers would
# exhaust memory building tensor names first).
SIZE_LIMITS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024,
               "num_local_experts": 4096, "num_experts": 4096, "num_experts_per_tok": 64}
SIZE_LIMIT = 1 << 24  # vocabularies, widths, windows and positions


class HFConfig:
    """A config.json's values, each read with a check; `refuse` is an HFError naming the file and field."""

    def __init__(self, values: dict, path):
        self.values, self.path = values, path

    def get(self, field, default=None):
        value = self.values.get(field)
        return default if value is None else value

    def refuse(self, field, reason):
        raise HFError(f"{self.path}: {field}: {reason}")

    def number(self, field, default=None, positive: bool = True) -> float:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
            self.refuse(field, f"{value!r}; expected a {'positive ' if positive else ''}number")
        return float(value)

    def size(self, field, default=None) -> int:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.refuse(field, f"{value!r}; expected a positive integer")
        if value > (limit := SIZE_LIMITS.get(field, SIZE_LIMIT)):
            self.refuse(field, f"{value}; more than jaxtrain reads from a config.json ({limit}): a damaged file?")
        return value

    def absent(self, *fields, why: str = "the model has no such option"):
        """Refuses each field that is set to anything but false/None/0/[]."""
        for field in fields:
            if self.values.get(field):
                self.refuse(field, f"{json.dumps(self.values[field])}; {why}")


# ===== Config fields ===================================================================================


def dense_fields(c: HFConfig, *, norm_eps_default: float = 1e-6, tie_default: bool = False,
                 swiglu: bool = True) -> dict:
    """The sizes every family shares (Llama's keys), and the global RoPE. `swiglu`: the MLP (or each expert) is
    SwiGLU, so `hidden_act` must be silu (Gemma checks its own GeGLU)."""
    if swiglu and c.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", f"{c.values['hidden_act']!r}; the MLP is SwiGLU (silu)")
    c.absent("mlp_bias", why="the model's MLP has no biases")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        c.refuse("partial_rotary_factor", f"{c.values['partial_rotary_factor']}; the model rotates the whole head")
    n_heads, d_model = c.size("num_attention_heads"), c.size("hidden_size")
    fields = {
        "vocab_size": c.size("vocab_size"),
        "d_model": d_model,
        "n_layers": c.size("num_hidden_layers"),
        "n_heads": n_heads,
        "n_kv_heads": c.size("num_key_value_heads", n_heads),
        # Older configs leave head_dim out (or null): it is then hidden_size / heads.
        "head_dim": c.size("head_dim", d_model // n_heads if d_model % n_heads == 0 else None),
        "d_ff": c.size("intermediate_size"),
        "tie_embeddings": bool(c.get("tie_word_embeddings", tie_default)),
        "norm_eps": c.number("rms_norm_eps", norm_eps_default),
    }
    if fields["n_heads"] % fields["n_kv_heads"]:
        c.refuse("num_key_value_heads", f"{fields['n_kv_heads']} does not divide num_attention_heads={n_heads}")
    if fields["head_dim"] % 2:
        c.refuse("head_dim", f"{fields['head_dim']} is odd; RoPE needs an even head_dim")
    return {**fields, **rope_fields(c, rope_parameters(c))}


def rope_parameters(c: HFConfig, layer_type: str | None = None) -> tuple[str, dict]:
    """(the field it came from, the RoPE dict) of transformers 5's `rope_parameters` (per layer type where the
    family has several) or 4.x's `rope_theta` + `rope_scaling`."""
    if isinstance(params := c.get("rope_parameters"), dict):
        field = "rope_parameters"
        if layer_type is None and isinstance(params.get("full_attention"), dict):
            layer_type = "full_attention"  # per layer type (Gemma 3): the global layers' is the model's RoPE
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params, field = params[layer_type], f"rope_parameters.{layer_type}"
        return field, params
    scaling = c.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        c.refuse("rope_scaling", f"{scaling!r}; expected an object")
    return "rope_scaling", {"rope_theta": c.get("rope_theta", 10000.0), **scaling}


# HF rope_type -> ModelConfig.rope_scaling, and the keys each may carry beyond rope_type/type/rope_theta.
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
ROPE_KEYS = {"none": set(), "linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "truncate", "mscale", "mscale_all_dim"}}


def rope_fields(c: HFConfig, source: tuple[str, dict]) -> dict:
    field, rope = source
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        c.refuse(f"{field}.rope_type", f"{kind!r} is not supported; supported: {sorted(ROPE_TYPES)}")
    scaling = ROPE_TYPES[kind]
    if extra := sorted(set(rope) - ROPE_KEYS[scaling] - {"rope_type", "type", "rope_theta"}):
        c.refuse(f"{field}.{extra[0]}", f"{json.dumps(rope[extra[0]])}; not supported with rope_type {kind!r}")
    sub = HFConfig(rope, f"{c.path}: {field}")
    out = {"rope_theta": sub.number("rope_theta", 10000.0), "rope_scaling": scaling}
    if scaling != "none":
        out["rope_factor"] = sub.number("factor")
    if scaling == "llama3":
        out.update(rope_low_freq_factor=sub.number("low_freq_factor"),
                   rope_high_freq_factor=sub.number("high_freq_factor"))
    if scaling in ("llama3", "yarn"):
        out["rope_original_max_len"] = sub.size("original_max_position_embeddings")
    if scaling == "yarn":
        if rope.get("truncate", True) is not True:
            c.refuse(f"{field}.truncate", "false is not supported")
        out.update(rope_beta_fast=sub.number("beta_fast", 32.0), rope_beta_slow=sub.number("beta_slow", 1.0),
                   rope_attention_factor=sub.number("attention_factor", 0.0, positive=False),
                   rope_mscale=sub.number("mscale", 0.0, positive=False),
                   rope_mscale_all_dim=sub.number("mscale_all_dim", 0.0, positive=False))
    return out


def rope_hf(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters of the global RoPE."""
    out = {"rope_type": {v: k for k, v in ROPE_TYPES.items()}[cfg.rope_scaling], "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling != "none":
        out["factor"] = cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_scaling in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = cfg.rope_original_max_len
    if cfg.rope_scaling == "yarn":
        out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
        if cfg.rope_attention_factor:
            out["attention_factor"] = cfg.rope_attention_factor
        for key, value in (("mscale", cfg.rope_mscale), ("mscale_all_dim", cfg.rope_mscale_all_dim)):
            if value:
                out[key] = value
    return out


def dense_hf(cfg: ModelConfig, architecture: str, model_type: str) -> dict:
    """The config.json entries every family shares."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_hf(cfg),
        # transformers 4.x reads these two
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling == "none" else {
            k: v for k, v in rope_hf(cfg).items() if k != "rope_theta"},
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def window_fields(c: HFConfig, field: str = "sliding_window") -> dict:
    """Mistral's and Mixtral's window over every layer (null: none)."""
    window = c.get(field)
    return {"sliding_window": c.size(field)} if window is not None else {}


# ===== Weights =========================================================================================


ATTENTION = {
    ("attn", "wq"): ("self_attn.q_proj.weight", 1),
    ("attn", "wk"): ("self_attn.k_proj.weight", 1),
    ("attn", "wv"): ("self_attn.v_proj.weight", 1),
    ("attn", "wo"): ("self_attn.o_proj.weight", 2),
}
QKV_BIAS = {("attn", "bq"): ("self_attn.q_proj.bias", "vector"), ("attn", "bk"): ("self_attn.k_proj.bias", "vector"),
            ("attn", "bv"): ("self_attn.v_proj.bias", "vector")}
QK_NORM = {("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", None),
           ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", None)}
MLP = {("mlp", "w_gate"): ("mlp.gate_proj.weight", 1), ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
       ("mlp", "w_down"): ("mlp.down_proj.weight", 1)}
NORMS = {("attn_norm", "scale"): ("input_layernorm.weight", None),
         ("mlp_norm", "scale"): ("post_attention_layernorm.weight", None)}
# A mixture of experts' adapters as PEFT names them on transformers' fused experts (`target_parameters`): one
# ParamWrapper per 3-D parameter of this module, gate_up_proj's nested inside down_proj's.
EXPERT_ADAPTERS = {("mlp", "w_gate_up"): "model.layers.{i}.mlp.experts.base_layer",
                   ("mlp", "w_down"): "model.layers.{i}.mlp.experts"}
EXPERT_PARAMETERS = ["experts.down_proj", "experts.gate_up_proj"]
TOP = {("embed",): ("model.embed_tokens.weight", None), ("final_norm", "scale"): ("model.norm.weight", None),
       ("unembed",): ("lm_head.weight", 1)}


def table(layer: dict) -> dict:
    """A full weight table: the per-layer entries under `model.layers.{i}.`, then the top-level ones."""
    return {**{("blocks", *path): (f"model.layers.{{i}}.{name}", layout) for path, (name, layout) in layer.items()},
            **TOP}
