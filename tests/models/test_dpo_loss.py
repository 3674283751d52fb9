"""DPO's loss: equal to numpy and to TRL's on the same log-probs; the pair sums of packed rows; the chunked token
log-probs equal the plain head's, gradients too; and a step's loss on packed pairs equals numpy over each
sequence run alone, with the reference the frozen start (an explicit copy, or LoRA's base with adapters off)."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import objectives, step as step_lib
from jaxtrain.errors import ConfigError
from jaxtrain.models import cross_entropy, dpo, lora, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.parallel import mesh as mesh_lib


def _numpy_loss(pc, pr, rc, rr, beta, smoothing):
    m = beta * ((pc - rc) - (pr - rr))
    log_sig = lambda z: -np.logaddexp(0.0, -z)  # noqa: E731
    return -(1 - smoothing) * log_sig(m) - smoothing * log_sig(-m)


@pytest.fixture(scope="module")
def log_probs():
    rng = np.random.default_rng(0)
    return [rng.normal(-40, 8, 64) for _ in range(4)]  # policy chosen/rejected, reference chosen/rejected


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_loss_equals_numpy(log_probs, beta, smoothing):
    loss, chosen, rejected = dpo.losses(*map(jnp.asarray, log_probs), beta, smoothing)
    np.testing.assert_allclose(loss, _numpy_loss(*log_probs, beta, smoothing), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chosen, beta * (log_probs[0] - log_probs[2]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rejected, beta * (log_probs[1] - log_probs[3]), rtol=1e-5, atol=1e-5)


def _trl_loss(log_probs, beta, smoothing):
    """TRL's DPOTrainer._compute_loss on given sequence log-probs (precomputed reference), and its metrics. The
    label-smoothed (cDPO) form is TRL's `aot` loss, which on a single pair is exactly that."""
    torch = pytest.importorskip("torch")
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    pc, pr, rc, rr = (torch.tensor(x, dtype=torch.float64) for x in log_probs)
    n = len(pc)
    per_token = torch.zeros(2 * n, 3, dtype=torch.float64)
    per_token[:, 0] = torch.cat([pc, pr])  # the batch is [chosen..., rejected...]; TRL sums over tokens
    outputs = types.SimpleNamespace(log_probs=per_token, entropy=torch.zeros(2 * n, 3),
                                    mean_logits=torch.zeros(2 * n, 3), is_top1=torch.zeros(2 * n, 3, dtype=torch.bool))
    inputs = {"input_ids": torch.zeros(2 * n, 4, dtype=torch.long), "attention_mask": torch.ones(2 * n, 4),
              "completion_mask": torch.ones(2 * n, 4, dtype=torch.long), "ref_chosen_logps": rc,
              "ref_rejected_logps": rr}
    same = lambda x: x  # noqa: E731
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=types.SimpleNamespace(
            device="cpu", gather=same, gather_for_metrics=same, unwrap_model=same),
        aux_loss_enabled=False, precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl",
        loss_types=["aot" if smoothing else "sigmoid"], loss_weights=[1.0], beta=beta, label_smoothing=smoothing,
        use_weighting=False, _metrics={"train": collections.defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("beta,smoothing", [(0.1, 0.0), (0.5, 0.2)])
def test_loss_and_metrics_equal_trl(log_probs, beta, smoothing):
    pairs = range(len(log_probs[0])) if smoothing else [slice(None)]  # aot sorts across a batch: one pair a call
    for pair in pairs:
        given = [np.atleast_1d(x[pair]) for x in log_probs]
        trl_loss, trl_metrics = _trl_loss(given, beta, smoothing)
        segments = np.repeat(np.arange(1, 2 * len(given[0]) + 1), 1)[None]  # one token per sequence, one row
        policy = np.stack([given[0], given[1]], 1).reshape(1, -1)
        reference = np.stack([given[2], given[3]], 1).reshape(1, -1)
        loss, metrics = dpo.batch_terms(jnp.asarray(policy), jnp.asarray(reference), jnp.asarray(segments), beta,
                                        smoothing)
        count = len(given[0])
        np.testing.assert_allclose(float(loss) / count, trl_loss, rtol=1e-5)
        for ours, theirs in (("margin", "rewards/margins"), ("accuracy", "rewards/accuracies"),
                             ("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
                             ("logp_chosen", "logps/chosen"), ("logp_rejected", "logps/rejected")):
            np.testing.assert_allclose(float(metrics[f"dpo/{ours}"]) / count, trl_metrics[theirs], rtol=1e-5,
                                       atol=1e-6, err_msg=ours)


def test_pair_sums_of_packed_rows():
    # Row 0: pairs (3 + 2 tokens) and (1 + 4), then padding; row 1: one pair filling the row.
    seg = np.array([[1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 0, 0], [1] * 5 + [2] * 7])
    values = np.random.default_rng(0).normal(size=seg.shape)
    chosen, rejected, is_pair = jax.device_get(dpo.pair_sums(jnp.asarray(values), jnp.asarray(seg)))
    assert chosen.shape == (2, 6) and is_pair.tolist() == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    for row in range(2):
        for j in range(int(is_pair[row].sum())):
            np.testing.assert_allclose(chosen[row, j], values[row][seg[row] == 2 * j + 1].sum(), rtol=1e-6)
            np.testing.assert_allclose(rejected[row, j], values[row][seg[row] == 2 * j + 2].sum(), rtol=1e-6)
    assert float(dpo.count_pairs(jnp.asarray(seg))) == 3


def test_config_is_checked():
    for field, value in (("beta", 0.0), ("beta", "x"), ("label_smoothing", 0.5), ("label_smoothing", -0.1)):
        d = types.SimpleNamespace(**{**dpo.CONFIG, field: value})
        with pytest.raises(ConfigError, match=f"dpo.{field}"):
            dpo.check_config(d)


def test_chunked_token_log_probs_equal_the_plain_head():
    k = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k[0], (2, 16, 8)), jax.random.normal(k[1], (8, 40))
    targets = jax.random.randint(k[2], (2, 16), 0, 40)
    cot = jax.random.normal(k[0], (2, 16))

    def plain(x, w):
        return jnp.take_along_axis(jax.nn.log_softmax(x @ w), targets[..., None], -1)[..., 0]

    with mesh_lib.activation_sharding(mesh_lib.make_mesh({"data": 1}, jax.devices()[:1]), mesh_lib.resolve_rules("dp")):
        chunked = lambda x, w: cross_entropy.token_log_probs(x, w, targets, 8, jnp.float32)  # noqa: E731
        np.testing.assert_allclose(chunked(x, w), plain(x, w), rtol=1e-5, atol=1e-5)
        grads = [jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) * cot), argnums=(0, 1))(x, w) for f in (chunked, plain)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


CFG = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=32, dtype="float32")


def _sequence_log_probs(graphdef, params, sequences, t):
    """Each sequence's weighted log-prob with the sequence run alone (its own row from position 0; causal, so the
    padding after it does not matter), in numpy from the model's logits."""
    tokens = np.zeros((len(sequences), t), np.int32)
    for row, (ids, _) in enumerate(sequences):
        tokens[row, :len(ids)] = ids
    positions = np.broadcast_to(np.arange(t), tokens.shape)
    logits = np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, positions, np.ones_like(tokens)))(params),
                        np.float64)
    top = logits.max(-1, keepdims=True)
    log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return np.array([sum(log_softmax[row, i, ids[i + 1]] * w[i + 1] for i in range(len(ids) - 1))
                     for row, (ids, w) in enumerate(sequences)])


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("adapters", [False, True])
def test_step_loss_equals_numpy_over_sequences_run_alone(chunk, adapters):
    """Two packed rows of pairs; the policy has moved from the reference. The loss the eval step computes (and
    the train step reports) equals numpy's over each sequence run on its own."""
    adapter_settings = dict(lora_rank=4, lora_targets="q,v,down") if adapters else {}
    cfg = ModelConfig(**CFG, loss_chunk_tokens=chunk, **adapter_settings)
    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: transformer.build(cfg, 0)))
    noise = np.random.default_rng(1)
    normal = lambda shape, scale: (scale * noise.normal(size=shape)).astype(np.float32)  # noqa: E731
    # Random weights (compiling the model's init costs more than this whole test); B = 0 as LoRA starts.
    start = jax.tree_util.tree_map_with_path(
        lambda path, x: np.zeros(x.shape, np.float32) if str(path[-1].key).endswith("_lora_b")
        else normal(x.shape, 0.3),
        nnx.to_pure_dict(shapes))
    moved = jax.tree.map(lambda p: p + normal(p.shape, 0.05), start)
    if adapters:  # the reference is the base: only the adapters move
        moved = lora.join(lora.split(moved)[0], lora.split(start)[1])
    rng = np.random.default_rng(0)
    lengths = [[(5, 4), (3, 6)], [(7, 8)]]  # (chosen, rejected) tokens per pair, per row
    t, rows, sequences = 24, [], []
    for row in lengths:
        tok, seg, pos, wts = (np.zeros(t, np.int32) for _ in range(4))
        at, s = 0, 1
        for pair in row:
            for n in pair:
                ids, w = rng.integers(0, 64, n), (np.arange(n) >= 2).astype(np.int32)  # the first 2: the prompt
                tok[at:at + n], seg[at:at + n], pos[at:at + n], wts[at:at + n] = ids, s, np.arange(n), w
                sequences.append((ids, w))
                at, s = at + n, s + 1
        rows.append((tok, seg, pos, wts))
    batch = {k: jnp.asarray(np.stack([r[i] for r in rows])) for i, k in
             enumerate(("tokens", "segment_ids", "positions", "loss_weights"))}

    beta, smoothing = 0.3, 0.1
    policy, reference = (_sequence_log_probs(graphdef, p, sequences, t) for p in (moved, start))
    expected = _numpy_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta, smoothing).mean()

    mesh = mesh_lib.make_mesh({"data": 1}, jax.devices()[:1])
    rules = mesh_lib.resolve_rules("dp")
    loss = objectives.dpo_loss(beta, smoothing)
    eval_step = jax.jit(step_lib.make_eval_step(graphdef, mesh, rules, loss, lora=adapters, reference=True))
    loss_sum, count, metrics = eval_step(moved, lora.split(start)[0] if adapters else start, batch)
    assert float(count) == 3
    np.testing.assert_allclose(float(loss_sum) / 3, expected, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["dpo/logp_chosen"]) / 3, policy[0::2].mean(), rtol=2e-5)
