"""An RL objective's batches (train.objective=grpo): prompts -> rollouts of the current weights -> rewards -> rows.

Round r (one step, or grpo.rollout_batches x iterations) takes its prompts (data.prompts.step_prompts: a function of
the seed and r) and samples each `group_size` times on the training mesh with the state's own parameters
(models.rollout), the randomness a function of (seed, r, row). Rewards run in their worker pool (jaxtrain.rewards),
then the group advantages (models.grpo). So a resumed run samples, scores and trains on the same rows. The host-side
figures (rewards, lengths, the sampler's speed, the sampler-trainer log-prob gap) join the step's metrics.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain import objectives
from jaxtrain import rewards as rewards_lib
from jaxtrain.data import layout
from jaxtrain.data import prompts as prompts_lib
from jaxtrain.errors import ConfigError
from jaxtrain.models import grpo as grpo_lib
from jaxtrain.models import rollout as rollout_lib
from jaxtrain.trainer import global_batch


def check(config, data_dir: str) -> None:
    """ConfigError naming what cannot work, before anything compiles: the step's rows must be whole groups, a row
    must hold the longest prompt and a whole completion, and every reward must be a function of the prompts'
    fields (jaxtrain.rewards.check)."""
    g, t = config.grpo, config.train
    if jax.process_count() > 1:  # the rollouts' host side (rewards, the round's rows) is one process's yet
        raise ConfigError("train.objective", f"grpo runs in one process for now, not {jax.process_count()}")
    if t.steps % (g.rollout_batches * g.iterations):
        raise ConfigError("train.steps", f"{t.steps} is not whole rounds of grpo.rollout_batches x grpo.iterations "
                          f"= {g.rollout_batches * g.iterations} steps")
    if t.batch_size % g.group_size:
        raise ConfigError("train.batch_size", f"{t.batch_size} rows are not whole groups of grpo.group_size="
                          f"{g.group_size} completions of a prompt")
    manifest = layout.load_manifest(data_dir)
    if manifest["longest"] + g.max_completion_tokens > t.seq_len:
        raise ConfigError("grpo.max_completion_tokens", f"{g.max_completion_tokens} after the longest prompt in "
                          f"{data_dir} ({manifest['longest']} tokens) exceeds train.seq_len={t.seq_len}")
    rewards_lib.check_config(g.rewards, manifest["fields"], "grpo.rewards")


class RolloutSource:
    """The train loop's batch source for train.objective=grpo: `batch(params, step)` -> (the step's process-local
    rows, host metrics). A round of `rollout_batches` x `iterations` steps takes one rollout of rollout_batches
    train batches, made at its first step, one train batch a step, `iterations` passes over it; the round's
    rows ride in the data state until it ends, so a run resumed inside a round trains on the same rows."""

    def __init__(self, config, trainer, data_dir: str, tokenizer, rewards):
        g, t = config.grpo, config.train
        self.group, self.size, self.seed, self.batch_size = g, g.group_size, t.seed, t.batch_size
        self.prompts = prompts_lib.load(data_dir)
        self.per_round = t.batch_size * g.rollout_batches // g.group_size
        self.tokenizer, self.rewards = tokenizer, rewards
        self.sampler = rollout_lib.make_sampler(
            trainer.graphdef, trainer.mesh, trainer.rules, max_prompt_tokens=t.seq_len - g.max_completion_tokens,
            max_new_tokens=g.max_completion_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
            stop_ids=[tokenizer.eos_id], seed=t.seed)
        graphdef = trainer.graphdef
        self.recompute = jax.jit(lambda params, b: objectives.token_log_probs(graphdef, params, b, g.temperature)[0])
        self.batch_sharding = trainer.batch_sharding
        self.rows = slice(jax.process_index() * t.batch_size // jax.process_count(),
                          (jax.process_index() + 1) * t.batch_size // jax.process_count())
        self.round = None  # (index, rows of the whole round, its metrics)
        self.heldout = prompts_lib.load(data_dir, "heldout")

    def evaluate(self, params, step: int) -> dict:
        """Generation evals on the held-out prompts: `eval_samples` completions each, sampled as the rollouts are
        (their own keys: step 2**31 + step), scored by the same rewards -> eval_reward, eval_accuracy (the share of
        completions whose reward reaches success_reward), eval_pass@k (of prompts with one such in k) and
        eval_completion_tokens. {} without held-out prompts."""
        if not self.heldout:
            return {}
        k = self.group.eval_samples
        records = [r for r in self.heldout for _ in range(k)]
        out = self._sample(params, records, 2**31 + step)
        texts = [self._text(c) for c in out.completions]
        rewards = np.asarray(self.rewards.score(texts, [r["fields"] for r in records],
                                                [r["id"] for r in records]).total)
        correct = (rewards >= self.group.success_reward).reshape(-1, k)
        return {"eval_reward": float(rewards.mean()), "eval_accuracy": float(correct.mean()),
                f"eval_pass@{k}": float(correct.any(axis=1).mean()),
                "eval_completion_tokens": float(np.mean([len(c) for c in out.completions]))}

    def close(self) -> None:
        self.rewards.close()

    def get_state(self) -> dict:
        state = {"order": prompts_lib.KIND}
        if self.round is not None:
            index, rows, metrics = self.round
            state["round"] = {"index": index, "metrics": metrics,
                              "rows": {k: {"dtype": v.dtype.name, "values": v.tolist()} for k, v in rows.items()}}
        return state

    def set_state(self, state: dict, allow_changed: bool = False) -> str:
        if saved := state.get("round"):
            rows = {k: np.asarray(v["values"], v["dtype"]) for k, v in saved["rows"].items()}
            self.round = (saved["index"], rows, saved["metrics"])
        else:
            self.round = None
        return ""

    def batch(self, params, step: int) -> tuple[dict, dict]:
        per_round = self.group.rollout_batches * self.group.iterations
        index, at = divmod(step - 1, per_round)
        if self.round is None or self.round[0] != index:
            self.round = (index, *self._rollout(params, index + 1))
        _, rows, metrics = self.round
        first = (at % self.group.rollout_batches) * self.batch_size
        local = slice(first + self.rows.start, first + self.rows.stop)
        batch = {k: np.ascontiguousarray(v[local]) for k, v in rows.items()}
        if at == per_round - 1:  # the round's last step: what a checkpoint after it keeps is the step alone
            self.round = None
        return batch, metrics

    def _rollout(self, params, index: int) -> tuple[dict, dict]:
        """Round `index`'s rows (rollout_batches train batches: tokens, positions, segment ids, loss weights,
        advantages, and the log-probs of the weights that sampled them) and its host metrics."""
        chosen = prompts_lib.step_prompts(len(self.prompts), self.per_round, self.seed, index)
        records = [self.prompts[i] for i in chosen for _ in range(self.size)]
        out = self._sample(params, records, index)
        texts = [self._text(c) for c in out.completions]
        scores = self.rewards.score(texts, [r["fields"] for r in records], [r["id"] for r in records])
        rewards = np.asarray(scores.total, np.float32)
        if self.group.overlong_cache:
            lengths = np.array([len(c) for c in out.completions])
            rewards = rewards + np.asarray(grpo_lib.overlong_penalty(lengths, self.group.max_completion_tokens,
                                                                     self.group.overlong_cache))
        advantages = np.asarray(grpo_lib.advantages(rewards, self.size, self.group.scale_rewards,
                                                    self.group.reward_eps))
        weights = out.loss_weights.astype(np.int32)
        kept = np.ones(len(records), bool)
        if self.group.dynamic_sampling:  # DAPO: a group with equal rewards has no signal; out of the loss
            kept = np.repeat(np.asarray(grpo_lib.dynamic_sampling_keep(rewards, self.size)), self.size)
            weights = weights * kept[:, None]
        rows = {"tokens": out.tokens, "positions": out.positions, "segment_ids": out.segment_ids,
                "loss_weights": weights,
                "advantages": np.broadcast_to(advantages[:, None], out.tokens.shape).astype(np.float32)}
        trainer = self._trainer_log_probs(params, rows)
        rows["old_log_probs"], rows["sampler_log_probs"] = trainer, out.log_probs.astype(np.float32)
        return rows, self._metrics(rows, out, trainer, rewards, scores, kept)

    def _sample(self, params, records, step: int) -> rollout_lib.Rollouts:
        """The records' prompts sampled (randomness keyed by `step` and row), ended at grpo.stop_strings."""
        out = self.sampler(params, [r["prompt_ids"] for r in records], step=step)
        return rollout_lib.end_at_strings(out, self._text, tuple(self.group.stop_strings))

    def _text(self, ids) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_id])

    def _trainer_log_probs(self, params, rows) -> np.ndarray:
        """The trainer's log-probs of the sampled tokens under `params`, [rows, T] (one train batch at a time):
        the ratio's denominator for the round's later steps, and the sampler's check."""
        out = []
        for first in range(0, len(rows["tokens"]), self.batch_size):
            local = {k: np.ascontiguousarray(v[first + self.rows.start:first + self.rows.stop])
                     for k, v in rows.items() if k in ("tokens", "positions", "segment_ids", "loss_weights")}
            out.append(np.asarray(jax.device_get(self.recompute(params, global_batch(local,
                                                                                      self.batch_sharding)))))
        return np.concatenate(out).astype(np.float32)

    def _metrics(self, rows, out, trainer, rewards, scores, kept) -> dict:
        """Host figures of a rollout: rewards (and each function's), completion lengths, the truncated and kept
        shares, the sampler's speed and work, and how far the sampler's log-probs are from the trainer's."""
        mask = np.asarray(objectives.next_token_targets(rows)[1]) > 0
        gap = (out.log_probs - trainer)[mask]
        lengths = np.array([len(c) for c in out.completions], np.float32)
        metrics = {"grpo/reward": float(rewards.mean()), "grpo/reward_std": float(rewards.std()),
                   "grpo/completion_tokens": float(lengths.mean()), "grpo/entropy": out.entropy,
                   "grpo/truncated": float(np.mean(out.truncated)), "grpo/kept": float(np.mean(kept)),
                   "grpo/sampler_tokens_per_sec": out.new_tokens / max(out.seconds, 1e-9),
                   # Rows the decode ran, and had it run every row until the last stopped (models.rollout).
                   "grpo/decode_row_steps": float(out.decode_row_steps),
                   "grpo/lockstep_row_steps": float(out.lockstep_row_steps),
                   "grpo/sampler_logp_max_diff": float(np.abs(gap).max()) if gap.size else 0.0,
                   "grpo/sampler_kl": float(gap.mean()) if gap.size else 0.0,
                   "grpo/reward_failures": float(sum(scores.failures.values()))}
        for name, column in zip(self.rewards.names, np.asarray(scores.per_function).T):
            metrics[f"grpo/reward/{name}"] = float(column.mean())
            metrics[f"grpo/reward_std/{name}"] = float(column.std())
        return metrics
