"""Direct preference optimisation (Rafailov et al. 2023): the loss of a batch of packed preference pairs.

A row holds whole pairs, pair j as segments 2j+1 (the prompt with the chosen response) and 2j+2 (with the
rejected one); the loss weights mark the response tokens. A sequence's log-probability is the sum of its
weighted token log-probs, and a pair's loss is -log sigmoid(beta * margin) with
margin = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), label-smoothed as in cDPO (MaxText, TRL's
earlier `sigmoid`): -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m). The reference is the starting model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError

# The config's `dpo` group (train.objective="dpo"): beta scales the log-ratio margin; label_smoothing is the
# assumed share of flipped preference labels (0 = plain DPO).
CONFIG = dict(beta=0.1, label_smoothing=0.0)


def check_config(d) -> None:
    beta, smoothing = d.beta, d.label_smoothing
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ConfigError("dpo.beta", f"must be a positive number, got {beta!r}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing < 0.5:
        raise ConfigError("dpo.label_smoothing", f"must be a number in [0, 0.5), got {smoothing!r}")


def pair_sums(values, segment_ids):
    """values [B, T] (weighted token log-probs) -> (chosen, rejected, is_pair), each [B, T // 2]: entry j sums
    segment 2j+1's values and 2j+2's, and is_pair says whether the row holds pair j."""
    t = segment_ids.shape[1]
    p = t // 2
    per_segment = jax.vmap(lambda v, s: jax.ops.segment_sum(v, s, num_segments=t + 1))
    sums = per_segment(values, segment_ids)
    present = per_segment(jnp.ones_like(values), segment_ids) > 0
    return sums[:, 1:2 * p:2], sums[:, 2:2 * p + 1:2], present[:, 2:2 * p + 1:2]


def count_pairs(segment_ids):
    """Pairs in a batch: a row's last segment id is twice its pair count."""
    return jnp.sum(jnp.max(segment_ids, axis=1) // 2).astype(jnp.float32)


def losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
    """Per-pair losses and the rewards beta * (log pi - log ref) of the chosen and the rejected responses."""
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    loss = -(1 - label_smoothing) * jax.nn.log_sigmoid(margin) - label_smoothing * jax.nn.log_sigmoid(-margin)
    return loss, chosen_reward, rejected_reward


def batch_terms(policy_values, ref_values, segment_ids, beta: float, label_smoothing: float):
    """(summed loss, summed metrics) over a batch's pairs, from both models' weighted token log-probs [B, T].
    Metrics: the reward margin, preference accuracy (chosen reward above rejected), the chosen and rejected
    responses' log-probs under the policy, and their rewards."""
    pc, pr, is_pair = pair_sums(policy_values, segment_ids)
    rc, rr, _ = pair_sums(ref_values, segment_ids)
    loss, chosen, rejected = losses(pc, pr, rc, rr, beta, label_smoothing)
    mask = is_pair.astype(jnp.float32)
    total = lambda x: jnp.sum(jnp.where(is_pair, x, 0.0))  # noqa: E731 (where: a padded pair's NaN stays out)
    metrics = {"dpo/margin": total(chosen - rejected), "dpo/accuracy": jnp.sum((chosen > rejected) * mask),
               "dpo/logp_chosen": total(pc), "dpo/logp_rejected": total(pr),
               "dpo/reward_chosen": total(chosen), "dpo/reward_rejected": total(rejected)}
    return total(loss), jax.tree.map(jax.lax.stop_gradient, metrics)
