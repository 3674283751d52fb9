"""Group relative policy optimisation (GRPO, Shao et al. 2024) and its published variants: the loss math.

Each prompt gets G sampled completions; a completion's advantage is its reward minus its group's mean (divided
by the group's std, except in Dr. GRPO). The policy loss is PPO's clipped surrogate per completion token,
-min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), with w = pi / pi_old per token, or per sequence as in GSPO
(exp of the mean token log-ratio); DAPO raises eps_high ("clip-higher"). beta > 0 adds the k3 estimate of
KL(pi || ref). Aggregation ("loss_type"): grpo = mean over each sequence's tokens, then over sequences;
bnpo/dapo = mean over all completion tokens; dr_grpo = sum / (N * max completion length). Sampler weights
correct a sampler/trainer mismatch (truncated or masked importance sampling). DAPO's dynamic sampling and soft
overlong punishment are helpers here. Every definition follows TRL 1.16's GRPOTrainer
(tests/models/test_grpo_loss.py calls TRL's own code); the result is the single-process, no-accumulation meaning of
TRL's loss, and `policy_terms` returns it as (sum, count) so that accumulated micro-batches normalise globally, as
TRL's dapo.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IMPORTANCE_LEVELS = ("token", "sequence")
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# The config's `grpo` group (train.objective="grpo"). Defaults are TRL 1.16's, except `sampler_correction`:
# TRL turns it on for vLLM; our rollouts run on the training mesh with the training weights, so off by default.
# delta (INTELLECT-2's cap on the unclipped ratio) and sampler_clip_min: 0 = off.
CONFIG = dict(group_size=8, scale_rewards=True, reward_eps=1e-4, loss_type="dapo", epsilon_low=0.2,
              epsilon_high=0.2, delta=0.0, beta=0.0, kl_bias_correction=True, importance_level="token",
              max_completion_tokens=512, sampler_correction="none", sampler_clip_min=0.0, sampler_clip_max=3.0,
              dynamic_sampling=False, overlong_cache=0,
              # The rollouts' sampling (models.rollout): the log-probs the loss compares are of logits / temperature.
              temperature=1.0, top_p=1.0, top_k=0,
              # Texts that end a completion besides the tokenizer's EOS (e.g. "</answer>"), kept in it.
              stop_strings=(),
              # A rollout samples `rollout_batches` train batches at once; the steps take them one at a time,
              # `iterations` passes over them (PPO's epochs; TRL's steps_per_generation and num_iterations). 1 x 1
              # is on-policy; otherwise the ratio's denominator is the sampling weights' log-probs.
              rollout_batches=1, iterations=1,
              # The evals on the held-out prompts (eval.every_steps): `eval_samples` completions each; one counts as
              # correct when its reward reaches `success_reward` (accuracy; pass@eval_samples per prompt).
              eval_samples=4, success_reward=1.0)


def check_config(d) -> None:
    def number(field, ok, what):
        value = getattr(d, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ConfigError(f"grpo.{field}", f"must be {what}, got {value!r}")

    def choice(field, options):
        if getattr(d, field) not in options:
            raise ConfigError(f"grpo.{field}", f"must be one of {', '.join(options)}, got {getattr(d, field)!r}")

    def flag(field):
        if not isinstance(getattr(d, field), bool):
            raise ConfigError(f"grpo.{field}", f"must be true or false, got {getattr(d, field)!r}")

    # A group of one has no relative advantage (its reward minus its own mean is 0).
    number("group_size", lambda v: isinstance(v, int) and v >= 2, "an integer >= 2")
    number("success_reward", lambda v: True, "a number")
    for field in ("max_completion_tokens", "rollout_batches", "iterations", "eval_samples"):
        number(field, lambda v: isinstance(v, int) and v >= 1, "a positive integer")
    number("overlong_cache", lambda v: isinstance(v, int) and 0 <= v < d.max_completion_tokens,
           "an integer in [0, max_completion_tokens)")
    number("reward_eps", lambda v: v > 0, "a positive number")
    number("epsilon_low", lambda v: 0 <= v < 1, "a number in [0, 1)")
    number("epsilon_high", lambda v: v >= 0, "a non-negative number")
    number("delta", lambda v: v == 0 or v > 1, "0 (off) or a number above 1")
    number("beta", lambda v: v >= 0, "a non-negative number")
    number("sampler_clip_max", lambda v: v > 0, "a positive number")
    stops = d.stop_strings
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise ConfigError("grpo.stop_strings", f"must be a tuple of non-empty strings, e.g. ('</answer>',); got "
                          f"{stops!r}")
    number("temperature", lambda v: v > 0, "a positive number (rollouts sample; 0 would be greedy)")
    number("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
    number("top_k", lambda v: isinstance(v, int) and v >= 0, "a non-negative integer (0: off)")
    number("sampler_clip_min", lambda v: 0 <= v < d.sampler_clip_max, "a number in [0, sampler_clip_max)")
    choice("loss_type", LOSS_TYPES)
    choice("importance_level", IMPORTANCE_LEVELS)
    choice("sampler_correction", SAMPLER_CORRECTIONS)
    for field in ("scale_rewards", "kl_bias_correction", "dynamic_sampling"):
        flag(field)


# ===== Rewards to advantages =========================================================================================

def advantages(rewards, group_size: int, scale_by_std: bool = True, eps: float = 1e-4):
    """rewards [N], consecutive groups of `group_size` completions per prompt -> advantages [N]: r - mean(group),
    divided by (std(group) + eps) when scale_by_std (Dr. GRPO: off). As TRL: the std is Bessel-corrected
    (torch's default), and a NaN reward (unscorable) is left out of its group's statistics and gets advantage 0."""
    r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
    a = r - jnp.nanmean(r, axis=1, keepdims=True)
    if scale_by_std:
        count = jnp.sum(~jnp.isnan(r), axis=1, keepdims=True)
        # A group with one scored reward has no std: NaN, hence advantage 0 (TRL's nanstd).
        var = jnp.nanmean(a * a, axis=1, keepdims=True) * jnp.where(count > 1, count / (count - 1), jnp.nan)
        a = a / (jnp.sqrt(var) + eps)
    return jnp.nan_to_num(a, nan=0.0).reshape(-1)


def dynamic_sampling_keep(rewards, group_size: int):
    """DAPO's dynamic sampling: [N / G] bools, False for a group whose rewards are all equal (its advantages are
    all 0, so it adds no gradient, only dilutes the batch). TRL has no such filter; it only logs the share of
    groups with zero std."""
    r = jnp.asarray(rewards).reshape(-1, group_size)
    return jnp.max(r, axis=1) != jnp.min(r, axis=1)


def overlong_penalty(lengths, max_len: int, cache_len: int):
    """DAPO's soft overlong punishment (eq. 13; TRL's `get_soft_overlong_punishment`), a reward added to the
    task's: 0 up to max_len - cache_len tokens, then falling linearly, (max_len - cache_len - len) / cache_len,
    to -1 at max_len, and -1 beyond."""
    length = jnp.asarray(lengths, jnp.float32)
    start = max_len - cache_len
    ramp = (start - length) / max(cache_len, 1)  # cache_len = 0: no ramp, the middle case is empty
    return jnp.where(length <= start, 0.0, jnp.where(length <= max_len, ramp, -1.0))


# ===== The policy loss ===============================================================================================

def sampler_weights(old_logp, sampler_logp, mask, mode: str = "token_truncate", clip_min: float | None = None,
                    clip_max: float | None = 3.0):
    """Importance weights pi_old(trainer) / pi_sampler, for rollouts sampled by other numerics (a vLLM engine in
    TRL; here the decode kernels), as TRL 1.16's `vllm_importance_sampling_mode`: per token ([N, T]) or per
    sequence ([N, 1], the product of the token ratios: a sum of log-ratios, not a mean); `*_truncate` clamps
    to [clip_min, clip_max] (TIS), `*_mask` zeroes weights outside it. Not differentiated. A NaN sampler log-prob
    (unscored token) gives ratio 1."""
    diff = jnp.nan_to_num(jnp.where(mask > 0, old_logp - sampler_logp, 0.0), nan=0.0)
    if mode.startswith("sequence"):
        diff = jnp.sum(diff, axis=-1, keepdims=True)
    ratio = jnp.exp(diff)
    low = 0.0 if clip_min is None else clip_min  # a ratio is never below 0: 0 = no lower bound
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = jnp.clip(ratio, low, high)
    elif mode.endswith("mask"):
        ratio = jnp.where((ratio < low) | (ratio > high), 0.0, ratio)
    else:
        raise ValueError(f"unknown sampler correction mode {mode!r}")
    return jax.lax.stop_gradient(ratio)


def policy_terms(logp, old_logp, mask, advantages, *, ref_logp=None, sampler_weights=None, epsilon_low=0.2,
                 epsilon_high=0.2, delta=None, beta=0.0, kl_bias_correction=True, importance_level="token",
                 loss_type="dapo", max_completion_length=None):
    """(loss sum, count, metrics): the loss is sum / count, TRL's. logp, old_logp, ref_logp [N, T]: the
    completion tokens' log-probs under the policy, the sampling policy (None: logp itself, undifferentiated, as
    TRL when on-policy) and the reference; mask [N, T], 1 on completion tokens; advantages [N];
    sampler_weights [N, T] or [N, 1] (`sampler_weights()`) multiply the clipped term, not the KL.
    The count: sequences (grpo), completion tokens (bnpo, dapo), N * max_completion_length (dr_grpo; default T).
    Summing both over micro-batches normalises over the whole batch, as TRL's dapo does over its accumulation
    window (TRL's bnpo normalises each micro-batch; in one batch the two agree). Metrics (not differentiated),
    TRL's: the shares of clipped ratios, low (w < 1 - eps_low, A < 0), high (w > 1 + eps_high, A > 0) and either
    (means over completion tokens, or over sequences at sequence level), the smallest sequence's low share and
    the largest's high share, and the mean KL term when beta > 0."""
    mask = jnp.asarray(mask, jnp.float32)
    old_logp = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    adv = jnp.asarray(advantages, jnp.float32)[:, None]
    tokens = jnp.sum(mask, axis=-1, keepdims=True)
    log_ratio = jnp.where(mask > 0, logp - old_logp, 0.0)  # where: a padding token's NaN stays out
    if importance_level == "token":
        log_w = log_ratio
    elif importance_level == "sequence":  # GSPO: the geometric mean of the sequence's token ratios, [N, 1]
        log_w = jnp.sum(log_ratio, axis=-1, keepdims=True) / jnp.maximum(tokens, 1.0)
    else:
        raise ValueError(f"unknown importance level {importance_level!r}")
    w = jnp.exp(log_w)

    if beta:
        delta_ref = jnp.where(mask > 0, ref_logp - logp, 0.0)
        kl = jnp.exp(delta_ref) - delta_ref - 1  # k3: unbiased, non-negative estimate of KL(pi || ref)
        if kl_bias_correction:  # DeepSeek-V3.2, TRL's default: weighted by the (differentiable) ratio, so that
            kl = kl * w         # off-policy samples estimate the reverse KL's gradient without bias
    clipped = jnp.clip(w, 1 - epsilon_low, 1 + epsilon_high)
    if delta:  # INTELLECT-2's two-sided clipping: the unclipped term is capped too (after the KL used w)
        w = jnp.minimum(w, delta)
    per_token = -jnp.minimum(w * adv, clipped * adv)
    if sampler_weights is not None:
        per_token = per_token * sampler_weights
    if beta:
        per_token = per_token + beta * kl
    per_token = jnp.broadcast_to(per_token, mask.shape)

    n, t = mask.shape
    masked = jnp.where(mask > 0, per_token, 0.0)
    if loss_type == "grpo":
        loss_sum, count = jnp.sum(jnp.sum(masked, -1) / jnp.maximum(tokens[:, 0], 1.0)), jnp.float32(n)
    elif loss_type in ("bnpo", "dapo"):
        loss_sum, count = jnp.sum(masked), jnp.maximum(jnp.sum(mask), 1.0)
    elif loss_type == "dr_grpo":
        loss_sum, count = jnp.sum(masked), jnp.float32(n * (max_completion_length or t))
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")

    low = ((w < 1 - epsilon_low) & (adv < 0)).astype(jnp.float32)
    high = ((w > 1 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    region = jnp.maximum(low, high)
    if importance_level == "sequence":  # one value per sequence: means over sequences
        mean, per_seq = (lambda x: jnp.mean(x)), (lambda x: x[:, 0])
    else:
        mean = lambda x: jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)  # noqa: E731
        per_seq = lambda x: jnp.sum(x * mask, -1) / tokens[:, 0]  # noqa: E731 (NaN for an empty one, left out)
    metrics = {"grpo/clip_low": mean(low), "grpo/clip_high": mean(high), "grpo/clip_region": mean(region),
               "grpo/clip_low_min": jnp.nanmin(per_seq(low)), "grpo/clip_high_max": jnp.nanmax(per_seq(high))}
    if beta:
        metrics["grpo/kl"] = jnp.sum(jnp.where(mask > 0, kl, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss_sum, count, jax.tree.map(jax.lax.stop_gradient, metrics)


def count(mask, loss_type: str, max_completion_length: int):
    """What `policy_terms`' sum is divided by, for a batch's completion mask [N, T]: the rows that have completion
    tokens (grpo), those tokens (bnpo, dapo), or those rows times max_completion_length (dr_grpo)."""
    rows = jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32))
    if loss_type == "grpo":
        return rows
    if loss_type == "dr_grpo":
        return rows * max_completion_length
    return jnp.sum(mask.astype(jnp.float32))


def policy_loss(logp, old_logp, mask, advantages, **options):
    """(scalar loss, metrics) of one batch: `policy_terms`' sum / count."""
    loss_sum, count, metrics = policy_terms(logp, old_logp, mask, advantages, **options)
    return loss_sum / count, metrics
