"""Pure train and eval steps.

State is a plain dict {"step", "params", "opt_state"} of arrays (plus "reference", an objective's frozen starting
weights: the adapters only under LoRA); the model graph is rebuilt from its static `graphdef` only while
tracing, so the jitted step is a plain function of arrays. What a step minimises is an objective's `Loss`
(jaxtrain.objectives).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtrain import objectives
from jaxtrain.models import lora as lora_lib
from jaxtrain.models.layers import sum_in
from jaxtrain.parallel import context
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline


def dropout_keys(seed: int, step, rows: int):
    """LoRA dropout's per-row keys (uint32 key data [rows, ...]) for `step`: a function of (seed, step, row) alone,
    so a resumed run draws the masks it would have drawn."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0x10BA), step)
    return jax.vmap(lambda row: jax.random.key_data(jax.random.fold_in(key, row)))(jnp.arange(rows))


def with_reference(graphdef, reference_params, batch, microbatches: int = 1):
    """`batch` plus "reference_log_probs" under `reference_params`, a microbatch at a time (the reference runs
    forward only, and its memory peak is a microbatch's, as the policy's is). No gradient flows into it."""
    reference_params = jax.lax.stop_gradient(reference_params)
    fn = lambda mb: objectives.token_log_probs(graphdef, reference_params, mb)[0]  # noqa: E731
    if microbatches == 1:
        values = fn(batch)
    else:
        values = jax.lax.map(fn, jax.tree.map(lambda x: mesh_lib.split_microbatches(x, microbatches), batch))
        values = jnp.swapaxes(values, 0, 1).reshape(-1, values.shape[-1])  # split_microbatches' inverse
    return {**batch, "reference_log_probs": jax.lax.stop_gradient(values)}


def context_layout(graphdef, params, batch):
    """`batch` as the model's attention wants it: in ring attention's zigzag layout (USP's: over its ring of
    Ulysses groups) where the sequence splits and model.context_balance is on. Done here, not by the data pipeline,
    because the objectives take their targets by shifting tokens (taken first: objectives.zigzag), and so eval steps
    get it too; the cost is an exchange of the batch's int fields along `sequence`, small beside the K/V that ring
    attention passes. Decoding never sees it."""
    cfg, n = nnx.merge(graphdef, params).cfg, mesh_lib.split_ways("seq")
    if cfg.context_parallel == "usp":  # the ring runs across the Ulysses groups: balanced over them
        n //= context.ulysses_ways(cfg.ulysses_ways, n, cfg.n_heads, cfg.n_kv_heads)
    if cfg.context_parallel not in ("ring", "usp") or not cfg.context_balance or n == 1:
        return batch
    return objectives.zigzag(batch, context.balance_permutation(batch["tokens"].shape[1], n))


def reference_params(state: dict, lora: bool):
    """An objective's reference model (DPO's), the run's starting weights: the state's frozen copy of them,
    which under LoRA holds the starting adapters only, over the frozen base. Fresh adapters have B = 0, so that reference is the base
    with the adapters off, exactly, and the weights are not held twice."""
    if lora:
        return lora_lib.join(state["reference"], lora_lib.split(state["params"])[1])
    return state["reference"]


# The train state's item holding error feedback's per-replica rounding errors (optim.grad_reduce_error_feedback):
# zeros after a restore that has none of this shape (checkpoint.Checkpointer's `resettable`).
RESIDUAL = "grad_residual"


def accumulates_per_replica(model_cfg, microbatches: int, layout=None) -> bool:
    """Whether gradient accumulation runs on per-replica weight copies (when there are replica axes). Not for a
    mixture of experts: its load-balancing loss is a product of batch-wide means, which per-replica parts change.
    Nor under an explicit pipeline schedule, whose executor keeps each replica's gradients itself."""
    explicit = (layout is not None and layout.pipeline_stages > 1
                and layout.pipeline_schedule in pipeline.EXPLICIT)
    return microbatches > 1 and not model_cfg.n_experts and not explicit


def _accumulation_grad_fn(objective, model, params, mesh, rules, microbatches, error_feedback: bool = False):
    """(params to differentiate, value_and_grad of `objective` at them, (gradients, residual) -> (the params'
    gradients, the new residual)) for gradient accumulation. With pure data-parallel replicas
    (mesh.replica_axes) the params are one copy per replica and each replica's rows run on its copy
    (mesh.per_replica), so the accumulated gradients stay local and cross `data` once a step rather than after
    every microbatch (DDP's no_sync); see accumulates_per_replica. Error feedback needs those per-replica
    gradients, with or without accumulation (`sum_with_feedback`)."""
    grad_fn = jax.value_and_grad(objective, has_aux=True)
    axes = mesh_lib.replica_axes(mesh.shape, rules)
    if not axes or not (error_feedback or accumulates_per_replica(model.cfg, microbatches, model.layout)):
        return params, grad_fn, lambda grads, residual: (grads, residual)

    per_replica = mesh_lib.over_replicas(objective, axes)

    def summed_objective(copies, mb):
        value, (loss, aux) = per_replica(copies, mb)
        return value.sum(), (loss.sum(), jax.tree.map(jnp.sum, aux))

    def summed(grads, residual):  # the sum over the replicas is their reduction
        if error_feedback:
            return sum_with_feedback(grads, residual, model.layout.grad_reduce_dtype)
        return jax.tree.map(lambda g: sum_in(g, 0, model.layout.grad_reduce_dtype), grads), residual

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


# The step's per-layer, per-expert assignment counts [layers, experts] (a mixture of experts'), beside its scalars.
EXPERT_LOAD = "expert_load"


def make_train_step(graphdef, optimizer: optax.GradientTransformation, lr_schedule: Callable,
                    microbatches: int, mesh, rules, aux_weight: float = 0.0, param_shardings=None,
                    offload: bool = False, lora: bool = False, loss: objectives.Loss | None = None,
                    reference: bool = False, dropout_seed: int | None = None,
                    rebalance: Callable | None = None, mtp_weight: float = 0.0) -> Callable:
    """`aux_weight`: the weight of the model's load-balancing loss (ModelConfig.moe_aux_weight) in the gradient.
    `param_shardings`: the params' shardings, which their gradients are given as soon as they exist. Left to
    XLA, a vocabulary table's gradient (a scatter-add, or the fused loss's sum over the batch shards) was
    all-reduced whole over every batch axis and the norm taken of the whole; in its parameter's layout it is
    reduced where it is split (reduce-scatter over fsdp) and all-reduced over the replicas only in slices.
    `offload` (optim.offload): the optimizer state lives in pinned host memory; it is copied to the device for the
    update and the new state back, so between steps the device holds none of it. `lora` (model.lora_rank > 0):
    only the adapters are differentiated, clipped and updated (models.lora.split); the base weights stay as
    they are, bit for bit. `loss`: what is minimised (default: the language model's cross-entropy); `reference`:
    its objective keeps the state's "reference" (objectives.Objective.reference), whose log-probs join each batch.
    `dropout_seed`: LoRA's dropout is on (model.lora_dropout), drawn from this seed and the step.
    `mtp_weight` (ModelConfig.mtp_loss_weight): the weight of the multi-token prediction loss
    (objectives.MTP_LOSS, reported apart) in what is minimised.
    `rebalance(params, expert_load, finite) -> params`: a change to the params outside the gradient, from the
    step's per-layer expert loads (the MoE routers' bias balancing: models.transformer.router_balancer).
    A state with a RESIDUAL item (optim.grad_reduce_error_feedback) has the sum over the data-parallel replicas
    carry each replica's rounding error over to the next step in it."""
    loss_fn = loss or objectives.LANGUAGE_MODEL.loss(None)

    def train_step(state, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            batch = context_layout(graphdef, state["params"], batch)
            # Normalise by the whole batch's count so that accumulation equals one big step.
            total = jnp.maximum(loss_fn.count(batch), 1.0)
            if reference:
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
                loss_sum, sums, aux = loss_fn.terms(graphdef, whole(trained), mb)
                loss = loss_sum / total
                aux = {f"moe/{k}": v / microbatches for k, v in aux.items()}  # means over the microbatches
                balance = aux.get("moe/load_balance_loss", 0.0)
                sums = {k: v / total for k, v in sums.items()}
                penalty = aux_weight * balance + mtp_weight * sums.get(objectives.MTP_LOSS, 0.0)
                return loss + penalty, (loss, {**aux, **sums})

            grad_fn = jax.value_and_grad(minimised, has_aux=True)
            residual = new_residual = state.get(RESIDUAL)
            error_feedback = residual is not None
            if microbatches == 1 and not error_feedback:
                (_, (loss, aux)), grads = grad_fn(trained, batch)
            else:
                model = nnx.merge(graphdef, state["params"])
                params, grad_fn, summed = _accumulation_grad_fn(minimised, model, trained, mesh, rules, microbatches,
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
                # whole state sat on the device through the backward's activation peak.
                grad_norm, opt_state = jax.lax.optimization_barrier((grad_norm, opt_state))
                opt_state = jax.device_put(opt_state, jax.memory.Space.Device)

            def update(_):
                updates, new_opt_state = optimizer.update(grads, opt_state, trained, global_norm=grad_norm)
                return optax.apply_updates(trained, updates), new_opt_state, new_residual

            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            trained, opt_state, residual = unless_non_finite(finite, update, (trained, opt_state, residual),
                                                             mesh_lib.compile_platform())
            params = whole(trained)
            # Per-layer, per-expert assignments: for the balancing hook and hooks.ExpertLoadHook, not a scalar.
            expert_load = aux.pop("moe/expert_load", None)
            if rebalance is not None and expert_load is not None:
                params = rebalance(params, expert_load, finite)
            if offload:
                opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
            new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
            if error_feedback:
                new_state[RESIDUAL] = residual
            # "loss" is the objective alone (comparable with eval_loss); the MoE terms are reported apart.
            metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state["step"]),
                       "finite": finite, "tokens": total, **aux}
            if expert_load is not None:
                metrics[EXPERT_LOAD] = expert_load
            return new_state, metrics

    return train_step


def unless_non_finite(finite, update: Callable, old, platform: str):
    """update(None) where `finite`, else `old`, for a step compiled for `platform`: a non-finite loss or gradient
    never reaches the weights. On CPU a cond: a select per array re-reads and re-writes every weight and moment
    there. Elsewhere a select, which fuses into the optimizer's own pass over the state: XLA:GPU copies the whole
    state (params and both moments) into and out of a cond's branches, and reads its predicate on the host
    (docs/performance.md, "CPU: what makes the step fast", the optimizer)."""
    if platform == "cpu":
        return jax.lax.cond(finite, update, lambda _: old, None)
    return jax.tree.map(lambda new, kept: jnp.where(finite, new, kept), update(None), old)


def make_eval_step(graphdef, mesh, rules, loss: objectives.Loss | None = None, lora: bool = False,
                   reference: bool = False) -> Callable:
    """eval_step(params, the state's "reference" or None, batch) -> (summed loss, count, summed metrics)."""
    loss_fn = loss or objectives.LANGUAGE_MODEL.loss(None)

    def eval_step(params, reference_state, batch):
        with mesh_lib.activation_sharding(mesh, rules):
            batch = context_layout(graphdef, params, batch)
            if reference:
                batch = with_reference(graphdef, reference_params({"params": params, "reference": reference_state},
                                                                  lora), batch)
            loss_sum, sums, _ = loss_fn.terms(graphdef, params, batch)
            return loss_sum, loss_fn.count(batch), sums

    return eval_step
