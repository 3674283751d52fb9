"""GRPO as a run (train.objective=grpo): prompts prepared with `prepare --prompts`, rollouts of the trainer's own
weights scored by reward functions, through the same train.run. The sampler's log-probs equal the trainer's in f32;
a run stopped (or SIGKILLed) and resumed equals one that was not, rollouts included; bad input exits 2 naming it,
before the workdir exists."""

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import chat_tokenizer_dir, trainer_on

from jaxtrain import train
from jaxtrain.data import layout, prompts
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.tools import prepare as prepare_cli

REPO = Path(__file__).resolve().parents[1]
QUIET = {"print_fn": lambda *a, **k: None}
WORDS = "red green blue cat dog sun moon tree".split()


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory, tiny_data_dir):
    """Sums of two numbers as text prompts with their answers, tokenized with the tiny corpus's tokenizer."""
    root = tmp_path_factory.mktemp("grpo")
    rng = np.random.default_rng(0)
    pairs = rng.integers(10, 50, (40, 2))
    src = root / "sums.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{a} plus {b} is", "answer": str(a + b)}) + "\n"
                           for a, b in pairs))
    out = root / "data"
    assert prepare_cli.main(["--prompts", "--input", str(src), "--tokenizer",
                             os.path.join(tiny_data_dir, layout.TOKENIZER), "--heldout_prompts", "4",
                             "--output", str(out)]) == 0
    return str(out)


def _grpo(tiny_config, data, **overrides):
    return tiny_config(**{"data.dir": data, "train.objective": "grpo", "train.seq_len": 24, "train.steps": 3,
                          "grpo.group_size": 4, "grpo.max_completion_tokens": 8, "grpo.reward_workers": 1,
                          "grpo.rewards": "reward_fixtures:digits_match", "eval.every_steps": 0,
                          "checkpoint.every_steps": 1, **overrides})


def test_prepared_prompts_keep_their_fields_and_a_step_s_prompts_depend_on_the_seed_and_step_only(prompts_dir):
    manifest = layout.load_manifest(prompts_dir)
    assert manifest["kind"] == "prompts" and manifest["fields"] == ["answer", "prompt"]
    train_rows, held = prompts.load(prompts_dir), prompts.load(prompts_dir, "heldout")
    assert len(train_rows) == 36 and len(held) == 4
    tok = layout.load_tokenizer(prompts_dir)
    row = train_rows[0]
    assert tok.decode(row["prompt_ids"]) == row["fields"]["prompt"]
    first = [prompts.step_prompts(36, 4, seed=0, step=s) for s in range(1, 10)]
    assert sorted(np.concatenate(first).tolist()) == list(range(36))  # an epoch visits each prompt once
    np.testing.assert_array_equal(prompts.step_prompts(36, 4, seed=0, step=3), first[2])
    assert not np.array_equal(prompts.step_prompts(36, 4, seed=1, step=3), first[2])


# Rounds of two rollout batches and two passes over them (4 steps), the sampler's numbers corrected for.
ROUNDS = {"grpo.rollout_batches": 2, "grpo.iterations": 2, "train.steps": 8,
          "grpo.sampler_correction": "token_truncate"}


@pytest.fixture(scope="module")
def whole(tiny_config, prompts_dir):
    """The uninterrupted run of ROUNDS: its summary and its workdir's train records by step."""
    cfg = _grpo(tiny_config, prompts_dir, **ROUNDS)
    summary = train.run(cfg, **QUIET)
    return summary, {r["step"]: r for r in metrics_lib.lineage(metrics_lib.read_records(
        Path(cfg.workdir) / "metrics.jsonl"))[0]}


def test_a_run_trains_on_its_rollouts_and_resumes_bit_identically(tiny_config, prompts_dir, tmp_path, whole):
    """Stopped at step 6, inside the second round (its rows come back from the checkpoint's data state), then
    resumed, a run ends with the same state as one that was not stopped."""
    whole = whole[0]
    cfg = _grpo(tiny_config, prompts_dir, workdir=tmp_path / "split", **ROUNDS)
    stop = 6
    assert train.run(_stop_at(cfg, stop), **QUIET)["step"] == stop
    resumed = train.run(cfg, **QUIET)
    assert resumed["resumed"] and resumed["state_checksum"] == whole["state_checksum"]
    lines = [json.loads(line) for line in open(tmp_path / "split" / "metrics.jsonl")]
    steps = [r for r in lines if "grpo/reward" in r]
    assert [r["step"] for r in steps] == list(range(1, cfg.train.steps + 1))
    # The generation evals on the 4 held-out prompts, at the start and the end: 4 completions each.
    evals = [r for r in lines if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, cfg.train.steps]
    assert all(r["eval_completion_tokens"] >= 1 and r["eval_accuracy"] <= r["eval_pass@4"] <= 1 for r in evals)
    for r in steps:
        # The sampler and the trainer compute the same log-probs of what was sampled (f32, one device).
        assert r["grpo/sampler_logp_max_diff"] < 1e-5, r
        assert 0 <= r["grpo/reward"] <= 1 and r["grpo/completion_tokens"] >= 1
        assert r["grpo/sampler_tokens_per_sec"] > 0 and "grpo/clip_region" in r and r["grpo/reward_failures"] == 0


def _stop_at(cfg, step):
    cfg = cfg.copy_and_resolve_references()
    cfg.train.stop_at = step
    return cfg


# The first attempt: each save commits before the run goes on (so the kill below finds step 3's checkpoint whole),
# and the process SIGKILLs itself as round 2 (steps 5..8) starts sampling. Step 4 is lost; the rerun restores step
# 3 with round 1's rows from the data state, trains step 4 on them again, then samples round 2 afresh.
KILLED = """
import os, pickle, signal
from jaxtrain import checkpoint, rollouts, train

save, rollout = checkpoint.Checkpointer.save, rollouts.RolloutSource._rollout

def save_and_commit(self, *args):
    save(self, *args)
    self.wait()

def die_in_round_2(self, params, index):
    if index == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return rollout(self, params, index)

checkpoint.Checkpointer.save, rollouts.RolloutSource._rollout = save_and_commit, die_in_round_2
with open({config!r}, "rb") as f:
    train.run(pickle.load(f), print_fn=lambda *a, **k: None)
"""


@pytest.mark.slow
def test_a_sigkilled_run_resumes_bit_identically_rollouts_included(tiny_config, prompts_dir, tmp_path, whole):
    want, want_steps = whole
    cfg = _grpo(tiny_config, prompts_dir, workdir=tmp_path / "killed", **{**ROUNDS, "checkpoint.every_steps": 3})
    (tmp_path / "config.pkl").write_bytes(pickle.dumps(cfg))
    tests = str(Path(__file__).parent)  # reward_fixtures, for the reward workers
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), tests, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", KILLED.format(config=str(tmp_path / "config.pkl"))], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpts = Path(cfg.workdir) / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.isdigit()) == ["3"]

    resumed = train.run(cfg, **QUIET)
    assert resumed["resumed"] and resumed["state_checksum"] == want["state_checksum"]
    records = metrics_lib.read_records(Path(cfg.workdir) / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r][:3] == [1, 2, 3]  # the first attempt's, logged before the kill
    steps = {r["step"]: r for r in metrics_lib.lineage(records)[0]}
    assert sorted(steps) == list(range(1, 9))
    for step, r in steps.items():  # the losses and the rollouts' figures, bit for bit
        keys = ["loss", "grad_norm", "grpo/reward", "grpo/completion_tokens", "grpo/sampler_logp_max_diff"]
        assert [r[k] for k in keys] == [want_steps[step][k] for k in keys], step


@pytest.mark.parametrize("overrides, field", [
    ({"grpo.rewards": "reward_fixtures:no_such_function"}, "grpo.rewards[0]"),
    ({"grpo.rewards": "reward_fixtures:needs_a_field_the_prompts_lack"}, "grpo.rewards[0]"),
    ({"grpo.group_size": 1}, "grpo.group_size"),
    ({"grpo.group_size": 3}, "train.batch_size"),
    ({"grpo.max_completion_tokens": 20}, "grpo.max_completion_tokens"),
    ({"grpo.iterations": 2}, "train.steps"),
])
def test_bad_settings_exit_before_the_workdir_naming_them(tiny_config, prompts_dir, overrides, field):
    cfg = _grpo(tiny_config, prompts_dir, **overrides)
    with pytest.raises(ConfigError, match=f"^{field.replace('[', '.').replace(']', '.')}"):
        train.run(cfg, **QUIET)
    assert not os.path.exists(cfg.workdir)


def test_a_prompts_file_without_prompts_is_named(tmp_path, tiny_data_dir):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"prompt": "1 plus 2 is"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: no `prompt` field"):
        prompts.prepare_prompts(str(tmp_path / "out"), [str(src)],
                                tokenizer=os.path.join(tiny_data_dir, layout.TOKENIZER), print_fn=lambda *a: None)
    assert prepare_cli.main(["--prompts", "--input", str(src), "--tokenizer",
                             os.path.join(tiny_data_dir, layout.TOKENIZER), "--output", str(tmp_path / "o")]) == 2


def test_chat_prompts_are_rendered_with_the_generation_prompt(tmp_path):
    hf = chat_tokenizer_dir(tmp_path / "hf", WORDS)
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"prompt": [{"role": "user", "content": "red cat"}], "answer": "dog"}) + "\n")
    prompts.prepare_prompts(str(tmp_path / "out"), [str(src)], tokenizer=str(hf), print_fn=lambda *a: None)
    row = prompts.load(str(tmp_path / "out"))[0]
    text = layout.load_tokenizer(str(tmp_path / "out")).decode(row["prompt_ids"])
    assert text.endswith("<|im_start|>assistant\n") and "red cat" in text and row["fields"]["answer"] == "dog"


def test_rollouts_and_updates_on_eight_devices_equal_one_device(tiny_config, prompts_dir):
    """2 steps, each sampling its rollouts with the step's weights where the trainer keeps them (sharded), then
    updating: the same completions, rewards, losses and gradient norms as on one device. The mesh data 2 x fsdp 2
    x tensor 2 holds both pairs the issue names (fsdp x tensor, data x fsdp) in one run."""
    import jax

    from jaxtrain import config as config_lib
    from jaxtrain import rewards, rollouts
    from jaxtrain import trainer as trainer_lib
    from jaxtrain.parallel import mesh as mesh_lib

    def run(trainer, cfg):
        tok = layout.load_tokenizer(prompts_dir)
        with rewards.RewardPool(cfg.grpo.rewards, workers=1) as pool:
            source = rollouts.RolloutSource(cfg, trainer, prompts_dir, tok, pool)
            state, out = trainer.init(), []
            for step in (1, 2):
                batch, metrics = source.batch(state["params"], step)
                state, m = trainer.train_step(state, trainer_lib.global_batch(batch, trainer.batch_sharding))
                out.append((batch["tokens"], metrics["grpo/reward"], float(m["loss"]), float(m["grad_norm"])))
        return out

    # The completion's length in characters: rewards that differ within every group, so the steps move weights.
    cfg = _grpo(tiny_config, prompts_dir, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
                                            "mesh.rules": "dp_fsdp_tp", "grpo.rewards": "reward_fixtures:length"})
    eight = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 8))
    one = trainer_on(cfg, {}, mesh_lib.resolve_rules("dp_fsdp_tp"), devices=jax.devices()[:1])
    for (tokens, reward, loss, gnorm), (want_tokens, want_reward, want_loss, want_gnorm) in zip(run(eight, cfg),
                                                                                                run(one, cfg)):
        np.testing.assert_array_equal(tokens, want_tokens)
        assert reward == want_reward and want_gnorm > 1e-3
        np.testing.assert_allclose([loss, gnorm], [want_loss, want_gnorm], rtol=1e-5, atol=1e-7)


def test_the_planner_adds_the_rollouts_kv_cache_to_the_resident_state(tiny_config, prompts_dir):
    """`jaxtrain plan` of a GRPO config: the K/V cache of a rollout's rows (batch x rollout_batches, seq_len
    positions, every layer's keys and values, f32 on the CPU) split over the 4 batch shards, plus the state."""
    from jaxtrain.tools.plan import planner

    cfg = _grpo(tiny_config, prompts_dir, **{"mesh.data": 4, "mesh.tensor": 2, "grpo.rollout_batches": 2,
                                            "train.steps": 4})
    got = planner.plan(cfg, 8)["memory"]
    m = cfg.model
    want = 2 * m.n_layers * (8 * 2) * cfg.train.seq_len * m.n_kv_heads * m.head_dim * 4 / (4 * 2)
    assert got["rollout"]["rows"] == 16 and got["rollout"]["kv_cache"] == want
    state = got["sharding"]
    assert got["rollout"]["peak"] == state["params"] + state["optimizer"] + state["step"] + want
