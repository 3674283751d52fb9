"""Training objectives: what a step minimises, and what each objective needs from the rest of the run.

An `Objective` declares its name (`train.objective`), its config group (named after it), the data it trains on,
its extra state, its memory beyond the model's, and its metrics. `register` adds one and `get` finds it: config
validation, the data checks, the step, the fit check, the planner and the logs read these declarations, and
none of them compares an objective's name. Built in: "lm" (next-token cross-entropy: pretraining, and SFT
through chat data's loss weights) and "dpo" (preference pairs against the frozen starting model).
A new objective is one `register` call with a loss function; tests/test_objectives.py adds one from a test file.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain import rewards as rewards_lib
from jaxtrain.errors import ConfigError
from jaxtrain.models import cross_entropy
from jaxtrain.models import dpo as dpo_lib
from jaxtrain.models import grpo as grpo_lib
from jaxtrain.models.cross_entropy import linear_cross_entropy
from jaxtrain.models.layers import ahead

# The multi-token prediction modules' loss (model.mtp_layers): a summed metric of the lm objective, which the step
# also minimises, weighted by model.mtp_loss_weight; "loss" stays the next-token cross-entropy alone.
MTP_LOSS = "mtp/loss"

# What a prepared data dir holds (its manifest says which): token streams of documents (chat data adds loss
# weights), preference pairs (`prepare --preference`), or prompts to sample from (`prepare --prompts`).
DATA_KINDS = ("documents", "pairs", "prompts")


@dataclasses.dataclass(frozen=True)
class Loss:
    """What a step minimises, for one config. terms(graphdef, params, batch) -> (summed loss, summed metrics,
    the model's aux scalars); the step divides both sums by count(batch) over the whole batch (scored tokens, or
    pairs), so that gradient accumulation equals one big step."""
    terms: Callable
    count: Callable


@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric an objective adds to the step's: `label` (with `scale`, e.g. 100 for a percent) names its plot in
    `jaxtrain report`; `progress` (a format of the scaled value, e.g. "pref acc {:.1f}%") puts it on the
    progress line."""
    label: str
    scale: float = 1.0
    progress: str = ""


@dataclasses.dataclass(frozen=True)
class Objective:
    """`loss(group)`: the Loss for the objective's config group (`cfg.<name>`, or None without one).
    `config`: that group's defaults ({}: no group); `check_config(group)` raises ConfigError naming a bad field.
    `data`: the kind of data dir it trains on (DATA_KINDS); `batch_keys`: what its batches need beyond tokens,
    positions and segment ids (int32, unless `float_keys` names them). `reference`: its extra state, the frozen
    starting trained weights (the state's "reference"; under LoRA the starting adapters only), whose log-probs the
    step adds to each batch; True, or a function of its config group (`uses_reference`).
    `extra_bytes_per_param`: its memory per matmul parameter beyond the model's and the optimizer's, when every
    parameter trains (the fit check, `jaxtrain.memory`). `metrics`: what its loss reports besides the loss."""
    name: str
    loss: Callable[..., Loss]
    config: dict = dataclasses.field(default_factory=dict)
    check_config: Callable | None = None
    data: str = "documents"
    batch_keys: tuple[str, ...] = ()
    float_keys: tuple[str, ...] = ()
    reference: bool | Callable = False
    extra_bytes_per_param: int = 0
    metrics: dict[str, Metric] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Makes `objective` available as train.objective=<its name> (and its config group in the schema)."""
    if objective.data not in DATA_KINDS:
        raise ValueError(f"objective {objective.name!r}: data must be one of {DATA_KINDS}, got {objective.data!r}")
    _REGISTRY[objective.name] = objective
    return objective


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def registered() -> tuple[Objective, ...]:
    return tuple(_REGISTRY.values())


def get(name: str) -> Objective:
    """The objective named `name`; ConfigError naming train.objective if there is none."""
    if name not in _REGISTRY:
        raise ConfigError("train.objective", f"{name!r} is not one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def by_data() -> dict[str, list[str]]:
    """Each kind of data (DATA_KINDS) -> the names of the objectives that train on it."""
    kinds: dict[str, list[str]] = {}
    for objective in registered():
        kinds.setdefault(objective.data, []).append(objective.name)
    return kinds


def uses_reference(config) -> bool:
    """Whether train.objective's state keeps the frozen reference model, for this config."""
    objective = get(config.train.objective)
    if callable(objective.reference):
        return bool(objective.reference(config[objective.name]))
    return objective.reference


def loss_of(config) -> Loss:
    """The run's Loss: train.objective's, from its config group."""
    objective = get(config.train.objective)
    return objective.loss(config[objective.name] if objective.config else None)


# ===== What objectives share: the model's outputs on a batch ==========================================================

# A batch laid out for ring attention (`zigzag`) carries its next-token targets and their weights, taken before.
TARGETS, TARGET_WEIGHTS = "targets", "target_weights"


def next_token_targets(batch, k: int = 1):
    """Targets are the next token (the k-th next: a prediction module's, k >= 2); a position counts only if that
    token is in the same document, and, with chat data's "loss_weights", by the weight of the token it predicts
    (1 on assistant tokens, 0 elsewhere)."""
    if k == 1 and TARGETS in batch:
        return batch[TARGETS], batch[TARGET_WEIGHTS]
    tokens, seg = batch["tokens"], batch["segment_ids"]
    targets = ahead(tokens, k)
    weights = ((seg != 0) & (ahead(seg, k) == seg)).astype(jnp.float32)
    if "loss_weights" in batch:
        weights = weights * ahead(batch["loss_weights"], k).astype(jnp.float32)
    return targets, weights


def zigzag(batch, perm):
    """`batch` with its sequence in the order `perm` (context.balance_permutation): its next-token targets and
    weights taken first, in the original order, then every [B, T, ...] field permuted alike. Sums over tokens (the
    losses, their counts) do not change; the model masks by segment ids and positions, which travel along."""
    batch = {**batch, **dict(zip((TARGETS, TARGET_WEIGHTS), next_token_targets(batch)))}
    t = len(perm)
    return {k: v[:, perm] if v.ndim >= 2 and v.shape[1] == t else v for k, v in batch.items()}


def model_inputs(batch):
    """The model's inputs in `batch`; its "dropout_keys" are there in training steps only."""
    return batch["tokens"], batch["positions"], batch["segment_ids"], batch.get("dropout_keys")


def _fused_head(model) -> bool:
    # The head fused with the loss, chunk by chunk: no [B, T, vocab] logits. Not with a final soft-cap (Gemma 2),
    # which the fused kernel does not apply.
    return bool(model.cfg.loss_chunk_tokens) and not model.cfg.final_softcap


def logits(graphdef, params, batch):
    """(logits [B, T, vocab] in f32, the model's aux scalars): for a loss that needs the whole distribution."""
    out, aux = nnx.merge(graphdef, params).forward(*model_inputs(batch))
    return out.astype(jnp.float32), aux


def loss_terms(graphdef, params, batch):
    """(summed token cross-entropy (f32), number of scored tokens, the model's aux scalars (MoE)). With
    multi-token prediction (model.mtp_layers) aux also holds MTP_LOSS: the prediction modules' cross-entropy,
    summed over their scored tokens and averaged over the modules."""
    model = nnx.merge(graphdef, params)
    targets, weights = next_token_targets(batch)
    if not model.cfg.mtp_layers:  # hidden_loss: an explicit pipeline schedule runs the loss in its last stage
        rows = {"targets": targets, "weights": weights}
        ce_sum, aux = model.hidden_loss(*model_inputs(batch), _rows_cross_entropy, rows)
        return ce_sum, jnp.sum(weights), aux
    x, aux, predicted = model.hidden_and_mtp(*model_inputs(batch))
    mtp = [_cross_entropy_sum(model, h, *next_token_targets(batch, k + 2)) for k, h in enumerate(predicted)]
    return _cross_entropy_sum(model, x, targets, weights), jnp.sum(weights), {**aux, MTP_LOSS: sum(mtp) / len(mtp)}


def _rows_cross_entropy(model, x, rows):
    return _cross_entropy_sum(model, x, rows["targets"], rows["weights"])


def _cross_entropy_sum(model, x, targets, weights):
    """The head on hidden states `x` and its weighted cross-entropy, summed (f32)."""
    if _fused_head(model):
        return linear_cross_entropy(x, model.head(), targets, weights, model.cfg.loss_chunk_tokens, x.dtype,
                                    model.layout.grad_reduce_dtype)
    ce = optax.softmax_cross_entropy_with_integer_labels(model.logits(x).astype(jnp.float32), targets)
    return jnp.sum(ce * weights)


def token_log_probs(graphdef, params, batch, temperature: float = 1.0):
    """(each scored token's log-probability times its weight, f32 [B, T]; the model's aux scalars). `temperature`:
    of softmax(logits / temperature), the distribution an RL objective's rollouts sampled from."""
    model = nnx.merge(graphdef, params)
    targets, weights = next_token_targets(batch)
    if _fused_head(model):
        x, aux = model.hidden(*model_inputs(batch))
        head = model.head() if temperature == 1.0 else model.head() / temperature
        log_probs = cross_entropy.token_log_probs(x, head, targets, model.cfg.loss_chunk_tokens, x.dtype)
    else:
        out, aux = model.forward(*model_inputs(batch))
        scaled = out.astype(jnp.float32) / temperature
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(scaled), targets[..., None], -1)[..., 0]
    return log_probs * weights, aux


# ===== The built-in objectives =======================================================================================

def _language_model(_) -> Loss:
    def terms(graphdef, params, batch):
        ce_sum, _, aux = loss_terms(graphdef, params, batch)  # looked up at trace time (tests wrap it)
        return ce_sum, {MTP_LOSS: aux.pop(MTP_LOSS)} if MTP_LOSS in aux else {}, aux

    return Loss(terms, lambda batch: next_token_targets(batch)[1].sum())


def dpo_loss(beta: float, label_smoothing: float = 0.0) -> Loss:
    """DPO's pair loss (jaxtrain.models.dpo) over batches that carry "reference_log_probs"."""
    def terms(graphdef, params, batch):
        policy, aux = token_log_probs(graphdef, params, batch)
        loss, metrics = dpo_lib.batch_terms(policy, batch["reference_log_probs"], batch["segment_ids"], beta,
                                            label_smoothing)
        return loss, metrics, aux

    return Loss(terms, lambda batch: dpo_lib.count_pairs(batch["segment_ids"]))


def grpo_loss(group) -> Loss:
    """GRPO's policy loss (jaxtrain.models.grpo) over rollout batches (jaxtrain.rollouts): the completion tokens
    are the loss weights, each row's advantage rides in "advantages" (constant along the row). On-policy (one
    optimizer step per rollout) the ratio's denominator is the policy itself, undifferentiated, as TRL's; over a
    round of several steps it is "old_log_probs", the sampling weights'."""
    on_policy = group.rollout_batches * group.iterations == 1
    options = dict(epsilon_low=group.epsilon_low, epsilon_high=group.epsilon_high, delta=group.delta or None,
                   beta=group.beta, kl_bias_correction=group.kl_bias_correction,
                   importance_level=group.importance_level, loss_type=group.loss_type,
                   max_completion_length=group.max_completion_tokens)

    def terms(graphdef, params, batch):
        log_probs, aux = token_log_probs(graphdef, params, batch, group.temperature)  # as TRL: the sampled policy's
        mask = next_token_targets(batch)[1]
        old = None if on_policy else batch["old_log_probs"]
        # The sampler's numerics (bf16 decode kernels) against the trainer's at the same weights, truncated or
        # masked (grpo.sampler_correction), as TRL corrects vLLM's.
        weights = None if group.sampler_correction == "none" else grpo_lib.sampler_weights(
            batch["old_log_probs"], batch["sampler_log_probs"], mask, group.sampler_correction,
            group.sampler_clip_min or None, group.sampler_clip_max)
        loss_sum, count, metrics = grpo_lib.policy_terms(
            log_probs, old, mask, batch["advantages"][:, 0], ref_logp=batch.get("reference_log_probs"),
            sampler_weights=weights, **options)
        return loss_sum, {k: v * count for k, v in metrics.items()}, aux  # means -> sums (the step divides)

    return Loss(terms, lambda batch: grpo_lib.count(next_token_targets(batch)[1], group.loss_type,
                                                    group.max_completion_tokens))


LANGUAGE_MODEL = register(Objective("lm", _language_model, metrics={
    MTP_LOSS: Metric("multi-token prediction loss", 1.0, "mtp {:.4f}")}))  # only where model.mtp_layers > 0
DPO = register(Objective(
    "dpo", lambda group: dpo_loss(group.beta, group.label_smoothing), config=dpo_lib.CONFIG,
    check_config=dpo_lib.check_config, data="pairs", batch_keys=("loss_weights",), reference=True,
    # Without LoRA the reference is a second copy of the weights, in f32.
    extra_bytes_per_param=4,
    metrics={"dpo/accuracy": Metric("preference accuracy (%)", 100.0, "pref acc {:.1f}%"),
             "dpo/margin": Metric("reward margin", 1.0, "margin {:.3f}")}))
GRPO = register(Objective(
    "grpo", grpo_loss, config={**grpo_lib.CONFIG, **rewards_lib.CONFIG},
    check_config=lambda group: (grpo_lib.check_config(group), rewards_lib.check_group(group)), data="prompts",
    batch_keys=("loss_weights", "advantages", "old_log_probs", "sampler_log_probs"),
    float_keys=("advantages", "old_log_probs", "sampler_log_probs"),
    reference=lambda group: group.beta > 0,  # the KL penalty's; free under LoRA (the base with adapters off)
    extra_bytes_per_param=4,
    metrics={"grpo/reward": Metric("reward (mean)", 1.0, "reward {:.3f}"),
             "grpo/clip_region": Metric("clipped ratios (%)", 100.0),
             "grpo/completion_tokens": Metric("completion length (tokens)", 1.0, "len {:.0f}"),
             "grpo/sampler_tokens_per_sec": Metric("sampler tokens/s", 1.0, "sampler {:,.0f} tok/s"),
             # The generation evals on held-out prompts (eval records; rollouts.RolloutSource.evaluate).
             "eval_reward": Metric("held-out reward (mean)"),
             "eval_accuracy": Metric("held-out accuracy (%)", 100.0)}))
