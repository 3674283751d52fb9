"""GRPO's loss math: advantages equal numpy's (and TRL's std); the policy loss, its metrics and its gradient
equal TRL 1.16's own GRPOTrainer._compute_loss, called unbound on given log-probs, for GRPO, Dr. GRPO, DAPO,
GSPO, the KL term and sampler importance weights; DAPO's helpers equal numpy's and TRL's overlong reward."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.errors import ConfigError
from jaxtrain.models import grpo


def _numpy_advantages(rewards, g, scale, eps=1e-4):
    r = rewards.reshape(-1, g)
    a = r - r.mean(1, keepdims=True)
    if scale:
        a = a / (r.std(1, ddof=1, keepdims=True) + eps)
    return a.reshape(-1)


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_equal_numpy(scale):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24).astype(np.float32)
    rewards[8:12] = 1.0  # a group of equal rewards: advantage 0, not NaN
    got = np.asarray(grpo.advantages(rewards, 4, scale))
    np.testing.assert_allclose(got, _numpy_advantages(rewards.astype(np.float64), 4, scale), rtol=1e-5, atol=1e-5)
    assert np.all(got[8:12] == 0)
    if scale:  # Bessel's std (TRL's, torch's default), not numpy's default
        assert not np.allclose(got, _numpy_advantages(rewards, 4, False) / (rewards.reshape(-1, 4).std(1).repeat(4)
                                                                             + 1e-4), atol=1e-3)


def test_advantages_with_unscored_rewards_equal_trl():
    """TRL leaves a NaN reward out of its group's mean and std (nanstd, Bessel) and sets its advantage to 0."""
    torch = pytest.importorskip("torch")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    rewards = np.random.default_rng(1).normal(size=12).astype(np.float32)
    rewards[[1, 5, 6, 7, 10]] = np.nan  # group 1 keeps one scored reward: no std, all its advantages 0
    r = torch.tensor(rewards).view(-1, 4)
    expected = (r - torch.nanmean(r, 1, keepdim=True)) / (trl_utils.nanstd(r, dim=1).unsqueeze(1) + 1e-4)
    expected = torch.nan_to_num(expected, nan=0.0).view(-1).numpy()
    got = np.asarray(grpo.advantages(rewards, 4, True))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.all(got[[1, 4, 5, 6, 7, 10]] == 0) and np.all(got[[0, 2, 3, 8, 9, 11]] != 0)


N, T = 8, 6


@pytest.fixture(scope="module")
def batch():
    """Log-probs with the policy moved from the sampling policy far enough that some ratios clip, a reference,
    sampler log-probs, ragged completions (one empty), and group advantages."""
    rng = np.random.default_rng(0)
    old = -np.abs(rng.normal(1.0, 1.0, (N, T)))
    logp = old + rng.normal(0, 0.3, (N, T))
    ref = logp + rng.normal(0, 0.2, (N, T))
    sampler = old + rng.normal(0, 0.5, (N, T))
    lengths = np.array([6, 3, 1, 5, 0, 6, 4, 2])
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    adv = np.asarray(grpo.advantages(rng.normal(size=N), 4, True))
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return dict(logp=f32(logp), old=f32(old), ref=f32(ref), sampler=f32(sampler), mask=mask, adv=f32(adv))


def _trl(b, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, level="token", delta=None,
         bias_correction=True, is_ratio=None, max_completion_length=T):
    """TRL 1.16's GRPOTrainer._compute_loss, unbound on a stand-in trainer: the model's per-token log-probs are
    the given ones. One process, no accumulation. -> (loss, d loss / d logp, metrics)."""
    torch = pytest.importorskip("torch")
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    logp = torch.tensor(b["logp"], requires_grad=True)
    mask = torch.tensor(b["mask"]).long()
    inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long), "prompt_mask": torch.ones(N, 2, dtype=torch.long),
              "completion_ids": torch.zeros(N, T, dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor(b["adv"]), "old_per_token_logps": torch.tensor(b["old"]),
              "ref_per_token_logps": torch.tensor(b["ref"]), "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(np.asarray(is_ratio))
    same = lambda x, **kw: x  # noqa: E731
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logp, torch.zeros(N, T), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
        max_completion_length=max_completion_length, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        args=types.SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction, steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, gather=same, gather_for_metrics=same, reduce=same),
        _metrics={"train": collections.defaultdict(list)})
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return float(loss.detach()), logp.grad.numpy(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


SETTINGS = {
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=10),
    "dapo_clip_higher": dict(loss_type="dapo", epsilon_high=0.28),
    "bnpo": dict(loss_type="bnpo", epsilon_low=0.1, epsilon_high=0.3),
    "gspo": dict(loss_type="grpo", level="sequence", epsilon_low=3e-2, epsilon_high=4e-2),
    "gspo_dapo": dict(loss_type="dapo", level="sequence", epsilon_low=3e-2, epsilon_high=4e-2),
    "kl": dict(loss_type="grpo", beta=0.04),
    "kl_no_bias_correction": dict(loss_type="dapo", beta=0.1, bias_correction=False),
    "kl_gspo": dict(loss_type="grpo", level="sequence", beta=0.04, epsilon_low=3e-2, epsilon_high=4e-2),
    "two_sided": dict(loss_type="dapo", delta=1.1, beta=0.02),
}
METRICS = {"clip_low": "clip_ratio/low_mean", "clip_high": "clip_ratio/high_mean",
           "clip_region": "clip_ratio/region_mean", "clip_low_min": "clip_ratio/low_min",
           "clip_high_max": "clip_ratio/high_max", "kl": "kl"}


def _ours(b, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0, level="token", delta=None,
          bias_correction=True, is_ratio=None, max_completion_length=T, scale=1.0):
    def loss(logp):
        return grpo.policy_loss(logp, b["old"], b["mask"], b["adv"], ref_logp=b["ref"], sampler_weights=is_ratio,
                                epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
                                kl_bias_correction=bias_correction, importance_level=level, loss_type=loss_type,
                                max_completion_length=max_completion_length)
    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(b["logp"]))
    return float(value), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


def _assert_equal(ours, theirs, beta):
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    assert np.abs(theirs[1]).max() > 1e-3  # the gradient is not trivially zero
    names = [k for k in METRICS if k != "kl" or beta]
    assert sorted(ours[2]) == sorted(f"grpo/{k}" for k in names)
    for k in names:
        np.testing.assert_allclose(ours[2][f"grpo/{k}"], theirs[2][METRICS[k]], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", SETTINGS)
def test_loss_gradient_and_metrics_equal_trl(batch, name):
    settings = SETTINGS[name]
    theirs = _trl(batch, **settings)
    _assert_equal(_ours(batch, **settings), theirs, settings.get("beta", 0.0))
    metrics = theirs[2]
    if settings.get("delta") is None:  # the batch clips some ratios on both sides: the clipping is exercised
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0, metrics


def test_variants_differ(batch):
    """The aggregations, the clip range and the importance level each change the loss: the comparisons above
    could not pass with one setting's code standing in for another's."""
    values = {name: _ours(batch, **s)[0] for name, s in SETTINGS.items()}
    assert len({round(v, 6) for v in values.values()}) == len(values), values


def _numpy_sampler_weights(old, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), in numpy."""
    diff = np.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    ratio = np.exp(diff.astype(np.float64))
    lo, hi = -np.inf if clip_min is None else clip_min, np.inf if clip_max is None else clip_max
    return np.clip(ratio, lo, hi) if mode.endswith("truncate") else np.where((ratio < lo) | (ratio > hi), 0, ratio)


@pytest.mark.parametrize("mode,clip_min,clip_max", [("token_truncate", None, 1.2), ("token_mask", 0.8, 1.25),
                                                    ("sequence_truncate", 0.5, 2.0), ("sequence_mask", None, 2.0)])
def test_sampler_weights_equal_trl(batch, mode, clip_min, clip_max):
    sampler = batch["sampler"].copy()
    sampler[0, 2] = np.nan  # a token the sampler did not score: ratio 1
    weights = np.asarray(grpo.sampler_weights(batch["old"], sampler, batch["mask"], mode, clip_min, clip_max))
    expected = _numpy_sampler_weights(batch["old"], sampler, batch["mask"], mode, clip_min, clip_max)
    np.testing.assert_allclose(weights, expected, rtol=1e-5)
    assert np.any(weights == (0 if mode.endswith("mask") else clip_max)) and np.any((weights > 0) & (weights != 1))
    settings = dict(loss_type="dapo", epsilon_high=0.28, beta=0.05)
    _assert_equal(_ours(batch, is_ratio=weights, **settings), _trl(batch, is_ratio=weights, **settings), 0.05)


def test_on_policy_defaults_to_the_detached_policy(batch):
    """old_logp None: the ratio is 1 in value; its gradient is the policy gradient -A per token, mean-aggregated."""
    mask = batch["mask"]
    loss = lambda logp: grpo.policy_loss(logp, None, mask, batch["adv"], loss_type="dapo")[0]  # noqa: E731
    value, grad = jax.jit(jax.value_and_grad(loss))(jnp.asarray(batch["logp"]))
    expected = -(batch["adv"][:, None] * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    np.testing.assert_allclose(grad, -batch["adv"][:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-7)


def test_terms_sum_over_micro_batches_to_the_whole_batch(batch):
    """Summing policy_terms' (sum, count) over micro-batches gives the whole batch's loss: TRL's dapo global
    normalisation, and grpo's mean over all sequences."""
    terms = jax.jit(grpo.policy_terms, static_argnames="loss_type")
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        whole = [terms(*(batch[k] for k in ("logp", "old", "mask", "adv")), loss_type=loss_type)[:2]]
        parts = [terms(*(batch[k][s] for k in ("logp", "old", "mask", "adv")), loss_type=loss_type)[:2]
                 for s in (slice(0, 4), slice(4, N))]  # 15 and 12 tokens
        whole = whole[0][0] / whole[0][1]
        np.testing.assert_allclose(sum(p[0] for p in parts) / sum(p[1] for p in parts), whole, rtol=1e-5)


def test_dynamic_sampling_keep_equals_numpy():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.25], np.float32)
    keep = np.asarray(grpo.dynamic_sampling_keep(rewards, 4))
    expected = np.array([len(set(g)) > 1 for g in rewards.reshape(-1, 4)])
    assert keep.tolist() == expected.tolist() == [False, True, False, True]


@pytest.mark.parametrize("max_len,cache", [(100, 20), (16, 4), (10, 0)])
def test_overlong_penalty_equals_trl(max_len, cache):
    lengths = np.arange(0, max_len + 6)
    got = np.asarray(grpo.overlong_penalty(lengths, max_len, cache))
    start = max_len - cache
    expected = np.where(lengths <= start, 0.0, np.where(lengths <= max_len, (start - lengths) / max(cache, 1), -1.0))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert got[start] == 0 and got[max_len + 1] == -1 and (cache == 0 or got[max_len] == -1)
    rewards = pytest.importorskip("trl.rewards")
    trl_values = rewards.get_soft_overlong_punishment(max_len, cache)([[1] * n for n in lengths])
    np.testing.assert_allclose(got, trl_values, rtol=1e-6, atol=1e-7)


def test_config_is_checked():
    grpo.check_config(types.SimpleNamespace(**grpo.CONFIG))
    for field, value in (("group_size", 1), ("loss_type", "ppo"), ("importance_level", "tok"), ("beta", -1.0),
                         ("epsilon_low", 1.0), ("delta", 0.5), ("sampler_correction", "tis"),
                         ("sampler_clip_max", 0.0), ("scale_rewards", "group"), ("overlong_cache", 512),
                         ("reward_eps", 0)):
        d = types.SimpleNamespace(**{**grpo.CONFIG, field: value})
        with pytest.raises(ConfigError, match=f"grpo.{field}"):
            grpo.check_config(d)
