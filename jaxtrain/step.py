"""Pure train and eval steps, and the objectives they minimise.

State is a plain dict {"step", "params", "opt_state"} of arrays (plus "reference", DPO's frozen starting
weights: the adapters only under LoRA); the model graph is rebuilt from its static `graphdef` only while
tracing, so the jitted step is a plain function of arrays. An `Objective` is a loss over a batch: the language
model's cross-entropy (pretraining, and SFT through chat data's loss weights) or DPO over preference pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.models import dpo as dpo_lib
from jaxtrain.models import lora as lora_lib
from jaxtrain.models import cross_entropy
from jaxtrain.models.cross_entropy import linear_cross_entropy
from jaxtrain.models.layers import sum_in


def next_token_targets(batch):
    """Targets are the next token; a position counts only if the next token is in the same document, and, with
    chat data's "loss_weights", by the weight of the token it predicts (1 on assistant tokens, 0 elsewhere)."""
    def shifted(x):
        return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)

    tokens, seg = batch["tokens"], batch["segment_ids"]
    targets = shifted(tokens)
    weights = ((seg != 0) & (shifted(seg) == seg)).astype(jnp.float32)
    if "loss_weights" in batch:
        weights = weights * shifted(batch["loss_weights"]).astype(jnp.float32)
    return targets, weights


def _inputs(batch):
    """The model's inputs in `batch`; its "dropout_keys" are there in training steps only (`dropout_keys`)."""
    return batch["tokens"], batch["positions"], batch["segment_ids"], batch.get("dropout_keys")


def dropout_keys(seed: int, step, rows: int):
    """LoRA dropout's per-row keys (uint32 key data [rows, ...]) for `step`: a function of (seed, step, row) alone,
    so a resumed run draws the masks it would have drawn."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x10BA), step)
    return jax.vmap(lambda row: jax.random.key_data(jax.random.fold_in(key, row)))(jnp.arange(rows))


def loss_terms(graphdef, params, batch):
    """(summed token cross-entropy (f32), number of scored tokens, the model's aux scalars (MoE))."""
    model = nnx.merge(graphdef, params)
    targets, weights = next_token_targets(batch)
    # The head fused with the loss, chunk by chunk: no [B, T, vocab] logits. Not with a final soft-cap (Gemma 2),
    # which the fused kernel does not apply.
    if model.cfg.loss_chunk_tokens and not model.cfg.final_softcap:
        x, aux = model.hidden(*_inputs(batch))
        ce_sum = linear_cross_entropy(x, model.head(), targets, weights, model.cfg.loss_chunk_tokens, x.dtype,
                                      model.cfg.grad_reduce_dtype)
        return ce_sum, jnp.sum(weights), aux
    logits, aux = model.forward(*_inputs(batch))
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * weights), jnp.sum(weights), aux


def token_log_probs(graphdef, params, batch):
    """(each scored token's log-probability times its weight, f32 [B, T]; the model's aux scalars)."""
    model = nnx.merge(graphdef, params)
    targets, weights = next_token_targets(batch)
    if model.cfg.loss_chunk_tokens and not model.cfg.final_softcap:
        x, aux = model.hidden(*_inputs(batch))
        log_probs = cross_entropy.token_log_probs(x, model.head(), targets, model.cfg.loss_chunk_tokens, x.dtype)
    else:
        logits, aux = model.forward(*_inputs(batch))
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1)[..., 0]
    return log_probs * weights, aux


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a step minimises. terms(graphdef, params, batch) -> (summed loss, summed metrics, the model's aux
    scalars); the step divides both sums by count(batch) over the whole batch (scored tokens, or pairs), so that
    gradient accumulation equals one big step. `reference`: the batch also needs "reference_log_probs", the
    frozen reference model's token_log_probs."""
    terms: Callable
    count: Callable
    reference: bool = False


def _lm_terms(graphdef, params, batch):
    ce_sum, _, aux = loss_terms(graphdef, params, batch)
    return ce_sum, {}, aux


LANGUAGE_MODEL = Objective(_lm_terms, lambda batch: next_token_targets(batch)[1].sum())


def dpo(beta: float, label_smoothing: float = 0.0) -> Objective:
    def terms(graphdef, params, batch):
        policy, aux = token_log_probs(graphdef, params, batch)
        loss, metrics = dpo_lib.batch_terms(policy, batch["reference_log_probs"], batch["segment_ids"], beta,
                                            label_smoothing)
        return loss, metrics, aux

    return Objective(terms, lambda batch: dpo_lib.count_pairs(batch["segment_ids"]), reference=True)


def objective(config) -> Objective:
    """The run's objective: train.objective, with the `dpo` group's settings."""
    if config.train.objective == "dpo":
        return dpo(config.dpo.beta, config.dpo.label_smoothing)
    return LANGUAGE_MODEL


def with_reference(graphdef, reference_params, batch, microbatches: int = 1):
    """`batch` plus "reference_log_probs" under `reference_params`, a microbatch at a time (the reference runs
    forward only, and its memory peak is a microbatch's, as the policy's is). No gradient flows into it."""
    reference_params = jax.lax.stop_gradient(reference_params)
    fn = lambda mb: token_log_probs(graphdef, reference_params, mb)[0]  # noqa: E731
    if microbatches == 1:
        values = fn(batch)
    else:
        values = jax.lax.map(fn, jax.tree.map(lambda x: mesh_lib.split_microbatches(x, microbatches), batch))
        values = jnp.swapaxes(values, 0, 1).reshape(-1, values.shape[-1])  # split_microbatches' inverse
    return {**batch, "reference_log_probs": jax.lax.stop_gradient(values)}


def reference_params(state: dict, lora: bool):
    """DPO's reference model, the run's starting weights: the state's frozen copy of them, which under LoRA holds
    the starting adapters only, over the frozen base. Fresh adapters have B = 0, so that reference is the base
    with the adapters off, exactly, and the weights are not held twice."""
    if lora:
        return lora_lib.join(state["reference"], lora_lib.split(state["params"])[1])
    return state["reference"]


# The train state's item holding error feedback's per-replica rounding errors (optim.grad_reduce_error_feedback):
# zeros after a restore that has none of this shape (checkpoint.Checkpointer's `resettable`).
RESIDUAL = "grad_residual"


def accumulates_per_replica(model_cfg, microbatches: int) -> bool:
    """Whether gradient accumulation runs on per-replica weight copies (when there are replica axes). Not for a
    mixture of experts: its load-balancing loss is a product of batch-wide means, which per-replica parts change."""
    return microbatches > 1 and not model_cfg.n_experts


def _accumulation_grad_fn(objective, cfg, params, mesh, rules, microbatches, error_feedback: bool = False):
    """(params to differentiate, value_and_grad of `objective` at them, (gradients, residual) -> (the params'
    gradients, the new residual)) for gradient accumulation. With pure data-parallel replicas
    (mesh.replica_axes) the params are one copy per replica and each replica's rows run on its copy
    (mesh.per_replica), so the accumulated gradients stay local and cross `data` once a step rather than after
    every microbatch (DDP's no_sync); see accumulates_per_replica. Error feedback needs those per-replica
    gradients, with or without accumulation (`sum_with_feedback`)."""
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    axes = mesh_lib.replica_axes(mesh.shape, rules)
    if not axes or not (error_feedback or accumulates_per_replica(cfg, microbatches)):
        return params, grad_fn, lambda grads, residual: (grads, residual)

    per_replica = mesh_lib.over_replicas(objective, axes)

    def summed_objective(copies, mb):
        value, (loss, aux) = per_replica(copies, mb)
        return value.sum(), (loss.sum(), jax.tree.map(jnp.sum, aux))

    def summed(grads, residual):  # the sum over the replicas is their reduction
        if error_feedback:
            return sum_with_feedback(grads, residual, cfg.grad_reduce_dtype)
        return jax.tree.map(lambda g: sum_in(g, 0, cfg.grad_reduce_dtype), grads), residual

    copies = jax.tree.map(lambda w: mesh_lib.per_replica(w, axes), params)
    return copies, jax.value_and_grad(summed_objective, has_aux=True), summed


def sum_with_feedback(grads, residual, dtype):
    """(each gradient summed over its replica dim 0 in `dtype`, the new residual): each replica sends its gradient
    plus the error it kept from the last step, rounded to `dtype`, and keeps what that rounding lost (error
    feedback, as in 1-bit SGD and EF-SGD). The sums over a run then add up to the f32 gradients' less the last
    residual, instead of each step's rounding piling up. `residual`: f32 leaves shaped like the gradients."""
    def one(g, e):
        corrected = g.astype(jnp.float32) + e
        sent = corrected.astype(dtype)
        return sum_in(sent, 0, dtype).astype(g.dtype), corrected - sent.astype(jnp.float32)

    leaves, tree = jax.tree.flatten(grads)
    pairs = [one(g, e) for g, e in zip(leaves, tree.flatten_up_to(residual))]
    return tree.unflatten([p[0] for p in pairs]), tree.unflatten([p[1] for p in pairs])


def make_train_step(graphdef, optimizer: optax.GradientTransformation, lr_schedule: Callable,
                    microbatches: int, mesh, rules, aux_weight: float = 0.0, param_shardings=None,
                    offload: bool = False, lora: bool = False, objective: Objective = LANGUAGE_MODEL,
                    dropout_seed: int | None = None) -> Callable:
    """`aux_weight`: the weight of the model's load-balancing loss (ModelConfig.moe_aux_weight) in the gradient.
    `param_shardings`: the params' shardings, which their gradients are given as soon as they exist. Left to
    XLA, a vocabulary table's gradient (a scatter-add, or the fused loss's sum over the batch shards) was
    all-reduced whole over every batch axis and the norm taken of the whole; in its parameter's layout it is
    reduced where it is split (reduce-scatter over fsdp) and all-reduced over the replicas only in slices.
    `offload` (optim.offload): the optimizer state lives in pinned host memory; it is copied to the device for the
    update and the new state back, so between steps the device holds none of it. `lora` (model.lora_rank > 0):
    only the adapters are differentiated, clipped and updated (models.lora.split); the base weights stay as
    they are, bit for bit. `objective`: what is minimised (default: the language model's cross-entropy).
    `dropout_seed`: LoRA's dropout is on (model.lora_dropout), drawn from this seed and the step.
    A state with a RESIDUAL item (optim.grad_reduce_error_feedback) has the sum over the data-parallel replicas
    carry each replica's rounding error over to the next step in it."""
    def train_step(state, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            # Normalise by the whole batch's count so that accumulation equals one big step.
            total = jnp.maximum(objective.count(batch), 1.0)
            if objective.reference:
                batch = with_reference(graphdef, reference_params(state, lora), batch, microbatches)
            if dropout_seed is not None:  # after the reference, which runs without dropout
                batch = {**batch, "dropout_keys": dropout_keys(dropout_seed, state["step"], batch["tokens"].shape[0])}

            # What is differentiated and updated: every parameter, or the LoRA adapters over frozen base weights.
            if lora:
                trained, frozen = lora_lib.split(state["params"])
                whole = lambda t: lora_lib.join(t, frozen)  # noqa: E731
                trained_shardings = lora_lib.split(param_shardings)[0] if param_shardings is not None else None
            else:
                trained, whole, trained_shardings = state["params"], (lambda t: t), param_shardings

            def minimised(trained, mb):
                loss_sum, sums, aux = objective.terms(graphdef, whole(trained), mb)
                loss = loss_sum / total
                aux = {f"moe/{k}": v / microbatches for k, v in aux.items()}  # means over the microbatches
                balance = aux.get("moe/load_balance_loss", 0.0)
                return loss + aux_weight * balance, (loss, {**aux, **{k: v / total for k, v in sums.items()}})

            grad_fn = jax.value_and_grad(minimised, has_aux=True)
            residual = new_residual = state.get(RESIDUAL)
            error_feedback = residual is not None
            if microbatches == 1 and not error_feedback:
                (_, (loss, aux)), grads = grad_fn(trained, batch)
            else:
                cfg = nnx.merge(graphdef, state["params"]).cfg
                params, grad_fn, summed = _accumulation_grad_fn(minimised, cfg, trained, mesh, rules, microbatches,
                                                                error_feedback)

                def accumulate(carry, mb):
                    (_, (loss, aux)), grads = grad_fn(params, mb)
                    return jax.tree.map(jnp.add, carry, (loss, aux, grads)), None

                micro = jax.tree.map(lambda x: mesh_lib.split_microbatches(x, microbatches), batch)
                first = jax.tree.map(lambda x: x[0], micro)
                (_, (loss, aux)), grads = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, first))
                (loss, aux, grads), _ = jax.lax.scan(accumulate, (loss, aux, grads), micro)
                grads, new_residual = summed(grads, residual)

            if trained_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, trained_shardings)
            grad_norm = optax.tree.norm(grads)

            opt_state = state["opt_state"]
            if offload:  # as memory spaces, not shardings: a described GPU (plan --compiler gpu) has no memory kinds
                # The barrier holds the copy in until the gradients exist: XLA:GPU started it with the step, so the
                # whole state sat on the device through the backward's activation peak (an H100 peaked as high).
                grad_norm, opt_state = jax.lax.optimization_barrier((grad_norm, opt_state))
                opt_state = jax.device_put(opt_state, jax.memory.Space.Device)

            def update(_):
                updates, new_opt_state = optimizer.update(grads, opt_state, trained, global_norm=grad_norm)
                return optax.apply_updates(trained, updates), new_opt_state, new_residual

            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            trained, opt_state, residual = unless_non_finite(finite, update, (trained, opt_state, residual),
                                                             mesh_lib.compile_platform())
            params = whole(trained)
            if offload:
                opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
            new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
            if error_feedback:
                new_state[RESIDUAL] = residual
            # "loss" is the objective alone (comparable with eval_loss); the MoE terms are reported apart.
            metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state["step"]),
                       "finite": finite, "tokens": total, **aux}
            return new_state, metrics

    return train_step


def unless_non_finite(finite, update: Callable, old, platform: str):
    """update(None) where `finite`, else `old`, for a step compiled for `platform`: a non-finite loss or gradient
    never reaches the weights. On CPU a cond: a select per array re-read and re-wrote every weight and moment
    there (50% more optimizer time). Elsewhere a select, which fuses into the optimizer's own pass over the
    state: XLA:GPU copied the whole state (params and both moments) into and out of the cond's branches, 44 GiB
    a step for configs/bench_gpu.py (`jaxtrain plan --compiler gpu`; ~14 ms on an H100), and it reads a cond's
    predicate on the host."""
    if platform == "cpu":
        return jax.lax.cond(finite, update, lambda _: old, None)
    return jax.tree.map(lambda new, kept: jnp.where(finite, new, kept), update(None), old)


def make_eval_step(graphdef, mesh, rules, objective: Objective = LANGUAGE_MODEL, lora: bool = False) -> Callable:
    """eval_step(params, the state's "reference" or None, batch) -> (summed loss, count, summed metrics)."""
    def eval_step(params, reference, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            if objective.reference:
                batch = with_reference(graphdef, reference_params({"params": params, "reference": reference}, lora),
                                       batch)
            loss_sum, sums, _ = objective.terms(graphdef, params, batch)
            return loss_sum, objective.count(batch), sums

    return eval_step
