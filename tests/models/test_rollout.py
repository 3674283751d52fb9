"""Batched RL rollouts: prompts of different lengths in one batch decode as each alone, the sampler's log-probs are
the trainer's, randomness is a function of (seed, step, row), stop ids, and 8 sharded devices equal one."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import objectives
from jaxtrain.models import rollout, sampling, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.parallel import mesh as mesh_lib
from helpers import numpy_model

# init_std 0.3 spreads the logits: greedy has no near-ties that rounding could flip (as tests/models/test_sampling).
DENSE = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64,
                    init_std=0.3, dtype="float32", param_dtype="float32")
MODELS = {
    "dense": DENSE,
    # Layer 0 slides over 4 positions, shorter than the cache: its own ring (transformer.init_cache).
    "sliding": dataclasses.replace(DENSE, sliding_window=4, global_every=2),
    # DeepSeek-V3-like: latent attention, a dense first layer, then 4 dropless experts and a shared one.
    "latent_moe": dataclasses.replace(DENSE, n_heads=4, n_kv_heads=4, kv_lora_rank=16, q_lora_rank=24,
                                      qk_nope_head_dim=12, v_head_dim=10, n_experts=4, moe_top_k=2, d_ff=16,
                                      n_shared_experts=1, first_dense_layers=1, dense_d_ff=64, moe_routing="dropless"),
}
PROMPTS = [[5, 9, 100], [3, 1, 4, 1, 5, 9, 2], [7, 300, 22, 8, 41, 9, 10, 11, 12, 13, 77, 200]]
MAX_PROMPT, NEW = 16, 12


@functools.lru_cache
def model(name):
    """(graphdef, params) with every parameter drawn by numpy (building for real compiles each initializer)."""
    return numpy_model(MODELS[name])


def one_device():
    return mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1]), "dp"


@functools.lru_cache
def sampler(name, mesh_key="one", **settings):
    """One sampler per model and settings (each compiles its rollout once per batch shape)."""
    mesh, rules = one_device() if mesh_key == "one" else eight_devices()
    settings = {"temperature": 1.0, "top_k": 0, "seed": 3, **settings}
    return rollout.make_sampler(model(name)[0], mesh, rules, max_prompt_tokens=MAX_PROMPT, max_new_tokens=NEW,
                                **settings)


@functools.lru_cache
def trainer_log_probs(graphdef):
    return jax.jit(lambda params, batch: objectives.token_log_probs(graphdef, params, batch)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_batch_of_different_lengths_equals_each_prompt_alone(name):
    graphdef, params = model(name)
    out = sampler(name, temperature=0.0)(params, PROMPTS, step=0)
    for r, prompt in enumerate(PROMPTS):
        alone = sampling.generate(graphdef, params, prompt, window=64, max_new_tokens=NEW, temperature=0.0)[0]
        assert out.completions[r] == alone, f"row {r}"
        # The training layout: prompt, completion, padding; weights on the completion; positions along the row.
        end = len(prompt) + NEW
        assert out.tokens[r, :end].tolist() == prompt + alone and not out.tokens[r, end:].any()
        assert out.segment_ids[r].tolist() == [1] * end + [0] * (MAX_PROMPT - len(prompt))
        assert out.loss_weights[r].tolist() == [0] * len(prompt) + [1] * NEW + [0] * (MAX_PROMPT - len(prompt))
    assert out.positions.tolist() == [list(range(MAX_PROMPT + NEW))] * 3
    assert out.truncated.all() and out.new_tokens == 3 * NEW and out.seconds > 0
    assert len({tuple(c) for c in out.completions}) == 3  # the rows do differ


@pytest.mark.parametrize("name", list(MODELS))
def test_sampler_log_probs_are_the_trainers(name):
    """f32 on CPU: objectives.token_log_probs on the returned batch, the trainer's recomputation, within 1e-5."""
    graphdef, params = model(name)
    out = sampler(name)(params, PROMPTS, step=1)
    want = np.asarray(trainer_log_probs(graphdef)(params, out.batch()))
    np.testing.assert_array_equal(out.log_probs != 0, want != 0)  # the same scored positions
    assert (out.log_probs != 0).sum() == 3 * NEW
    assert np.abs(out.log_probs - want).max() < 1e-5
    greedy = sampler(name, temperature=0.0)(params, PROMPTS, step=1)
    assert out.completions != greedy.completions and out.log_probs.sum() < greedy.log_probs.sum()


def test_log_probs_are_at_the_sampling_temperature_before_top_k():
    graphdef, params = model("dense")
    out = sampler("dense", temperature=0.7, top_k=20)(params, PROMPTS, step=0)
    logits, _ = jax.jit(functools.partial(objectives.logits, graphdef))(params, out.batch())
    targets, weights = objectives.next_token_targets(out.batch())
    want = jnp.take_along_axis(jax.nn.log_softmax(logits / 0.7), targets[..., None], -1)[..., 0] * weights
    assert np.abs(out.log_probs - np.asarray(want)).max() < 1e-5
    # The entropy each token was drawn at, from the trainer's logits at the same temperature.
    log_p = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / 0.7))
    entropy = -(np.exp(log_p) * log_p).sum(-1)[np.asarray(weights) > 0]
    assert out.entropy == pytest.approx(entropy.mean(), rel=1e-5)
    ranks = np.argsort(np.argsort(-np.asarray(logits), axis=-1), axis=-1)
    assert np.take_along_axis(ranks, np.asarray(targets)[..., None], -1)[..., 0][np.asarray(weights) > 0].max() < 20


def test_randomness_is_a_function_of_seed_step_and_row():
    graphdef, params = model("dense")
    run = sampler("dense")
    first = run(params, PROMPTS, step=4)
    again = run(params, PROMPTS, step=4)
    assert again.completions == first.completions
    np.testing.assert_array_equal(again.log_probs, first.log_probs)
    assert run(params, PROMPTS, step=5).completions != first.completions
    assert sampler("dense", seed=4)(params, PROMPTS, step=4).completions != first.completions
    # Row 1 keeps its completion when the other rows' prompts change; other lengths reuse the compile.
    compiled = len(rollout._EXECUTABLES)
    others = run(params, [[11, 12], PROMPTS[1], [400] * 16], step=4)
    assert len(rollout._EXECUTABLES) == compiled
    assert others.completions[1] == first.completions[1] and others.completions[0] != first.completions[0]
    np.testing.assert_array_equal(others.log_probs[1], first.log_probs[1])
    # Repeated prompts (a GRPO group) draw differently: each row has its own key.
    group = run(params, [PROMPTS[0]] * 3, step=4)
    assert group.completions[0] == first.completions[0] and len({tuple(c) for c in group.completions}) == 3


def test_rows_stop_at_their_first_stop_id():
    graphdef, params = model("dense")
    full = sampler("dense", temperature=0.0)(params, PROMPTS, step=0).completions
    # A stop id in row 0's completion (its first occurrence, past the first token) that rows 1 and 2 never draw.
    cut = next(i for i in range(1, NEW) if full[0][i] not in full[0][:i] + full[1] + full[2])
    stop = full[0][cut]
    out = sampler("dense", temperature=0.0, stop_ids=(stop, 511))(params, PROMPTS, step=0)
    assert out.completions == [full[0][:cut + 1], full[1], full[2]]
    assert out.truncated.tolist() == [False, True, True]
    assert out.loss_weights[0].sum() == cut + 1 and out.new_tokens == cut + 1 + 2 * NEW
    end = len(PROMPTS[0]) + cut + 1
    assert out.segment_ids[0, :end].all() and not out.segment_ids[0, end:].any() and not out.tokens[0, end:].any()
    assert (out.log_probs[0] != 0).sum() == cut + 1


def test_batch_sizes_halve_to_whole_batch_shards_and_no_fewer():
    assert [rollout.next_size(n, ways) for n, ways in ((64, 8), (12, 4), (8, 4), (4, 4), (3, 1), (2, 1), (1, 1))] \
        == [32, 8, 4, 0, 2, 1, 0]


def _halving_row_steps(lengths, sizes):
    """Reference: the row-steps of a decode that moves to the next of `sizes` (the batch sizes in turn) whenever at
    most that many rows are live. Step i draws token i (the prefill token 0); a completion of n tokens (its stop
    id last) is live before step i while n > i."""
    steps, sizes = 0, list(sizes)
    for i in range(1, max(lengths)):
        while len(sizes) > 1 and sum(n > i for n in lengths) <= sizes[1]:
            sizes.pop(0)
        steps += sizes[0]
    return steps


@pytest.mark.parametrize("mesh_key, prompts, sizes", [
    ("one", PROMPTS, [3, 2, 1]),
    # 4 batch shards: 8 rows, then 4, never fewer than one a shard.
    ("eight", PROMPTS * 2 + [[1, 2], [250] * 9], [8, 4]),
])
def test_finished_rows_are_compacted_away_and_each_row_decodes_as_in_lockstep(mesh_key, prompts, sizes):
    """Stop ids that end the rows at different points: once at most the next batch size of rows is live, the
    live rows move to a batch that size. Each row draws the tokens it draws with every row decoding to the end
    (compact=False), and the decode runs the row-steps the halving predicts, fewer than lockstep's."""
    graphdef, params = model("dense")
    free = sampler("dense", mesh_key, compact=False)(params, prompts, step=6).completions  # no stop ids: 12 each
    # Each row's 3rd, 5th, 7th, ... token a stop id: row r stops at its first (whichever row it came from).
    stops = tuple(sorted({c[2 + 2 * (r % 5)] for r, c in enumerate(free)}))[:8]
    want = [next((c[:i + 1] for i, t in enumerate(c) if t in stops), c) for c in free]
    lengths = [len(c) for c in want]
    assert len(set(lengths)) >= len(sizes)  # the rows stop at different points: each size gets used
    lockstep = sampler("dense", mesh_key, compact=False, stop_ids=stops)(params, prompts, step=6)
    out = sampler("dense", mesh_key, stop_ids=stops)(params, prompts, step=6)
    assert lockstep.completions == out.completions == want
    for name in ("tokens", "segment_ids", "loss_weights", "truncated"):
        np.testing.assert_array_equal(getattr(out, name), getattr(lockstep, name))
    # XLA may round a batch of another size differently (~1e-6): the tokens above match all the same.
    np.testing.assert_allclose(out.log_probs, lockstep.log_probs, atol=1e-5)
    assert lockstep.decode_row_steps == lockstep.lockstep_row_steps == sizes[0] * (max(lengths) - 1)
    assert out.lockstep_row_steps == lockstep.lockstep_row_steps
    assert out.decode_row_steps == _halving_row_steps(lengths, sizes) < out.lockstep_row_steps


def test_bad_prompts_and_settings_raise():
    graphdef, params = model("dense")
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        sampler("dense")(params, [[1], [1] * (MAX_PROMPT + 1)], step=0)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        sampler("dense")(params, [[]], step=0)
    with pytest.raises(ValueError, match="^prompts: "):
        sampler("dense")(params, [], step=0)
    with pytest.raises(ValueError, match="^top_p: "):
        rollout.make_sampler(graphdef, *one_device(), max_prompt_tokens=4, max_new_tokens=4, top_p=0.0)


# --- The training mesh -----------------------------------------------------------------------------------------


def eight_devices():
    return mesh_lib.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), "dp_fsdp_tp"


def test_sharded_rollouts_equal_one_devices():
    """fsdp 2 x tensor 2 x data 2, the params sharded as the trainer shards them (trainer.abstract_train_state);
    3 prompts on 4 batch shards (one idle row)."""
    graphdef, params = model("dense")
    mesh, rules = eight_devices()
    names = nnx.to_pure_dict(nnx.get_partition_spec(nnx.split(nnx.eval_shape(
        lambda: transformer.build(DENSE, seed=0)))[1]))
    shardings = mesh_lib.tree_shardings(params, names, mesh, mesh_lib.resolve_rules(rules))
    sharded = jax.device_put(params, shardings)
    assert tuple(sharded["blocks"]["mlp"]["w_up"].sharding.spec) == (None, "fsdp", "tensor")  # really split
    for settings in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9)):
        want = sampler("dense", **settings)(params, PROMPTS, step=2)
        got = sampler("dense", "eight", **settings)(sharded, PROMPTS, step=2)
        assert got.completions == want.completions, settings
        np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)


def test_a_completion_ends_at_its_first_stop_string_the_rest_of_its_row_padding():
    """Ids decode to letters (id 0 = 'a'); row 0's completion "defg" holds "ef": it keeps "def" (the token that
    completes the stop string is its last); row 1's "xyz" holds none and is left as it was."""
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    tokens = np.array([[1, 2, 3, 4, 5, 6, 0], [1, 23, 24, 25, 0, 0, 0]], np.int32)
    segments = (np.arange(7) < np.array([[6], [4]])).astype(np.int32)
    weights = np.array([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0]], np.int32)
    log_probs = np.array([[0, -1, -2, -3, -4, 0, 0], [-5, -6, -7, 0, 0, 0, 0]], np.float32)
    out = rollout.Rollouts(tokens=tokens, positions=np.arange(7)[None].repeat(2, 0) * segments, segment_ids=segments,
                           loss_weights=weights, log_probs=log_probs, completions=[[3, 4, 5, 6], [23, 24, 25]],
                           truncated=np.array([True, True]), seconds=1.0, new_tokens=7)
    cut = rollout.end_at_strings(out, decode, ("ef", "zz"))
    assert cut.completions == [[3, 4, 5], [23, 24, 25]] and cut.truncated.tolist() == [False, True]
    np.testing.assert_array_equal(cut.tokens[0], [1, 2, 3, 4, 5, 0, 0])
    np.testing.assert_array_equal(cut.segment_ids[0], [1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(cut.loss_weights[0], [0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(cut.log_probs[0], [0, -1, -2, -3, 0, 0, 0])  # log_probs[i]: of token i + 1
    for a, b in zip((cut.tokens, cut.segment_ids, cut.loss_weights, cut.log_probs),
                    (tokens, segments, weights, log_probs)):
        np.testing.assert_array_equal(a[1], b[1])
    assert rollout.end_at_strings(out, decode, ()) is out
