"""A plain-PyTorch twin of jaxtrain's model and optimizer, for scripts/bench_torch_ref.py and tests/test_torch_ref.py.

Same math as `jaxtrain.models.transformer.Transformer` (f32; when model.dtype is bfloat16, bf16 compute with f32
params under `torch.autocast("cpu", torch.bfloat16)`, torch's own mixed precision): token embedding, per layer
RMSNorm -> GQA attention with rotate-half RoPE -> residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; tied
or untied head. Attention is `F.scaled_dot_product_attention`, `is_causal` when every row is one document (the
benchmark's batch), else jaxtrain's causal, same-document, non-padding mask (`attention_mask`; padding queries
also see themselves, so no softmax row is empty). Weights keep jaxtrain's layout with the heads flattened, one
tensor per layer, so `load_jax_params` reshapes and never transposes; activations are x @ W.

The optimizer mirrors `jaxtrain.optim.make_optimizer`: optax's `clip_by_global_norm`, then `torch.optim.AdamW` with
the same hyperparameters, with jaxtrain's own decay mask and schedule. Like `jaxtrain.step`, a non-finite loss or
gradient norm skips the update. The loss is the mean next-token cross-entropy within documents
(`jaxtrain.step.next_token_targets`). Import from tests with `sys.path.insert(0, "scripts")`: scripts/ is not a
package.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# ===== Model ===========================================================================================


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.scale.float()).to(x.dtype)


def rope_tables(positions, head_dim: int, theta: float):
    """cos, sin: [B, T, 1, head_dim / 2] in f32, as jaxtrain's `rope` computes them."""
    half = head_dim // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angle = positions.float()[:, :, None, None] * freq
    return torch.cos(angle), torch.sin(angle)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on x: [B, T, N, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, self.h, self.kv, self.hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Parameter(torch.empty(d, self.h * self.hd))
        self.wk = nn.Parameter(torch.empty(d, self.kv * self.hd))
        self.wv = nn.Parameter(torch.empty(d, self.kv * self.hd))
        self.wo = nn.Parameter(torch.empty(self.h * self.hd, d))

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = apply_rope((x @ self.wq).view(b, t, self.h, self.hd), cos, sin).transpose(1, 2)
        k = apply_rope((x @ self.wk).view(b, t, self.kv, self.hd), cos, sin).transpose(1, 2)
        v = (x @ self.wv).view(b, t, self.kv, self.hd).transpose(1, 2)
        if self.kv != self.h:  # query head n reads kv head n // (H / KV), as jax.nn.dot_product_attention does
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, self.h * self.hd) @ self.wo


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = nn.Parameter(torch.empty(d, f))
        self.w_up = nn.Parameter(torch.empty(d, f))
        self.w_down = nn.Parameter(torch.empty(f, d))

    def forward(self, x):
        return (F.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """`Llama(model_cfg)` for a `jaxtrain.models.config.ModelConfig`; weights are uninitialised until
    `load_jax_params`."""

    def __init__(self, cfg):
        super().__init__()
        if cfg.dtype not in ("float32", "bfloat16") or cfg.param_dtype != "float32":
            raise ValueError(f"the torch reference computes in float32 or bfloat16 (autocast) with float32 params; "
                             f"got dtype={cfg.dtype}, param_dtype={cfg.param_dtype}")
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.unembed = nn.Parameter(torch.empty(cfg.d_model, cfg.vocab_size))

    def forward(self, tokens, positions, mask=None):
        """tokens, positions: int [B, T]; mask: None (causal, one document per row) or bool [B, 1, T, T].
        Returns f32 logits [B, T, vocab]."""
        x = F.embedding(tokens, self.embed)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.final_norm(x)
        head = self.embed.t() if self.cfg.tie_embeddings else self.unembed
        return x @ head


# ===== jaxtrain params <-> torch =======================================================================

# jaxtrain path under `blocks` -> torch name under layers.i
LAYER_NAMES = {
    ("attn_norm", "scale"): "attn_norm.scale",
    ("attn", "wq"): "attn.wq",
    ("attn", "wk"): "attn.wk",
    ("attn", "wv"): "attn.wv",
    ("attn", "wo"): "attn.wo",
    ("mlp_norm", "scale"): "mlp_norm.scale",
    ("mlp", "w_gate"): "mlp.w_gate",
    ("mlp", "w_up"): "mlp.w_up",
    ("mlp", "w_down"): "mlp.w_down",
}
TOP_NAMES = {("embed",): "embed", ("final_norm", "scale"): "final_norm.scale", ("unembed",): "unembed"}


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, prefix + (str(k),)) if isinstance(v, dict) else {prefix + (str(k),): v})
    return out


def param_map(model_cfg, params) -> list[tuple[str, tuple[str, ...], int | None]]:
    """[(torch name, jaxtrain path, layer index or None)] covering every leaf of the jaxtrain `params`;
    a jaxtrain parameter without a torch twin is an error, so the two models cannot drift apart silently."""
    out = []
    for path in _flat(params):
        if path[0] == "blocks" and path[1:] in LAYER_NAMES:
            out += [(f"layers.{i}.{LAYER_NAMES[path[1:]]}", path, i) for i in range(model_cfg.n_layers)]
        elif path in TOP_NAMES:
            out.append((TOP_NAMES[path], path, None))
        else:
            raise KeyError(f"{'.'.join(path)}: jaxtrain parameter with no torch twin in scripts/torch_llama.py")
    return out


def load_jax_params(model: Llama, params) -> None:
    """Copies jaxtrain's pure-dict params (jax or numpy arrays, e.g. `jax.device_get(state["params"])`)
    into `model`; every torch parameter must be written exactly once."""
    flat = _flat(params)
    torch_params = dict(model.named_parameters())
    written = set()
    with torch.no_grad():
        for name, path, layer in param_map(model.cfg, params):
            x = np.asarray(flat[path], dtype=np.float32)
            x = x[layer] if layer is not None else x
            p = torch_params[name]
            p.copy_(torch.from_numpy(np.ascontiguousarray(x)).reshape(p.shape))
            written.add(name)
    if missing := set(torch_params) - written:
        raise KeyError(f"torch parameters not in the jaxtrain params: {sorted(missing)}")


def to_jax_layout(model: Llama, like) -> dict:
    """The torch model's weights as numpy in the structure and shapes of jaxtrain's pure-dict params `like`."""
    flat = {path: np.asarray(x) for path, x in _flat(like).items()}
    torch_params = dict(model.named_parameters())
    out = {path: np.empty(x.shape, np.float32) for path, x in flat.items()}
    for name, path, layer in param_map(model.cfg, like):
        w = torch_params[name].detach().cpu().numpy()
        if layer is None:
            out[path][...] = w.reshape(out[path].shape)
        else:
            out[path][layer] = w.reshape(out[path].shape[1:])
    nested: dict = {}
    for path, v in out.items():
        node = nested
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return nested


# ===== Batch, loss, optimizer ==========================================================================


def prepare_batch(batch: dict) -> dict:
    """jaxtrain's numpy batch {"tokens", "segment_ids", "positions"} [B, T] -> torch tensors: targets and weights
    as `jaxtrain.step.next_token_targets`, the token count `total` (max(sum(weights), 1)), and `mask` (None when
    every row is a single document without padding, else jaxtrain's `attention_mask` | identity)."""
    tokens = np.asarray(batch["tokens"])
    seg = np.asarray(batch["segment_ids"])
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    next_seg = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
    weights = ((seg != 0) & (next_seg == seg)).astype(np.float32)
    if (seg != 0).all() and (seg == seg[:, :1]).all():
        mask = None
    else:
        t = seg.shape[1]
        causal = np.tril(np.ones((t, t), bool))
        mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
        mask = torch.from_numpy((mask | np.eye(t, dtype=bool)[None])[:, None])
    return {"tokens": torch.from_numpy(tokens.astype(np.int64)),
            "positions": torch.from_numpy(np.asarray(batch["positions"]).astype(np.int64)),
            "targets": torch.from_numpy(targets.astype(np.int64)),
            "weights": torch.from_numpy(weights),
            "total": torch.tensor(max(float(weights.sum()), 1.0), dtype=torch.float32),
            "mask": mask}


class LossModel(nn.Module):
    """Mean next-token cross-entropy (f32) over the scored tokens: what torch.compile compiles (fwd + bwd)."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, tokens, positions, targets, weights, total, mask=None):
        logits = self.model(tokens, positions, mask)
        ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        return (ce * weights.flatten()).sum() / total


def _fused_adamw_ok() -> bool:
    try:
        p = nn.Parameter(torch.zeros(1))
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


class TorchTrainer:
    """The jaxtrain train step in PyTorch: `TorchTrainer(config, model_cfg, params)` starts from jaxtrain's
    params; `train_step(prepared_batch)` -> {"loss", "grad_norm", "lr", "finite"} (loss at the params before
    the update, like jaxtrain's metrics).

    `compile=True` wraps the forward + loss in `torch.compile` (default mode; backward through AOTAutograd).
    `fused` (None = when this torch supports it on CPU) picks AdamW's fused kernel, same formula."""

    def __init__(self, config, model_cfg, params, compile: bool = False, fused: bool | None = None):
        from jaxtrain import optim  # jax-side pieces shared literally: decay mask and schedule

        self.model = Llama(model_cfg)
        load_jax_params(self.model, params)
        decays = _flat(optim.decay_mask(params))
        named = dict(self.model.named_parameters())
        decay, no_decay = [], []
        for name, path, _ in param_map(model_cfg, params):
            (decay if decays[path] else no_decay).append(named[name])
        # A tied embedding is one parameter; named_parameters() lists it once.
        self.params = decay + no_decay
        o = config.optim
        self.fused = _fused_adamw_ok() if fused is None else fused
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=0.0, betas=(o.b1, o.b2), eps=o.eps, fused=self.fused or None)
        self.n_decay, self.n_no_decay = sum(p.numel() for p in decay), sum(p.numel() for p in no_decay)
        self.clip_norm = float(o.clip_norm)
        self._schedule = optim.schedule(o, config.train.steps)
        self._lrs = [float(x) for x in np.asarray(_vmap_schedule(self._schedule, config.train.steps + 1))]
        self.applied = 0  # optax's count: updates applied so far (a skipped non-finite step does not count)
        self.loss_model = LossModel(self.model)
        self.loss_fn = torch.compile(self.loss_model) if compile else self.loss_model
        self.autocast = model_cfg.dtype == "bfloat16"

    def lr(self, count: int) -> float:
        return self._lrs[count] if count < len(self._lrs) else float(self._schedule(count))

    def train_step(self, b: dict) -> dict:
        lr = self.lr(self.applied)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.loss_fn(b["tokens"], b["positions"], b["targets"], b["weights"], b["total"], b["mask"])
        loss.backward()
        grads = [p.grad for p in self.params]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        finite = bool(torch.isfinite(loss) & torch.isfinite(norm))
        if finite:
            if self.clip_norm > 0:  # optax.clip_by_global_norm: g if norm < clip else g / norm * clip
                torch._foreach_mul_(grads, torch.clamp(self.clip_norm / norm, max=1.0))
            self.opt.step()
            self.applied += 1
        return {"loss": loss.detach(), "grad_norm": norm, "lr": lr, "finite": finite}


def _vmap_schedule(schedule, n: int):
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.vmap(schedule))(jnp.arange(n, dtype=jnp.int32))
