"""The model's configuration: `ModelConfig` is the one source of the model's defaults.

The config schema's `model` group is built from its fields (`config_defaults`), and `check_config` is that
group's validation. Sizes, layout and numerics are the model; `pipeline_*` come from the `pipeline` group
and say how the layer stack runs, not what it is.
"""

from __future__ import annotations

import dataclasses
import jax

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group

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


# jax.nn.dot_product_attention's kernels that model.attention_impl may name (`check_backend` says where each runs).
ATTENTION_IMPLS = ("xla", "cudnn")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# How the layer stack runs, set from the config's `pipeline` group (jaxtrain.parallel.pipeline).
PIPELINE_FIELDS = ("pipeline_stages", "pipeline_microbatches", "pipeline_schedule", "pipeline_repeats")


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
    dtype: str = "auto"
    param_dtype: str = "auto"
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
    # Pipeline parallelism (jaxtrain.parallel.pipeline): how the layer stack runs, not what the model is. 1 stage = a
    # plain scan over the layers.
    pipeline_stages: int = 1
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = 1
    # The training loss: the output projection and cross-entropy run fused, about `loss_chunk_tokens` tokens per
    # device at a time (jaxtrain.models.cross_entropy), so the [B, T, vocab] logits never exist whole. 0 = unfused.
    loss_chunk_tokens: int = 512

    def __post_init__(self):
        if "auto" in (self.dtype, self.param_dtype):  # built directly, not by `from_config`: the host's platform
            resolved = resolve_dtypes(self.dtype, self.param_dtype, jax.default_backend())
            object.__setattr__(self, "dtype", resolved[0])
            object.__setattr__(self, "param_dtype", resolved[1])


def resolve_dtypes(dtype: str, param_dtype: str, platform: str) -> tuple[str, str]:
    """`auto` dtypes for `platform`: float32 on CPU, bf16 compute + f32 params elsewhere."""
    return ("float32" if platform == "cpu" else "bfloat16") if dtype == "auto" else dtype, \
        "float32" if param_dtype == "auto" else param_dtype


def config_defaults() -> dict:
    """The config schema's `model` group: every ModelConfig field but the pipeline's, and `init_from`."""
    group = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name not in PIPELINE_FIELDS}
    # A Hugging Face directory whose weights start a fresh run (jaxtrain.models.hf): where the weights come from,
    # not what the model is.
    return {**group, "init_from": ""}


def from_config(model, pipeline, platform: str) -> ModelConfig:
    """The ModelConfig of the config's `model` and `pipeline` groups, its dtypes resolved for `platform`."""
    m = {k: v for k, v in dict(model).items() if k != "init_from"}
    m["dtype"], m["param_dtype"] = resolve_dtypes(m["dtype"], m["param_dtype"], platform)
    return ModelConfig(**m, pipeline_stages=pipeline.stages, pipeline_microbatches=pipeline.microbatches,
                       pipeline_schedule=pipeline.schedule, pipeline_repeats=pipeline.repeats)


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
    g.positive_int("n_experts", allow_zero=True)
    g.positive_int("loss_chunk_tokens", allow_zero=True)
    g.positive_int("scan_unroll")
    g.positive_int("attention_block", allow_zero=True)
    g.choice("attention_impl", ATTENTION_IMPLS)
    if m.attention_impl == "cudnn" and m.attention_block:
        raise ConfigError("model.attention_impl", f"cudnn is the library call's kernel; it needs "
                          f"model.attention_block=0, got {m.attention_block}")
    if m.n_experts:
        g.positive_int("moe_top_k")
        if m.moe_top_k > m.n_experts:
            raise ConfigError("model.moe_top_k", f"{m.moe_top_k} exceeds model.n_experts={m.n_experts}")
        g.number("moe_capacity_factor", lo=0, lo_open=True)
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


def check_backend(model, backend: str) -> None:
    """ConfigError for settings the backend the step compiles for ("cpu", "gpu", "tpu") cannot run."""
    if model.attention_impl == "cudnn":
        if backend != "gpu":
            raise ConfigError("model.attention_impl", f"cudnn runs on GPUs only; this run compiles for {backend} "
                              f"(use 'xla')")
        dtype = resolve_dtypes(model.dtype, model.param_dtype, backend)[0]
        if dtype not in ("bfloat16", "float16"):
            raise ConfigError("model.attention_impl", f"cudnn needs bfloat16 or float16 compute; "
                              f"model.dtype is {dtype}")


