"""KV-cache generation: token-for-token equal to recomputing the whole forward, sampling rules, the CLI."""

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import sampling
from jaxtrain.parallel import pipeline as pipeline_parallel
from jaxtrain.models import layers, transformer
from jaxtrain.models.config import Layout, ModelConfig
from jaxtrain import trainer as trainer_lib
from jaxtrain.tools import generate as generate_cli
from helpers import numpy_model

REPO = Path(__file__).resolve().parents[2]
# GQA (8 query heads on 4 K/V heads). init_std 0.3 spreads the logits, so greedy has no near-ties that a
# 1e-6 difference could flip and sampling settings visibly matter.
CFG = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                              d_ff=64, init_std=0.3)
NEW_TOKENS = 20
REF_LEN = 32  # the reference's fixed buffer: one compile for every prompt


@pytest.fixture(scope="module")
def model():
    """(graphdef, params) with every parameter drawn by numpy: building for real compiles each initializer
    (about 15 s on a busy 2-core machine), and a norm scale of exactly 1 would leave the norms untested."""
    return numpy_model(CFG)


# Cached so that every test reuses one compile per window; compiles dominate this file's runtime.
@functools.lru_cache
def make_reference_forward(graphdef, window):
    """Logits after the first `length` tokens of a [REF_LEN] buffer, by a full forward over all of them.

    Within the window this is the model's own __call__ (padding as segment 0). Past it, the same blocks
    with a banded causal mask: each token sees the newest `window` tokens up to itself."""

    @jax.jit
    def forward(params, tokens, length):
        model = nnx.merge(graphdef, params)
        positions = jnp.arange(REF_LEN, dtype=jnp.int32)
        if window >= REF_LEN:
            segment_ids = (positions < length).astype(jnp.int32)
            return model(tokens[None], positions[None], segment_ids[None])[0, length - 1]
        query, key = positions[:, None], positions[None, :]
        mask = (key <= query) & (query - key < window) & (key < length)
        block_def, block_state = nnx.split(model.blocks)
        x = jnp.take(model.embed[...], tokens[None], axis=0)
        tables = layers.rotary(positions[None], layers.rope_frequencies(model.cfg))
        x, _ = jax.lax.scan(lambda x, s: nnx.merge(block_def, s)(x, tables, mask[None, None]),  # (x, aux)
                            x, block_state)
        return (model.final_norm(x[0, length - 1]) @ model.embed[...].T)

    return forward


reference_draw = jax.jit(sampling.sample_logits)


def reference(graphdef, params, prompt, *, window, seed, temperature, top_k, top_p):
    """(ids, logits per step): recompute everything for every token, drawing with the same per-step keys."""
    forward = make_reference_forward(graphdef, window)
    tokens = list(prompt[-window:])
    key = jax.random.key(seed)
    ids, logits = [], []
    for i in range(NEW_TOKENS):
        buf = np.zeros(REF_LEN, np.int32)
        buf[:len(tokens)] = tokens
        step_logits = forward(params, buf, len(tokens))
        tok = int(reference_draw(step_logits[None], jax.random.fold_in(key, i), temperature, top_k, top_p)[0])
        logits.append(np.asarray(step_logits))
        ids.append(tok)
        tokens.append(tok)
    return ids, logits


@functools.lru_cache
def decode_step(graphdef):
    return jax.jit(lambda params, token, cache, position: nnx.merge(graphdef, params).decode(token, cache, position))


def cached_logits(graphdef, params, prompt, ids, *, window):
    """The cache path's logits along a given continuation (teacher-forced), step by step."""
    prompt = prompt[-window:]
    cache_len = min(window, sampling.CACHE_BUCKET)
    tokens = np.zeros((1, cache_len), np.int32)
    tokens[0, :len(prompt)] = prompt
    logits, cache = sampling.prefill(graphdef, params, tokens, np.int32(len(prompt)))
    step = decode_step(graphdef)
    out = [np.asarray(logits[0])]
    for i, tok in enumerate(ids[:-1]):
        logits, cache = step(params, np.array([[tok]], np.int32), cache, np.int32(len(prompt) + i))
        out.append(np.asarray(logits[0]))
    return out


SETTINGS = {
    "greedy": dict(temperature=0.0, top_k=0, top_p=1.0),
    "top_k": dict(temperature=0.8, top_k=20, top_p=1.0),
    "top_p": dict(temperature=1.2, top_k=0, top_p=0.8),
    "top_k_and_p": dict(temperature=1.0, top_k=50, top_p=0.9),
}
# window 32 holds prompt + new tokens; window 8 makes the cache a ring buffer that wraps twice, and the
# 11-token prompt is cut to its last 8.
CASES = {"within_window": (32, [5, 9, 100, 7, 300]), "sliding_window": (8, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", list(CASES))
def test_cached_decoding_equals_full_recompute(model, case, setting):
    graphdef, params = model
    window, prompt = CASES[case]
    kw = SETTINGS[setting]
    ref_ids, ref_logits = reference(graphdef, params, prompt, window=window, seed=7, **kw)

    ids = sampling.sample(graphdef, params, prompt, window=window, max_new_tokens=NEW_TOKENS, seed=7, **kw)
    assert ids == ref_ids
    for step, (cached, full) in enumerate(zip(cached_logits(graphdef, params, prompt, ref_ids, window=window),
                                              ref_logits)):
        # Rounding of f32 sums over a cache and over the whole prefix, logits up to ~5: 1.4e-5 apart at most
        # when the suite compiles without LLVM's optimizations (tests/helpers.py FAST_COMPILE).
        np.testing.assert_allclose(cached, full, rtol=1e-5, atol=3e-5, err_msg=f"step {step}")
    if setting != "greedy":  # the settings must change something, or the equality above is weak
        greedy = sampling.sample(graphdef, params, prompt, window=window, max_new_tokens=NEW_TOKENS, seed=7,
                                 temperature=0.0, top_k=0)
        assert ids != greedy


def test_banded_reference_is_the_model_within_the_window(model):
    """The sliding-window reference is the model's own forward while the tokens fit in its window."""
    graphdef, params = model
    window = CASES["sliding_window"][0]
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, REF_LEN).astype(np.int32)
    for length in (1, window):
        np.testing.assert_allclose(make_reference_forward(graphdef, window)(params, tokens, length),
                                   make_reference_forward(graphdef, REF_LEN)(params, tokens, length), rtol=1e-5, atol=1e-5)


def test_sampling_rules():
    logits = np.random.default_rng(0).normal(0, 3, (1, CFG.vocab_size)).astype(np.float32)
    greedy = logits.argmax(-1)
    order = np.argsort(-logits[0])
    probs = np.exp(logits[0] - logits.max()) / np.exp(logits[0] - logits.max()).sum()
    for i in range(20):
        key = jax.random.key(i)
        np.testing.assert_array_equal(reference_draw(logits, key, 1.0, 0, 1e-6), greedy)
        np.testing.assert_array_equal(reference_draw(logits, key, 1.0, 1, 1.0), greedy)
        np.testing.assert_array_equal(reference_draw(logits, key, 0.0, 7, 0.5), greedy)
        assert int(reference_draw(logits, key, 2.0, 5, 1.0)[0]) in order[:5]
        rank = list(order).index(int(reference_draw(logits, key, 1.0, 0, 0.5)[0]))
        assert probs[order[:rank]].sum() < 0.5  # the ids ranked above it hold less than top_p
    # Deterministic for a key; other keys draw differently.
    draws = [int(reference_draw(logits, jax.random.key(i), 1.0, 0, 1.0)[0]) for i in [1, 1, 2, 3, 4]]
    assert draws[0] == draws[1] and len(set(draws)) > 1


def test_tiny_top_p_and_top_k_1_generate_greedily(model):
    graphdef, params = model
    window, prompt = CASES["within_window"]
    run = lambda **kw: sampling.sample(graphdef, params, prompt, window=window, max_new_tokens=NEW_TOKENS,
                                       seed=3, **kw)
    greedy = run(temperature=0.0, top_k=0)
    assert run(temperature=1.5, top_k=0, top_p=1e-6) == greedy
    assert run(temperature=1.5, top_k=1) == greedy


def test_stop_id_ends_generation(model):
    graphdef, params = model
    window, prompt = CASES["within_window"]
    kw = dict(window=window, max_new_tokens=NEW_TOKENS, temperature=0.0, top_k=0, seed=0)
    ids = sampling.sample(graphdef, params, prompt, **kw)
    cut = next(i for i in range(2, NEW_TOKENS) if ids[i] not in ids[:i])  # its first occurrence
    assert sampling.sample(graphdef, params, prompt, stop_id=ids[cut], **kw) == ids[:cut]
    # The loop itself stopped there: nothing was drawn after the stop id.
    tokens = np.zeros((1, window), np.int32)
    tokens[0, :len(prompt)] = prompt
    logits, cache = sampling.prefill(graphdef, params, tokens, np.int32(len(prompt)))
    raw = sampling.decode(graphdef, params, logits, cache, np.int32(len(prompt)), jax.random.key(0),
                          np.float32(0), np.int32(0), np.float32(1), np.int32(ids[cut]),
                          num_samples=1, max_new_tokens=NEW_TOKENS)
    assert np.asarray(raw)[0].tolist() == ids[:cut + 1] + [-1] * (NEW_TOKENS - cut - 1)


def test_decoding_reads_a_circular_pipelines_layer_order():
    """A circular pipeline's training state keeps its stacked layers stage-major (the end-of-run sample decodes
    from it): decoding reads each layer from where it is stored, so it equals the model-order weights."""
    plain = dataclasses.replace(CFG, n_layers=4)
    circular = Layout(pipeline_stages=2, pipeline_microbatches=2, pipeline_schedule="circular", pipeline_repeats=2)
    order = transformer.layer_order(plain, circular)
    assert order == (0, 2, 1, 3)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: transformer.build(plain, seed=0)))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), nnx.to_pure_dict(abstract))
    stored = pipeline_parallel.reorder_layers(params, None, order)
    circular_def = nnx.split(nnx.eval_shape(lambda: transformer.build(plain, seed=0, layout=circular)))[0]
    window, prompt = CASES["within_window"]
    tokens = np.zeros((1, window), np.int32)
    tokens[0, :len(prompt)] = prompt
    want, _ = sampling.prefill(graphdef, params, tokens, np.int32(len(prompt)))
    got, _ = sampling.prefill(circular_def, stored, tokens, np.int32(len(prompt)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    misread, _ = sampling.prefill(graphdef, stored, tokens, np.int32(len(prompt)))  # the order does matter
    assert np.abs(np.asarray(misread) - np.asarray(want)).max() > 1e-3
    kw = dict(window=window, max_new_tokens=NEW_TOKENS, temperature=0.0, top_k=0, seed=0)
    assert sampling.sample(circular_def, stored, prompt, **kw) == sampling.sample(graphdef, params, prompt, **kw)


def test_num_samples_are_seeded_and_differ(model):
    graphdef, params = model
    window, prompt = CASES["within_window"]
    kw = dict(window=window, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, seed=5, num_samples=3)
    first = sampling.generate(graphdef, params, prompt, **kw)
    assert len(first) == 3 and all(len(ids) == NEW_TOKENS for ids in first)
    assert sampling.generate(graphdef, params, prompt, **kw) == first
    assert len({tuple(ids) for ids in first}) == 3
    assert sampling.generate(graphdef, params, prompt, **{**kw, "seed": 6}) != first


@pytest.mark.parametrize("bad, name", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                       (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
                                       (dict(top_k=-1), "top_k"), (dict(max_new_tokens=-1), "max_new_tokens")])
def test_bad_settings_raise(model, bad, name):
    graphdef, params = model
    kw = {**dict(window=32, max_new_tokens=4, temperature=0.0, top_k=0, seed=0), **bad}
    with pytest.raises(ValueError, match=f"^{name}: "):
        sampling.sample(graphdef, params, [1, 2], **kw)
    with pytest.raises(ValueError, match="^prompt: "):
        sampling.sample(graphdef, params, [], window=32, max_new_tokens=4, temperature=0.0, top_k=0, seed=0)


# --- The command line ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_workdir(tiny_config):
    """A 2-step tiny run whose end-of-run sample goes through train.py's call of sampling.sample."""
    from jaxtrain import train

    config = tiny_config(**{"train.steps": 2, "sample.max_new_tokens": 6})
    summary = train.run(config, print_fn=lambda *a, **k: None)
    assert summary["sample"].startswith(config.sample.prompt) and len(summary["sample"]) > len(config.sample.prompt)
    return config.workdir


def run_cli(*args, compilation_cache=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if compilation_cache:  # a second run reuses the first one's executables: same program, seconds less
        env.update(JAX_COMPILATION_CACHE_DIR=str(compilation_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return subprocess.run([sys.executable, "-m", "jaxtrain", "generate", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def test_weights_trained_with_cudnn_attention_restore_on_cpu(trained_workdir, tmp_path):
    """The attention kernel is how the step runs, not the model: a workdir whose config names cuDNN's (a GPU run)
    restores here with XLA's, to the same weights."""
    import json
    import shutil


    copy = tmp_path / "run"
    shutil.copytree(trained_workdir, copy)
    saved = json.loads((copy / "config.json").read_text())
    saved["model"]["attention_impl"] = "cudnn"
    (copy / "config.json").write_text(json.dumps(saved))
    _, model_cfg, _, params = trainer_lib.restore_params(copy)
    _, _, _, want = trainer_lib.restore_params(trained_workdir)
    assert model_cfg.attention_impl == "xla"
    jax.tree.map(np.testing.assert_array_equal, params, want)


def test_cli_prints_prompt_and_continuation_deterministically(trained_workdir, tmp_path):
    args = ["--workdir", trained_workdir, "--prompt", "And God said", "--max_new_tokens", "12",
            "--temperature", "0.9", "--top_k", "40", "--top_p", "0.95", "--seed", "3"]
    first = run_cli(*args, compilation_cache=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("And God said") and len(first.stdout.strip()) > len("And God said")
    second = run_cli(*args, compilation_cache=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout


def assert_one_error_line(stderr, *names):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert all(name in lines[0] for name in names), lines[0]


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
    """A real process: exit code 2 and no traceback. The other bad flags are checked in-process (faster)."""
    missing = str(tmp_path / "nope")
    proc = run_cli("--workdir", missing, "--prompt", "In the beginning")
    assert proc.returncode == 2 and proc.stdout == ""
    assert_one_error_line(proc.stderr, "--workdir", missing)


@pytest.mark.parametrize("args, names", [
    (["--top_p", "0"], ["--top_p"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--top_p", "1.5"], ["--top_p"]),
    (["--top_k", "-2"], ["--top_k"]),
    (["--max_new_tokens", "x"], ["--max_new_tokens"]),
    (["--prompt", ""], ["--prompt"]),
    (["--num_samples", "0"], ["--num_samples"]),
    (["--workdir"], ["--workdir"]),
])
def test_cli_bad_flags_in_process(args, names, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_cli.main(["--workdir", str(tmp_path), "--prompt", "In", *args])
    assert exit_info.value.code == 2
    assert_one_error_line(capsys.readouterr().err, *names)


def test_cli_workdir_without_checkpoint_or_step(trained_workdir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generate_cli.main(["--workdir", str(empty), "--prompt", "In"]) == 2
    assert_one_error_line(capsys.readouterr().err, "config.json")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    (no_ckpt / "config.json").write_text((Path(trained_workdir) / "config.json").read_text())
    assert generate_cli.main(["--workdir", str(no_ckpt), "--prompt", "In"]) == 2
    assert_one_error_line(capsys.readouterr().err, "checkpoint", str(no_ckpt))
    assert generate_cli.main(["--workdir", trained_workdir, "--prompt", "In", "--step", "999"]) == 2
    assert_one_error_line(capsys.readouterr().err, "999")


@pytest.mark.parametrize("global_every", [2, 0], ids=["gemma_like", "every_layer_slides"])
def test_sliding_window_layers_keep_only_their_window_and_decode_as_with_a_full_cache(global_every):
    """With a window shorter than the cache, the sliding layers get a ring of `sliding_window` slots: a padded
    prefill longer or shorter than the window, then 20 tokens past the full cache's own length, give the
    logits of the same model decoding with every layer's keys kept (the masked full-length cache)."""
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32,
                      sliding_window=4, global_every=global_every)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: transformer.build(cfg, 0)))  # as `model`: no eager init
    rng = np.random.default_rng(global_every)
    draw = lambda path, x: jnp.asarray(rng.normal(float(str(getattr(path[-1], "key", "")) == "scale"),  # noqa: E731
                                                  cfg.init_std, x.shape), x.dtype)
    model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract)))
    length = 16
    rings = transformer.init_cache(cfg, 2, length)
    n_local = 2 if global_every else 4
    assert rings["k_local"].shape == (n_local, 2, 4, 1, 8)
    assert rings["k"].shape == ((2, 2, length, 1, 8) if global_every else (1, 2, 1, 1, 8))  # 1: a placeholder
    full = {name: jnp.zeros((4, 2, length, 1, 8)) for name in ("k", "v")}
    decode = jax.jit(lambda tokens, cache, start, last: model.decode(tokens, cache, start, last))
    for prompt_len in (3, 9):
        tokens = rng.integers(1, 64, (2, length)).astype(np.int32)
        tokens[:, prompt_len:] = 0  # padded to the cache length, as sampling.prefill does
        (want, want_cache), (got, got_cache) = (decode(tokens, cache, 0, prompt_len - 1) for cache in (full, rings))
        for i in range(20):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
            token = rng.integers(1, 64, (2, 1)).astype(np.int32)
            want, want_cache = decode(token, want_cache, prompt_len + i, None)
            got, got_cache = decode(token, got_cache, prompt_len + i, None)
