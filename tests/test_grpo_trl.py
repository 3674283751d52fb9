"""GRPO end to end against TRL 1.16: one tiny random Llama (transformers, f32), the same prompts, completions and
rewards. TRL's side is its own code: GRPOTrainer._compute_loss called unbound, whose log-probs come from TRL's
_get_per_token_logps_and_entropies running the HF model patched with TRL's fused LM head (as GRPOTrainer.__init__
patches it), its settings read from a GRPOConfig and its advantages TRL's formula. jaxtrain's side is the grpo
objective's Loss on the imported model. Loss and every parameter's gradient agree within 1e-5, on-policy and
off-policy, for TRL's defaults, Dr. GRPO and DAPO's clip-higher; the advantages equal numpy's."""

import collections
import contextlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxtrain import objectives
from jaxtrain.models import grpo, hf, transformer
from jaxtrain.models.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head, nanstd  # noqa: E402

VOCAB, PAD, EOS, G = 96, 0, 2, 4
PROMPT_LENGTHS = (3, 6, 4)
# Completions per prompt; the longest (7) ran out of tokens, the others end in EOS.
COMPLETION_LENGTHS = ((5, 2, 7, 4), (1, 6, 3, 7), (4, 7, 2, 5))
MAX_COMPLETION = 7
REWARDS = np.array([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.1, 1.0, 0.0, 0.0, 0.3], np.float32)
TOL = 1e-5

# Each setting: GRPOConfig's arguments (TRL's side) and jaxtrain's grpo group overrides. "default" is both sides'
# defaults untouched (it checks that jaxtrain's CONFIG is TRL's); Dr. GRPO's denominator is N x the max length, with
# unscaled rewards; DAPO's clip-higher runs at temperature 0.7, which both sides divide the logits by.
SETTINGS = {
    "default": ({}, {}),
    "dr_grpo": (dict(loss_type="dr_grpo", scale_rewards="none", max_completion_length=10),
                dict(loss_type="dr_grpo", scale_rewards=False, max_completion_tokens=10)),
    "dapo_clip_higher": (dict(loss_type="dapo", epsilon_high=0.28, temperature=0.7),
                         dict(loss_type="dapo", epsilon_high=0.28, temperature=0.7)),
}


def _numpy_advantages(rewards, scale):
    r = rewards.astype(np.float64).reshape(-1, G)
    a = r - r.mean(1, keepdims=True)
    if scale:
        a = a / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    return a.reshape(-1)


def _trl_advantages(rewards, scale_rewards):
    """GRPOTrainer._generate_and_score_completions' advantages (one reward function, sum_then_normalize)."""
    rewards = torch.tensor(rewards)
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return advantages


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """The HF directory of a tiny random Llama, and prompts and completions of token ids (no PAD or EOS inside)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=64, initializer_range=0.2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # norm scales away from 1: a misplaced one would change the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("grpo_trl") / "hf"
    model.save_pretrained(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(EOS + 1, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    completions = []
    for lengths in COMPLETION_LENGTHS:
        for n in lengths:
            ids = rng.integers(EOS + 1, VOCAB, n).tolist()
            completions.append(ids if n == MAX_COMPLETION else ids[:-1] + [EOS])
    return path, [p for p in prompts for _ in range(G)], completions


def _hf_model(path, temperature):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))  # GRPOTrainer.__init__'s
    return model.train()  # no dropout in Llama; "train" selects TRL's training normaliser


def _trl_inputs(prompts, completions):
    """TRL's layout: prompts left-padded, completions right-padded, masks 1 on real tokens. transformers then
    numbers positions 0.. from the padding on, so a row's RoPE positions are offset by its left padding where
    jaxtrain's start at 0 at its first token: the same attention, RoPE being relative."""
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [PAD] * (MAX_COMPLETION - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (MAX_COMPLETION - len(c)) for c in completions])
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, num_items_in_batch=completion_mask.sum())


def _trl_trainer(model, args):
    """A stand-in for GRPOTrainer holding what __init__ sets from `args` (one process, no accumulation, no vLLM),
    with TRL's own log-prob method bound to it."""
    same = lambda x, **kw: x  # noqa: E731
    trainer = types.SimpleNamespace(
        model=model, args=args, temperature=args.temperature, loss_type=args.loss_type, beta=args.beta,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        max_completion_length=args.max_completion_length, importance_sampling_level=args.importance_sampling_level,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        accelerator=types.SimpleNamespace(num_processes=1, gather=same, gather_for_metrics=same, reduce=same,
                                          autocast=contextlib.nullcontext, sync_gradients=True,
                                          is_main_process=True),
        _metrics={"train": collections.defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = types.MethodType(
        GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    return trainer


def _trl_run(path, inputs, args, old_per_token_logps):
    """TRL's loss, its gradient per HF tensor name, and its clip metrics."""
    model = _hf_model(path, args.temperature)
    trainer = _trl_trainer(model, args)
    loss = GRPOTrainer._compute_loss(trainer, model, {**inputs, "old_per_token_logps": old_per_token_logps})
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    return float(loss.detach()), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _trl_old_log_probs(path, inputs, args):
    """Log-probs of a sampling policy a step behind (the lm_head moved), as TRL computes old_per_token_logps."""
    model = _hf_model(path, args.temperature)
    trainer = _trl_trainer(model, args)
    with torch.no_grad():
        model.lm_head.weight.add_(0.15 * torch.randn(model.lm_head.weight.shape,
                                                     generator=torch.Generator().manual_seed(1)))
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, MAX_COMPLETION)
    return old


def _jaxtrain_batch(prompts, completions, advantages, old):
    """jaxtrain's rollout layout (models.rollout.Rollouts): prompt then completion, right-padded; a log-prob sits
    at the position that predicts its token."""
    n, t = len(prompts), max(map(len, prompts)) + MAX_COMPLETION
    batch = {k: np.zeros((n, t), dtype) for k, dtype in (("tokens", np.int32), ("segment_ids", np.int32),
                                                          ("loss_weights", np.int32), ("old_log_probs", np.float32))}
    for r, (p, c) in enumerate(zip(prompts, completions)):
        batch["tokens"][r, :len(p) + len(c)] = p + c
        batch["segment_ids"][r, :len(p) + len(c)] = 1
        batch["loss_weights"][r, len(p):len(p) + len(c)] = 1
        batch["old_log_probs"][r, len(p) - 1:len(p) + len(c) - 1] = old[r, :len(c)]
    batch["positions"] = np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy()
    batch["advantages"] = np.broadcast_to(np.asarray(advantages, np.float32)[:, None], (n, t)).copy()
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _jaxtrain_runs(path, cases, tmp_path):
    """jaxtrain's loss (the step's sum / count), its gradient per HF tensor name (exported through the family's
    weight table, as a checkpoint would be) and its metric means, for each {case: (grpo group, batch)}; one jit
    for all of them (a compile per case would take most of this file's time)."""
    fields, params = hf.import_dir(path)
    cfg = ModelConfig(**fields, dtype="float32", param_dtype="float32")
    graphdef, state = transformer.from_params(cfg, jax.tree.map(jnp.asarray, params))
    losses = {case: objectives.grpo_loss(group) for case, (group, _) in cases.items()}

    def value(state, batch, loss):
        loss_sum, metrics, _ = loss.terms(graphdef, state, batch)
        count = loss.count(batch)
        return loss_sum / count, {k: v / count for k, v in metrics.items()}

    def run(state, batches):
        return {case: jax.value_and_grad(value, has_aux=True)(state, batches[case], loss)
                for case, loss in losses.items()}

    results = jax.jit(run)(state, {case: batch for case, (_, batch) in cases.items()})
    out = {}
    for (setting, on_policy), ((loss_value, metrics), grads) in results.items():
        exported = hf.export(nnx.to_pure_dict(grads), cfg, tmp_path / f"{setting}_{on_policy}")
        out[setting, on_policy] = (float(loss_value), load_file(exported / "model.safetensors"),
                                   {k: float(v) for k, v in metrics.items()})
    return out


CASES = [(setting, on_policy) for setting in SETTINGS for on_policy in (True, False)]


@pytest.fixture(scope="module")
def results(rollouts, tmp_path_factory):
    """{(setting, on_policy): (TRL's (loss, grads, metrics), jaxtrain's)}. Off-policy, jaxtrain runs a round of 2
    steps on one rollout (TRL: num_iterations=2), whose ratio's denominator is the sampling log-probs."""
    path, prompts, completions = rollouts
    tmp = tmp_path_factory.mktemp("grpo_trl_runs")
    theirs, ours = {}, {}
    for setting, on_policy in CASES:
        trl_overrides, ours_overrides = SETTINGS[setting]
        args = trl.GRPOConfig(output_dir=str(tmp / "trl"), report_to=[], bf16=False, **trl_overrides)
        group = types.SimpleNamespace(**{**objectives.GRPO.config, **ours_overrides,
                                         "iterations": 1 if on_policy else 2})
        grpo.check_config(group)
        inputs = _trl_inputs(prompts, completions)
        inputs["advantages"] = _trl_advantages(REWARDS, args.scale_rewards)
        old = None if on_policy else _trl_old_log_probs(path, inputs, args)
        theirs[setting, on_policy] = _trl_run(path, inputs, args, old)
        advantages = grpo.advantages(REWARDS, G, group.scale_rewards, group.reward_eps)
        old = np.zeros((len(prompts), MAX_COMPLETION), np.float32) if on_policy else old.numpy()
        ours[setting, on_policy] = (group, _jaxtrain_batch(prompts, completions, advantages, old))
    ours = _jaxtrain_runs(path, ours, tmp)
    return {case: (theirs[case], ours[case]) for case in CASES}


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_equal_numpy_and_trl(scale):
    ours = np.asarray(grpo.advantages(REWARDS, G, scale))
    np.testing.assert_allclose(ours, _numpy_advantages(REWARDS, scale), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours, _trl_advantages(REWARDS, "group" if scale else "none").numpy(), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("on_policy", [True, False], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_loss_and_gradients_equal_trl(results, setting, on_policy):
    (trl_loss, trl_grads, trl_metrics), (loss, grads, metrics) = results[setting, on_policy]
    assert abs(loss - trl_loss) <= TOL * max(1.0, abs(trl_loss)), (loss, trl_loss)
    assert sorted(grads) == sorted(trl_grads)
    for name, theirs in trl_grads.items():
        # Per tensor: the largest absolute error, relative to the tensor's largest gradient.
        err = np.abs(grads[name] - theirs).max() / np.abs(theirs).max()
        assert err <= TOL, f"{name}: max error {err:.2e} of its largest gradient"
        assert np.abs(theirs).max() > 1e-4, name  # no trivially zero gradient
    for ours, theirs in (("clip_low", "low_mean"), ("clip_high", "high_mean"), ("clip_region", "region_mean")):
        np.testing.assert_allclose(metrics[f"grpo/{ours}"], trl_metrics[f"clip_ratio/{theirs}"], atol=1e-6)
    if not on_policy:  # the sampling policy is far enough that ratios clip on both sides
        assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0, trl_metrics
