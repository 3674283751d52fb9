"""The model's configuration: `ModelConfig` is the one source of the model's defaults, `Layout` of how it runs.

The config schema's `model` group is built from ModelConfig's fields and Layout's `remat` (`config_defaults`),
and `check_config` is that group's validation. Sizes, numerics and kernels are the model: what checkpoints and
Hugging Face exports describe. The layout (pipeline stages and schedule, remat, the gradients' reduction dtype)
is how a run executes it, from the `pipeline` group, model.remat and optim.grad_reduce_dtype; it travels beside
the ModelConfig into the model (jaxtrain.models.transformer.build) and changes no parameter.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import re

import jax

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group
from jaxtrain.parallel import context

# Every matmul against a weight (`project`, the MoE router) names its output WEIGHT_MATMUL, and
# "dots_with_no_batch_dims_saveable" saves by that name. Those are the dots jax's policy of that name saves in our
# layers, but it tells them apart by their batch dimensions, and under a vmap over weight copies (per-replica
# gradient accumulation, pipeline stages) every weight matmul has one: it then saved nothing, i.e. ran full remat.
WEIGHT_MATMUL = "weight_matmul"

# cuDNN's attention forward (jax.nn.dot_product_attention with implementation="cudnn") binds a primitive of this
# name. Saving its outputs (the attention output and the softmax statistics) spares the backward a second forward
# kernel, for their memory (docs/performance.md, "GPU: one H100"). Nothing else binds it, and XLA's attention is
# still recomputed from the saved matmuls.
CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"
_SAVE_WEIGHT_MATMULS = jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL)


def _weight_matmuls_and_cudnn_attention(prim, *avals, **params) -> bool:
    return prim.name == CUDNN_ATTENTION_FWD or _SAVE_WEIGHT_MATMULS(prim, *avals, **params)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": _weight_matmuls_and_cudnn_attention,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    # The same activations as dots_with_no_batch_dims_saveable, kept in pinned host memory until the backward.
    "offload_dots": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[WEIGHT_MATMUL],
        offload_src="device", offload_dst="pinned_host"),
}


# model.attention_impl's kernels (`check_backend` says where each runs): jax.nn.dot_product_attention's "xla" and
# "cudnn" with K/V whole; "pallas" runs each step of ring, Ulysses or USP attention in flash kernels.
ATTENTION_IMPLS = ("xla", "cudnn", "pallas")
# pallas's kernels by backend (jaxtrain.models.gpu_flash, Triton; jaxtrain.models.tpu_flash, Mosaic): the head_dims
# they take, and their smallest tile, which a ring block (train.seq_len over the ring's members) is a multiple of.
RING_KERNEL_LIMITS = {"gpu": ((16, 32, 64, 128, 256), 16), "tpu": ((64, 128, 256), 128)}
# model.context_parallel's modes; "usp": the ring across groups of model.ulysses_ways devices, Ulysses within each.
CONTEXT_PARALLEL = ("allgather", "ring", "ulysses", "usp")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
MOE_ROUTINGS = ("capacity", "dropless")
# The grouped matmul of dropless routing (jaxtrain.models.moe._kernel_ops): jax.lax.ragged_dot, or tokamax's.
MOE_KERNELS = ("xla", "tokamax")
# Its weight gradient: XLA's (never the kernel library's own: moe._kernel_ops), or models.gpu_grouped's.
MOE_WEIGHT_GRADS = ("xla", "pallas")
MOE_INPUT_GRADS = ("kernel", "pallas")
MOE_DISPATCHES = ("gather", "all_to_all")
MOE_SCORES = ("softmax", "sigmoid")
MOE_AUX_LOSSES = ("batch", "sequence")
QUANT_MODES = ("none", "fp8", "int8")  # jaxtrain.models.quant
DTYPES = ("auto", "float32", "bfloat16", "float16")
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")  # optim.grad_reduce_dtype
# model.lora_targets' names (jaxtrain.models.lora): the attention projections (latent attention's: q, its keys and
# values together as kv, o), a dense MLP's, and a mixture of experts' experts (their gate and up projections
# together, as Hugging Face stores them, and down).
LORA_TARGETS = ("q", "k", "v", "o", "kv", "gate", "up", "down", "experts")
DENSE_MLP_TARGETS = ("gate", "up", "down")


def lora_target_names(lora_targets: str, n_experts: int, latent: bool = False) -> frozenset[str]:
    """model.lora_targets as the set of LORA_TARGETS it names ("all": every one the model has; `latent`: its
    attention is latent, model.kv_lora_rank > 0)."""
    names = {t.strip() for t in str(lora_targets).split(",") if t.strip()}
    if names == {"all"}:
        names = {"q", *(("kv",) if latent else ("k", "v")), "o", *(("experts",) if n_experts else DENSE_MLP_TARGETS)}
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes (GQA when n_kv_heads < n_heads), layout and numerics of the decoder. `dtype` is the compute dtype,
    `param_dtype` the weights'; "auto" is float32 compute on CPU (reference numerics, and faster there with XLA)
    and bfloat16 compute with float32 weights elsewhere, resolved for the platform the model compiles for."""
    vocab_size: int = 8192
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 32
    d_ff: int = 768
    tie_embeddings: bool = True
    # Layers per iteration of the layer loop (lax.scan's `unroll`): 1 compiles in the same time at any depth;
    # n_layers removes the loop, which saves the stacked per-layer buffers (faster steps on CPU, slower compiles).
    scan_unroll: int = 1
    # Causal attention written out (einsums + softmax) in query blocks of this many positions, skipping the blocks
    # above the diagonal; 0 = one jax.nn.dot_product_attention call.
    attention_block: int = 0
    # That call's kernel: "xla" (jax's default, on every backend: [B, heads, T, T] logits) or "cudnn" (cuDNN's fused
    # flash attention, GPU only, bf16/fp16; the packed-document mask goes in as a bias). Under ring, Ulysses or USP
    # attention: "xla" (einsums in sub-blocks) or "pallas" (flash kernels per ring step, GPUs and TPUs). See
    # ATTENTION_IMPLS.
    attention_impl: str = "xla"
    # How attention crosses the `sequence` mesh axis (jaxtrain.parallel.context; docs/parallelism.md):
    # "allgather" (K/V gathered whole on every device), "ring" (K/V shards passed round it), "ulysses" (an
    # all-to-all trades the sequence split for a head split) or "usp" (Ulysses within groups of `ulysses_ways`
    # consecutive devices, the ring across the groups; 0: the largest divisor of mesh.sequence, at most 8, that
    # divides the query and KV heads). `context_balance`: the ring's zigzag layout, which the step applies to the
    # batch (step.context_layout) so every device does the same causal work.
    context_parallel: str = "allgather"
    context_balance: bool = True
    ulysses_ways: int = 0
    dtype: str = "auto"
    param_dtype: str = "auto"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The Hugging Face family the weights map to (jaxtrain.models.families): what `hf export` writes and what
    # `model.init_from` must hold. The options below are the decoder's; each family sets its own.
    family: str = "llama"
    # RoPE: "none" (theta^(-2j/hd)), "linear" (positions / rope_factor), "llama3" (low frequencies / rope_factor,
    # smoothly up to the high ones: rope_low_freq_factor, rope_high_freq_factor, rope_original_max_len) or "yarn"
    # (by wavelength between rope_beta_slow and rope_beta_fast, cos/sin times rope_attention_factor, 0 = yarn's).
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    # Attention: biases on q, k and v (Qwen2); RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3); the
    # logits' scale (0 = head_dim^-0.5; Gemma: query_pre_attn_scalar^-0.5); cap * tanh(logits / cap) (0 = off).
    qkv_bias: bool = False
    qk_norm: bool = False
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    # Multi-head latent attention (DeepSeek-V2/V3, jaxtrain.models.mla) when kv_lora_rank > 0: keys and values
    # from a kv_lora_rank-wide latent per token, queries through a q_lora_rank one (0 = a full projection). Each
    # head's query and key are qk_nope_head_dim wide plus head_dim rotated by RoPE (transformers' head_dim is that
    # part, qk_rope_head_dim), its value v_head_dim; n_kv_heads is unused. rope_interleave: the rotated pairs are
    # interleaved in the weights (DeepSeek's checkpoints). rope_mscale, rope_mscale_all_dim: YaRN's mscale and
    # mscale_all_dim (0 = unset), which set its cos/sin factor and, for latent attention, the logits' scale.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # Sliding-window attention: a query sees the newest `sliding_window` positions up to itself (0 = all). With
    # `global_every` = n, layers n-1, 2n-1, ... see everything (Gemma 3: 6; 0 = every layer slides, as Mistral),
    # and the sliding layers' RoPE base is `rope_local_theta` (0 = rope_theta), unscaled.
    sliding_window: int = 0
    global_every: int = 0
    rope_local_theta: float = 0.0
    # MLP gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU: Gemma).
    mlp_activation: str = "silu"
    # Gemma: RMSNorm scales by (1 + w); each sublayer's output normed again before the residual add; embeddings
    # times sqrt(d_model); the final logits capped like the attention's (0 = off).
    norm_offset: bool = False
    post_norms: bool = False
    embed_scale: bool = False
    final_softcap: float = 0.0
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
    # "capacity" (the above) or "dropless": every token reaches its top-k experts (Mixtral, Qwen3-MoE), the tokens
    # sorted by expert through jax.lax.ragged_dot; no capacity, nothing dropped, moe_group_tokens unused.
    moe_routing: str = "capacity"
    # The top-k gates renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob), or the raw probabilities.
    moe_renormalize: bool = True
    # How the router scores experts: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3: each expert's own
    # sigmoid). With moe_groups > 1 (n_group) the experts form that many groups, each scored by its two best
    # experts, and a token chooses only among the moe_topk_groups (topk_group) best groups. The gates are then
    # multiplied by moe_routed_scale (routed_scaling_factor). jaxtrain.models.moe.choose.
    moe_score: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0
    # DeepSeek-V3's mixture: the first `first_dense_layers` layers have a dense MLP of width `dense_d_ff` instead;
    # every other layer adds `n_shared_experts` shared experts (one MLP of width n_shared_experts * d_ff that every
    # token passes through) to its routed ones; `moe_score_bias`: the router's per-expert correction bias
    # (e_score_correction_bias), added to the sigmoid scores to choose experts but not to the gates.
    first_dense_layers: int = 0
    dense_d_ff: int = 0
    n_shared_experts: int = 0
    moe_score_bias: bool = False
    # Auxiliary-loss-free balancing (DeepSeek-V3: 0.001): after each step every layer's correction bias moves by
    # this much toward its under-loaded experts (+rate below the layer's mean load, -rate above), outside the
    # gradient; 0 = the bias stays as it is. Needs moe_score_bias.
    moe_bias_rate: float = 0.0
    # The load-balancing loss (moe_aux_weight) over the whole batch, or each sequence's (a batch row's) averaged
    # over the rows: DeepSeek-V3's complementary sequence-wise loss.
    moe_aux_loss: str = "batch"
    # Multi-token prediction (DeepSeek-V3's num_nextn_predict_layers): `mtp_layers` modules after the model, module
    # k predicting the token k + 1 ahead of the main head's from the previous module's hidden state and the next
    # token's embedding (transformer.Transformer.mtp). Their cross-entropy, averaged over the modules, joins the
    # training loss with weight `mtp_loss_weight` (DeepSeek-V3: 0.3, then 0.1) and is reported as mtp/loss.
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.1
    # Dropless's grouped matmul: "xla" (jax.lax.ragged_dot; on GPUs XLA runs it as one dense matmul over every
    # expert) or "tokamax" (tokamax.ragged_dot, `pip install 'jaxtrain[kernels]'`: its Mosaic GPU kernel on
    # H100/B200, its Pallas TPU kernel, XLA's elsewhere).
    moe_kernel: str = "xla"
    # The weight gradient of dropless's grouped matmuls: "xla" (ragged_dot_general: on GPUs one dense matmul over
    # every expert) or "pallas" (jaxtrain.models.gpu_grouped's Triton kernel, routed rows only; GPUs only).
    moe_weight_grad: str = "xla"
    # Its input gradient: "kernel" (moe_kernel's ragged_dot on each expert weight transposed, a copy XLA makes per
    # layer and microbatch) or "pallas" (gpu_grouped's Triton kernel, reading the weight as it is; GPUs only).
    moe_input_grad: str = "kernel"
    # How dropless routing reaches experts split over mesh.expert: "gather" (XLA gathers every token to every
    # expert shard and all-reduces the partial outputs) or "all_to_all" (each routed row sent once to its expert's
    # device and back: jaxtrain.parallel.experts). The same function; only the communication differs.
    moe_dispatch: str = "gather"
    # all_to_all's receive buffer from each source: 0 = the worst case (nothing dropped; on GPU/TPU memory and
    # grouped-matmul rows for every routed row landing on one device), f > 0 = ceil(f * rows / expert shards), a
    # balanced share times f; the rows past it are dropped (their output 0, the residual carries them) and counted
    # in moe/dropped_fraction.
    moe_dispatch_capacity: float = 0.0
    # The layers' weight matmuls in "fp8" or "int8" (jaxtrain.models.quant), or "none": a compute choice, the
    # weights stay in param_dtype.
    quant: str = "none"
    # The training loss: the output projection and cross-entropy run fused, about `loss_chunk_tokens` tokens per
    # device at a time (jaxtrain.models.cross_entropy), so the [B, T, vocab] logits never exist whole. 0 = unfused.
    loss_chunk_tokens: int = 512
    # LoRA (jaxtrain.models.lora): rank-`lora_rank` adapters (0 = none) on the projections `lora_targets` names
    # (comma-separated LORA_TARGETS, or "all" the model has), scaled by lora_alpha / lora_rank, their input
    # dropped out with probability lora_dropout in training steps; training then updates the adapters only.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "all"
    lora_dropout: float = 0.0

    @property
    def stacked_layers(self) -> int:
        """The layers of the `blocks` stack, the ones a pipeline splits: all but DeepSeek-V3's dense first ones."""
        return self.n_layers - self.first_dense_layers

    def __post_init__(self):
        if "auto" in (self.dtype, self.param_dtype):  # built directly, not by `from_config`: the host's platform
            resolved = resolve_dtypes(self.dtype, self.param_dtype, jax.default_backend())
            object.__setattr__(self, "dtype", resolved[0])
            object.__setattr__(self, "param_dtype", resolved[1])


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run executes the model, not what it is (no parameter depends on it). `remat`: the layers'
    rematerialization policy (REMAT_POLICIES). `pipeline_*`: the layer stack's pipeline (jaxtrain.parallel.pipeline;
    1 stage = a plain scan over the layers). `grad_reduce_dtype`: the dtype the weight matmuls' gradients are
    reduced over the batch axes in (layers.weight_grad_in). The defaults run the model plainly; a run's come from
    its config (jaxtrain.config.layout)."""
    remat: str = "none"
    pipeline_stages: int = 1
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = 1
    grad_reduce_dtype: str = "float32"


def resolve_dtypes(dtype: str, param_dtype: str, platform: str) -> tuple[str, str]:
    """`auto` dtypes for `platform`: float32 on CPU, bf16 compute + f32 params elsewhere."""
    return ("float32" if platform == "cpu" else "bfloat16") if dtype == "auto" else dtype, \
        "float32" if param_dtype == "auto" else param_dtype


# Keys of the config's `model` group that are not ModelConfig fields: where the weights come from, and the layout.
NOT_MODEL_FIELDS = ("init_from", "init_adapters", "remat")


def _default(field: str):
    """A ModelConfig field's default, where ModelConfig defines it."""
    return getattr(ModelConfig, field)


def config_defaults() -> dict:
    """The config schema's `model` group: every ModelConfig field, Layout's `remat`, `init_from` and
    `init_adapters`."""
    group = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    # A Hugging Face directory whose weights start a fresh run (jaxtrain.models.hf): where the weights come from,
    # not what the model is. `init_adapters`: a PEFT LoRA directory whose adapters start the run over that base.
    return {**group, "remat": Layout.remat, "init_from": "", "init_adapters": ""}


def from_config(model, platform: str) -> ModelConfig:
    """The ModelConfig of the config's `model` group, its dtypes resolved for `platform`."""
    m = {k: v for k, v in dict(model).items() if k not in NOT_MODEL_FIELDS}
    m["dtype"], m["param_dtype"] = resolve_dtypes(m["dtype"], m["param_dtype"], platform)
    return ModelConfig(**m)


def check_config(model, *, seq_len: int, mesh_shape: dict) -> None:
    """ConfigError naming the first bad field of the `model` group."""
    g = Group(model, "model")
    for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
        g.positive_int(f)
    m = model
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", f"{m.n_kv_heads} does not divide model.n_heads={m.n_heads}")
    if m.head_dim % 2:
        raise ConfigError("model.head_dim", f"must be even for RoPE, got {m.head_dim}")
    g.choice("remat", sorted(REMAT_POLICIES), what="policy")
    for f in ("dtype", "param_dtype"):
        g.choice(f, DTYPES, what="dtype")
    g.number("rope_theta", lo=0, lo_open=True)
    g.number("norm_eps", lo=0, lo_open=True)
    g.number("init_std", lo=0, lo_open=True)
    g.string("family")
    if g.choice("rope_scaling", ROPE_SCALINGS, what="RoPE scaling") != "none":
        g.number("rope_factor", lo=1)
        if m.rope_scaling == "llama3":
            g.number("rope_low_freq_factor", lo=0, lo_open=True)
            if g.number("rope_high_freq_factor", lo=0, lo_open=True) <= m.rope_low_freq_factor:
                raise ConfigError("model.rope_high_freq_factor", f"{m.rope_high_freq_factor} must exceed "
                                  f"model.rope_low_freq_factor={m.rope_low_freq_factor}")
        if m.rope_scaling in ("llama3", "yarn"):
            g.positive_int("rope_original_max_len")
        if m.rope_scaling == "yarn":
            g.number("rope_beta_fast", lo=0, lo_open=True)
            g.number("rope_beta_slow", lo=0, lo_open=True)
            g.number("rope_attention_factor", lo=0)
    for f in ("attn_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
        g.number(f, lo=0)
    g.positive_int("sliding_window", allow_zero=True)
    g.positive_int("global_every", allow_zero=True)
    if m.global_every and not m.sliding_window:
        raise ConfigError("model.global_every", f"{m.global_every} names global layers among sliding ones, but "
                          f"model.sliding_window is 0 (every layer is global)")
    g.choice("mlp_activation", MLP_ACTIVATIONS, what="activation")
    if m.attn_softcap and m.attention_impl == "cudnn":
        raise ConfigError("model.attn_softcap", "cuDNN's attention has no logit soft-capping; use "
                          "model.attention_impl=xla")
    g.positive_int("n_experts", allow_zero=True)
    g.positive_int("loss_chunk_tokens", allow_zero=True)
    g.positive_int("scan_unroll")
    g.positive_int("attention_block", allow_zero=True)
    g.choice("attention_impl", ATTENTION_IMPLS)
    _check_context_parallel(g, m, seq_len, mesh_shape["sequence"], mesh_shape["pipeline"])
    if m.attention_impl == "cudnn" and m.attention_block:
        raise ConfigError("model.attention_impl", f"cudnn is the library call's kernel; it needs "
                          f"model.attention_block=0, got {m.attention_block}")
    if m.attention_impl == "cudnn" and (m.head_dim > 128 or m.head_dim % 8):  # jax's cuDNN flash-attention bounds
        raise ConfigError("model.attention_impl", f"cudnn's flash attention needs model.head_dim <= 128 and a "
                          f"multiple of 8, got {m.head_dim} (use 'xla')")
    if g.positive_int("lora_rank", allow_zero=True):
        g.number("lora_alpha", lo=0, lo_open=True)
        if g.number("lora_dropout", lo=0) >= 1:
            raise ConfigError("model.lora_dropout", f"must be < 1, got {m.lora_dropout!r}")
        names = [t.strip() for t in str(m.lora_targets).split(",") if t.strip()]
        if names != ["all"] and (not names or any(t not in LORA_TARGETS for t in names)):
            raise ConfigError("model.lora_targets", f"{m.lora_targets!r}: expected 'all' or a comma-separated list "
                              f"of {', '.join(LORA_TARGETS)}")
        if m.n_experts and (dense := [t for t in names if t in DENSE_MLP_TARGETS]):
            raise ConfigError("model.lora_targets", f"{','.join(dense)}: a mixture of experts has no dense MLP; "
                              "'experts' adapts its experts")
        if "kv" in names and not m.kv_lora_rank:
            raise ConfigError("model.lora_targets", "'kv' adapts latent attention's key-value projections; this "
                              "model's attention is not latent (model.kv_lora_rank is 0): use 'k,v'")
        if not m.n_experts and "experts" in names:
            raise ConfigError("model.lora_targets", "'experts': the model has no mixture of experts "
                              "(model.n_experts is 0)")
        if m.lora_dropout and "experts" in lora_target_names(m.lora_targets, m.n_experts, bool(m.kv_lora_rank)):
            raise ConfigError("model.lora_dropout", "the experts' adapters take no dropout (nor do PEFT's); set it "
                              "to 0 or leave 'experts' out of model.lora_targets")
    if g.positive_int("kv_lora_rank", allow_zero=True):
        _check_latent_attention(g, m)
    if g.positive_int("first_dense_layers", allow_zero=True):
        if m.first_dense_layers >= m.n_layers:
            raise ConfigError("model.first_dense_layers", f"{m.first_dense_layers} leaves none of the "
                              f"model.n_layers={m.n_layers} layers a mixture of experts")
        g.positive_int("dense_d_ff")
        if m.sliding_window:  # their stack runs with the global layers' mask only (transformer.hidden)
            raise ConfigError("model.first_dense_layers", f"{m.first_dense_layers} dense first layers do not combine "
                              f"with sliding windows (model.sliding_window={m.sliding_window}) yet")
    if g.positive_int("mtp_layers", allow_zero=True):
        g.number("mtp_loss_weight", lo=0)
        if m.lora_rank:  # their blocks would need adapters PEFT has no names for
            raise ConfigError("model.mtp_layers", f"{m.mtp_layers} multi-token prediction modules do not train "
                              f"under LoRA (model.lora_rank={m.lora_rank}); set model.mtp_layers=0 to leave them out")
        if m.sliding_window:  # their blocks attend with the global mask (transformer.Transformer.mtp_states)
            raise ConfigError("model.mtp_layers", f"{m.mtp_layers} multi-token prediction modules do not combine "
                              f"with sliding windows (model.sliding_window={m.sliding_window}) yet")
    for f in ("first_dense_layers", "n_shared_experts"):
        if g.positive_int(f, allow_zero=True) and not m.n_experts:
            raise ConfigError(f"model.{f}", f"{m[f]} belongs to a mixture of experts; model.n_experts is 0")
    if m.moe_score_bias and m.moe_score != "sigmoid":
        raise ConfigError("model.moe_score_bias", "the correction bias is added to sigmoid scores (DeepSeek-V3): "
                          "set model.moe_score=sigmoid")
    if g.number("moe_bias_rate", lo=0) and not m.moe_score_bias:
        raise ConfigError("model.moe_bias_rate", f"{m.moe_bias_rate} balances the router's correction bias, which "
                          f"this model has not: set model.moe_score_bias=True")
    g.choice("moe_aux_loss", MOE_AUX_LOSSES, what="balance loss")
    g.choice("moe_routing", MOE_ROUTINGS, what="routing")
    g.choice("moe_kernel", MOE_KERNELS, what="grouped-matmul kernel")
    g.choice("moe_dispatch", MOE_DISPATCHES, what="expert dispatch")
    if g.number("moe_dispatch_capacity", lo=0) and m.moe_dispatch != "all_to_all":
        raise ConfigError("model.moe_dispatch_capacity", f"{m.moe_dispatch_capacity} bounds all_to_all's receive "
                          f"buffer; model.moe_dispatch is {m.moe_dispatch!r}")
    if m.moe_dispatch != "gather" and not (m.n_experts and m.moe_routing == "dropless"):
        raise ConfigError("model.moe_dispatch", f"{m.moe_dispatch} dispatches dropless routing; this model has "
                          f"{'capacity routing' if m.n_experts else 'no experts'} (use 'gather')")
    if m.moe_kernel != "xla":
        if not (m.n_experts and m.moe_routing == "dropless"):
            raise ConfigError("model.moe_kernel", f"{m.moe_kernel} is dropless routing's grouped matmul; this model "
                              f"has {'capacity routing' if m.n_experts else 'no experts'} (use 'xla')")
        if importlib.util.find_spec(m.moe_kernel) is None:
            raise ConfigError("model.moe_kernel", f"{m.moe_kernel} is not installed "
                              f"(pip install 'jaxtrain[kernels]')")
    for field, choices, what in (("moe_weight_grad", MOE_WEIGHT_GRADS, "weight gradient"),
                                 ("moe_input_grad", MOE_INPUT_GRADS, "input gradient")):
        g.choice(field, choices, what=f"grouped {what}")
        default = _default(field)
        if m[field] != default and not (m.n_experts and m.moe_routing == "dropless"):
            raise ConfigError(f"model.{field}", f"{m[field]} is dropless routing's {what}; this model has "
                              f"{'capacity routing' if m.n_experts else 'no experts'} (use '{default}')")
    for field in ("moe_kernel", "moe_weight_grad", "moe_input_grad"):
        # A Pallas kernel is a custom call XLA cannot partition: it would see the experts gathered whole along
        # `expert` (and repeat every expert's work there) or the MLP width gathered along `tensor`. The
        # all-to-all dispatch hands it each device's own experts and rows.
        local = ("tensor",) if m.moe_dispatch == "all_to_all" else ("expert", "tensor")
        default = _default(field)
        if m[field] != default and (split := [a for a in local if mesh_shape[a] > 1]):
            raise ConfigError(f"model.{field}", f"{m[field]}'s kernel runs each device's tokens through whole "
                              f"expert weights; with mesh.{split[0]}={mesh_shape[split[0]]} XLA would gather them "
                              f"there (use '{default}', or data/fsdp/sequence axes"
                              f"{'' if split[0] == 'tensor' else ', or model.moe_dispatch=all_to_all'})")
    g.choice("quant", QUANT_MODES, what="quantization")
    if m.n_experts:
        g.positive_int("moe_top_k")
        if m.moe_top_k > m.n_experts:
            raise ConfigError("model.moe_top_k", f"{m.moe_top_k} exceeds model.n_experts={m.n_experts}")
        g.number("moe_capacity_factor", lo=0, lo_open=True)
        g.choice("moe_score", MOE_SCORES, what="router score")
        g.positive_int("moe_groups")
        g.number("moe_routed_scale", lo=0, lo_open=True)
        if m.n_experts % m.moe_groups:
            raise ConfigError("model.moe_groups", f"{m.moe_groups} does not divide model.n_experts={m.n_experts}")
        if m.moe_groups > 1 and m.moe_score != "sigmoid":
            raise ConfigError("model.moe_groups", "group-limited routing scores experts by sigmoid (DeepSeek-V3): "
                              "set model.moe_score=sigmoid, or moe_groups=1")
        if not 1 <= m.moe_topk_groups <= m.moe_groups:
            raise ConfigError("model.moe_topk_groups", f"{m.moe_topk_groups} must be between 1 and "
                              f"model.moe_groups={m.moe_groups}")
        if m.moe_top_k > m.moe_topk_groups * (m.n_experts // m.moe_groups):
            raise ConfigError("model.moe_top_k", f"{m.moe_top_k} exceeds the {m.moe_topk_groups} x "
                              f"{m.n_experts // m.moe_groups} experts of the groups a token chooses among")
        g.number("moe_aux_weight", lo=0)
        group = g.positive_int("moe_group_tokens", allow_zero=True)
        if group and seq_len % group:
            raise ConfigError("model.moe_group_tokens", f"{group} does not divide train.seq_len={seq_len}")
        if group and (seq_len // group) % mesh_shape["sequence"]:
            raise ConfigError("model.moe_group_tokens", f"the {seq_len // group} groups of a sequence do not "
                              f"split over mesh.sequence={mesh_shape['sequence']} (a group must sit on one sequence "
                              f"shard)")
        if m.n_experts % mesh_shape["expert"]:
            raise ConfigError("mesh.expert", f"{mesh_shape['expert']} does not divide model.n_experts={m.n_experts}")
    elif mesh_shape["expert"] > 1:
        raise ConfigError("mesh.expert", f"size {mesh_shape['expert']} needs a mixture of experts "
                          f"(model.n_experts > 0)")


def _check_context_parallel(g: Group, m, seq_len: int, n: int, stages: int) -> None:
    """model.context_parallel and what it does not combine with (jaxtrain.parallel.context)."""
    mode = g.choice("context_parallel", CONTEXT_PARALLEL, what="mode")
    if not isinstance(m.context_balance, bool):
        raise ConfigError("model.context_balance", f"must be True or False, got {m.context_balance!r}")
    g.positive_int("ulysses_ways", allow_zero=True)
    if mode == "allgather":
        return
    ring = mode in ("ring", "usp")
    why = {"attn_softcap": m.attn_softcap and "its blocks do not soft-cap the logits",
           "kv_lora_rank": m.kv_lora_rank and "latent attention (jaxtrain.models.mla) gathers K/V itself",
           "mtp_layers": m.mtp_layers and ring and m.context_balance
           and "the prediction modules look tokens ahead in the original order, not the zigzag layout"}
    for field, reason in why.items():
        if reason:
            raise ConfigError("model.context_parallel", f"{mode} does not combine with model.{field}={m[field]}: "
                              f"{reason}; use allgather")
    if stages > 1:
        raise ConfigError("model.context_parallel", f"{mode} does not combine with a pipeline (mesh.pipeline="
                          f"{stages}) yet; use allgather")
    if n > 1 and m.attention_impl == "cudnn":
        raise ConfigError("model.attention_impl", f"cudnn applies to K/V gathered whole (model.context_parallel="
                          f"allgather); under {mode} use 'pallas', the flash kernels per ring step, or 'xla'")
    if m.ulysses_ways and n % m.ulysses_ways:
        raise ConfigError("model.ulysses_ways", f"{m.ulysses_ways} does not divide mesh.sequence={n}")
    ways = _ulysses_group(m, n)
    where = "mesh.sequence" if mode == "ulysses" else "model.ulysses_ways"
    for field in ("n_heads", "n_kv_heads"):
        if m[field] % ways:
            raise ConfigError(f"model.{field}", f"{m[field]} heads do not divide by {where}={ways}: Ulysses "
                              "attention splits the heads over its group (use ring attention, or a size that "
                              "divides them)")
    r = n // ways  # the ring's size
    if ring and m.context_balance and r > 1 and seq_len % (2 * r):
        raise ConfigError("train.seq_len", f"{seq_len} does not split into 2 x {r} equal chunks (the ring's size, "
                          f"mesh.sequence={n} / {ways} Ulysses ways), as the balanced (zigzag) layout needs (or set "
                          "model.context_balance=False)")


def _ulysses_group(m, n: int) -> int:
    """How many devices of mesh.sequence=n trade heads for the sequence under model.context_parallel (its ring
    runs over n / that many)."""
    return {"ring": 1, "ulysses": n, "usp": context.ulysses_ways(m.ulysses_ways, n, m.n_heads, m.n_kv_heads)}[
        m.context_parallel]


def _check_ring_kernel(m, seq_len: int, n: int, backend: str) -> None:
    """model.attention_impl=pallas, over mesh.sequence=n: a ring to run in, kernels for `backend` that take
    model.head_dim, and ring blocks a multiple of their smallest tile."""
    if backend not in RING_KERNEL_LIMITS:  # CPUs run the ring's XLA blocks
        raise ConfigError("model.attention_impl", f"pallas runs on GPUs and TPUs only; this run compiles for "
                          f"{backend} (use 'xla')")
    if m.context_parallel == "allgather" or n == 1:
        raise ConfigError("model.attention_impl", "pallas runs the steps of ring, Ulysses or USP attention: it needs "
                          "model.context_parallel ring, ulysses or usp and mesh.sequence > 1; with K/V gathered "
                          "whole use 'cudnn'")
    head_dims, multiple = RING_KERNEL_LIMITS[backend]
    if m.head_dim not in head_dims:
        raise ConfigError("model.attention_impl", f"pallas's {backend.upper()} flash kernels need model.head_dim in "
                          f"{', '.join(map(str, head_dims))}, got {m.head_dim} (use 'xla')")
    r = n // _ulysses_group(m, n)
    if seq_len % r or seq_len // r % multiple:
        raise ConfigError("train.seq_len", f"{seq_len} gives ring blocks of {seq_len / r:g} tokens ({r} ring "
                          f"members); pallas's {backend.upper()} flash kernels need a multiple of {multiple} (or "
                          "model.attention_impl=xla)")


def _check_latent_attention(g: Group, m) -> None:
    """The fields of multi-head latent attention (model.kv_lora_rank > 0) and the options it does not combine with."""
    g.positive_int("q_lora_rank", allow_zero=True)
    g.positive_int("qk_nope_head_dim")
    g.positive_int("v_head_dim")
    g.number("rope_mscale", lo=0)
    g.number("rope_mscale_all_dim", lo=0)
    for field, why in (("sliding_window", "no sliding window"), ("qkv_bias", "no q/k/v biases"),
                       ("qk_norm", "no per-head q/k norms (its latents have norms of their own)"),
                       ("attn_softcap", "no logit soft-capping")):
        if m[field]:
            raise ConfigError(f"model.{field}", f"{m[field]!r}: latent attention (model.kv_lora_rank) has {why}")
    if m.attention_impl != "xla":
        raise ConfigError("model.attention_impl", f"{m.attention_impl}: latent attention runs XLA's kernel only")
    if m.lora_rank and (kv := sorted(lora_target_names(m.lora_targets, m.n_experts, True) & {"k", "v"})):
        raise ConfigError("model.lora_targets", f"{','.join(kv)}: latent attention's keys and values come from one "
                          f"latent; adapt them together as 'kv'")


def _version_tuple(version: str) -> tuple[int, ...]:
    """'0.0.17.dev20261026' -> (0, 0, 17): the release numbers, what follows them dropped."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def check_backend(model, backend: str, seq_len: int = 0, sequence: int = 1) -> None:
    """ConfigError for settings the backend the step compiles for ("cpu", "gpu", "tpu") cannot run, with
    train.seq_len and mesh.sequence's size."""
    if model.attention_impl == "cudnn":
        if backend != "gpu":
            raise ConfigError("model.attention_impl", f"cudnn runs on GPUs only; this run compiles for {backend} "
                              f"(use 'xla')")
        dtype = resolve_dtypes(model.dtype, model.param_dtype, backend)[0]
        if dtype not in ("bfloat16", "float16"):
            raise ConfigError("model.attention_impl", f"cudnn needs bfloat16 or float16 compute; "
                              f"model.dtype is {dtype}")
    if model.attention_impl == "pallas":
        _check_ring_kernel(model, seq_len, sequence, backend)
    for field in ("moe_weight_grad", "moe_input_grad"):
        if model[field] == "pallas" and backend != "gpu":  # a Triton kernel; CPUs run cpu_grouped's tiles
            raise ConfigError(f"model.{field}", f"pallas runs on GPUs only; this run compiles for {backend} "
                              f"(use '{_default(field)}')")
    if model.moe_kernel == "tokamax" and backend == "gpu":
        # jax 0.11 renamed an argument of the Mosaic GPU API tokamax's kernels call (out_shape -> out_type), and
        # tokamax 0.0.13 moved to it: an older one fails to trace there (H100, docs/performance.md).
        tokamax_version = _version_tuple(importlib.metadata.version("tokamax"))
        if jax.__version_info__ >= (0, 11) and tokamax_version < (0, 0, 13):
            raise ConfigError("model.moe_kernel", f"tokamax {'.'.join(map(str, tokamax_version))} predates jax "
                              f"{jax.__version__}'s Mosaic GPU API; install tokamax>=0.0.13 (or use 'xla')")
        # Its Mosaic GPU kernel tiles rows of 128 bytes (64 bf16) and fails to lower narrower ones ("WGMMA rhs
        # swizzle must match lhs swizzle", seen compiling for described H100s).
        for field in ("d_model", "d_ff"):
            if model[field] % 64:
                raise ConfigError(f"model.{field}", f"{model[field]} is not a multiple of 64, which tokamax's GPU "
                                  f"kernel (model.moe_kernel) needs")


