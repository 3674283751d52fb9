"""Objectives as a registry: a new one (label-smoothed cross-entropy) is declared in this file alone, and config
validation, the data checks, the step, the logs and the evals pick it up; no jaxtrain module names it."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import objectives, train
from jaxtrain import trainer as trainer_lib
from jaxtrain.data import pipeline
from jaxtrain.errors import ConfigError

NAME = "smoothed_ce"


def smoothed_loss(group) -> objectives.Loss:
    """(1 - epsilon) x cross-entropy + epsilon x the cross-entropy against a uniform target (Szegedy et al.)."""
    eps = group.epsilon

    def terms(graphdef, params, batch):
        logits, aux = objectives.logits(graphdef, params, batch)
        targets, weights = objectives.next_token_targets(batch)
        log_probs = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
        uniform = -log_probs.mean(-1)
        loss = (1 - eps) * nll + eps * uniform
        return jnp.sum(loss * weights), {"smoothed/uniform": jnp.sum(jax.lax.stop_gradient(uniform) * weights)}, aux

    return objectives.Loss(terms, lambda batch: objectives.next_token_targets(batch)[1].sum())


def check_group(group):
    if not 0 <= group.epsilon < 1:
        raise ConfigError(f"{NAME}.epsilon", f"must be in [0, 1), got {group.epsilon!r}")


@pytest.fixture
def smoothed():
    objective = objectives.register(objectives.Objective(
        NAME, smoothed_loss, config={"epsilon": 0.1}, check_config=check_group,
        metrics={"smoothed/uniform": objectives.Metric("uniform cross-entropy", 1.0, "uniform {:.3f}")}))
    yield objective
    objectives.unregister(NAME)
    assert NAME not in config_lib.base_config()


def numpy_smoothed(logits, batch, eps):
    """The same loss in numpy, from the model's logits: the mean over the scored tokens."""
    logits = np.asarray(logits, np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    tokens, seg = batch["tokens"], batch["segment_ids"]
    targets = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    next_seg = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
    weights = (seg != 0) & (next_seg == seg)
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    loss = (1 - eps) * nll + eps * -log_probs.mean(-1)
    return float((loss * weights).sum() / weights.sum())


def test_a_toy_objective_from_a_test_file_trains_logs_and_evaluates(smoothed, tiny_config, tiny_data_dir):
    cfg = tiny_config(**{"train.objective": NAME, f"{NAME}.epsilon": 0.2, "train.steps": 3, "eval.every_steps": 3})
    lines = []
    summary = train.run(cfg, print_fn=lines.append)
    assert summary["finished"] and summary["step"] == 3

    # Step 1's loss is the objective's at the initial weights on the first batch, as numpy computes it.
    trainer = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 8))
    params = jax.device_get(trainer.init()["params"])
    batch = next(pipeline.train_iterator(tiny_data_dir, seq_len=32, global_batch=8, seed=0))
    logits, _ = objectives.logits(trainer.graphdef, params, {k: jnp.asarray(v) for k, v in batch.items()})
    records = [json.loads(line) for line in (Path(cfg.workdir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    np.testing.assert_allclose(steps[0]["loss"], numpy_smoothed(logits, batch, 0.2), rtol=2e-5)
    assert steps[-1]["loss"] < steps[0]["loss"]
    # Its metric is logged, on the progress line, and held out.
    assert all(r["smoothed/uniform"] > 0 for r in steps)
    assert all(" | uniform " in line for line in lines if line.startswith("step "))
    assert any("eval_smoothed/uniform" in r for r in records)
    assert json.loads((Path(cfg.workdir) / "config.json").read_text())[NAME] == {"epsilon": 0.2}


def test_its_config_group_and_name_are_validated(smoothed, tiny_config):
    with pytest.raises(ConfigError, match=rf"^{NAME}\.epsilon: must be in \[0, 1\), got 1\.5"):
        config_lib.validate(tiny_config(**{"train.objective": NAME, f"{NAME}.epsilon": 1.5}), 8)
    assert config_lib.validate(tiny_config(**{"train.objective": NAME}), 8).objective is smoothed
    with pytest.raises(ConfigError, match=rf"^train\.objective: 'smoothed' is not one of lm, dpo, grpo, {NAME}$"):
        config_lib.validate(tiny_config(**{"train.objective": "smoothed"}), 8)


def test_the_data_check_reads_the_declaration(smoothed, tiny_data_dir):
    """A documents objective refuses preference pairs and names the objectives for each kind of data."""
    suits = objectives.by_data()
    assert suits == {"documents": ["lm", NAME], "pairs": ["dpo"], "prompts": ["grpo"]}
    pipeline.check_data_kind(tiny_data_dir, NAME, "documents", suits)
    with pytest.raises(ConfigError, match=rf"^train\.objective: 'dpo', but {tiny_data_dir} holds documents; set "
                                          rf"it to lm or {NAME}, or prepare the data with --preference$"):
        pipeline.check_data_kind(tiny_data_dir, "dpo", "pairs", suits)
