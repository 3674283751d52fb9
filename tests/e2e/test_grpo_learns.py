"""GRPO learns, on scripts/bench_grpo.py's task: after an SFT warm start that prefers a wrong answer to two-digit
sums (a+b+1 in 60% of its documents), a run of configs/grpo_lora.py rewarded by exact_match raises the reward of
the held-out prompts well above the warm start's, greedy and sampled. The recipe validates without a run."""

import importlib.util
from pathlib import Path

import pytest

from jaxtrain import config as config_lib
from jaxtrain import files, train

REPO = Path(__file__).resolve().parents[2]
QUIET = {"print_fn": lambda *a, **k: None}
# Seeds 0, 1, 2 on 2 cores, 8 CPU devices: the warm start answers 0.18, 0.24, 0.27 of the held-out sums right
# greedily and 0.34, 0.36, 0.30 of its samples; 150 GRPO steps take them to 0.95, 0.97, 0.96 and 0.75, 0.70, 0.64.
SFT_STEPS, GRPO_STEPS = 800, 150
SEED = 0


def _bench():
    spec = importlib.util.spec_from_file_location("bench_grpo", REPO / "scripts" / "bench_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_validates():
    cfg = files.run_python_file(REPO / "configs" / "grpo_lora.py", "get_config", field="--config")
    resolved = config_lib.validate(cfg, 8)
    assert resolved.objective.name == "grpo" and cfg.model.lora_rank > 0 and not resolved.reference
    assert cfg.train.batch_size % cfg.grpo.group_size == 0 and cfg.train.steps % cfg.eval.every_steps == 0


@pytest.mark.slow
def test_grpo_raises_the_held_out_reward_above_the_warm_start(tmp_path):
    bench = _bench()
    task = bench.prepare_task(tmp_path, SEED)
    sft_workdir, sft_hf = bench.warm_start(tmp_path, task["sft"], SFT_STEPS, SEED, **QUIET)
    cfg = bench.grpo_config(tmp_path / "grpo", task["prompts"], sft_hf, **{
        "train.steps": GRPO_STEPS, "train.seed": SEED, "eval.every_steps": GRPO_STEPS,
        "checkpoint.every_steps": GRPO_STEPS})
    train.run(cfg, **QUIET)
    before, after = (bench.greedy_reward(w, task["prompts"]) for w in (sft_workdir, cfg.workdir))
    (start, sampled_before), (end, sampled_after) = [(r["step"], r["eval_reward"])
                                                     for r in bench.records(cfg.workdir) if "eval_reward" in r]
    assert (start, end) == (0, GRPO_STEPS)
    assert before < 0.5 and sampled_before < 0.5, (before, sampled_before)  # the warm start prefers a+b+1
    assert after > before + 0.5 and after > 0.85, (before, after)
    assert sampled_after > sampled_before + 0.25, (sampled_before, sampled_after)
    # The benchmark's figures from the same run's log: the sampling is part of the rollout, which is part of a step.
    figures = bench.figures(cfg.workdir)
    assert figures["sampler_tokens_per_sec"] > 0 and figures["trainer_tokens_per_sec"] > 0
    assert 0 < figures["sampler_frac"] < figures["rollout_frac"] < 1, figures
