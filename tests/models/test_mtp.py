"""Multi-token prediction (DeepSeek-V3's, model.mtp_layers): two chained modules on a tiny random DeepSeek-V3 equal
transformers' MtpModel loaded from jaxtrain's export, under DeepSeek's tensor names; their loss equals numpy's
cross-entropy of those logits; packed documents equal each alone; export then import is bit-exact; a run may read
fewer modules than a checkpoint holds; the step minimises the weighted loss and reports it apart."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from helpers import init_params
from test_families import FAMILIES, hf_model, make_hf_dir

from jaxtrain import config as config_lib, objectives, step as step_lib
from jaxtrain.models import hf, layers, transformer
from jaxtrain.models.config import ModelConfig
from jaxtrain.parallel import mesh as mesh_lib

DEPTH, T_LEN = 2, 12


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the jaxtrain config, its params with DEPTH random prediction modules, their export)."""
    tmp = tmp_path_factory.mktemp("mtp")
    config_cls, model_cls, overrides = FAMILIES["deepseek_v3"]
    FAMILIES["mtp"] = (config_cls, model_cls, overrides)  # transformers writes num_nextn_predict_layers=1, no module
    try:
        src = make_hf_dir(tmp / "hf", "mtp")
    finally:
        del FAMILIES["mtp"]
    fields, params = hf.import_dir(src)
    assert fields["mtp_layers"] == 0  # the config's 1 without the module's tensors: none to read
    cfg = ModelConfig(**{**fields, "mtp_layers": DEPTH, "dtype": "float32", "param_dtype": "float32",
                         "loss_chunk_tokens": 0})
    rng = np.random.default_rng(1)
    # Random norms and router bias too (they start at 1 and 0), so that a tensor read into the wrong place shows.
    mtp = jax.tree.map(lambda x: np.asarray(x) + (0.3 * rng.standard_normal(x.shape, np.float32) if x.ndim <= 2
                                                   else 0), init_params(cfg, seed=1)["mtp"])
    params = {**params, "mtp": mtp}
    return cfg, params, hf.export(params, cfg, tmp / "out", max_position_embeddings=128)


def _ours(cfg, params, tokens, positions=None, segment_ids=None):
    """Each module's logits [DEPTH, B, T, vocab], and the model."""
    graphdef, state = transformer.from_params(cfg, jax.tree.map(jnp.asarray, params))
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)) if positions is None else positions
    segment_ids = np.ones((b, t), np.int32) if segment_ids is None else segment_ids

    @jax.jit
    def logits(state, tokens, positions, segment_ids):
        model = nnx.merge(graphdef, state)
        return jax.vmap(model.logits)(model.hidden_and_mtp(tokens, positions, segment_ids)[2])

    return np.asarray(logits(state, tokens, positions, segment_ids)), nnx.merge(graphdef, state)


def test_modules_equal_transformers_mtp_model_loaded_from_the_export(exported):
    from transformers.modeling_layers import MtpModel

    cfg, params, out = exported
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == DEPTH
    main = hf_model(out)
    # transformers finds a checkpoint's modules by DeepSeek-V3's layer 61; this one's follow its 2 layers.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{cfg.n_layers + k}\..*" for k in range(DEPTH)]
    reference = MtpModel.from_pretrained(main).to(torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T_LEN))
    with torch.no_grad():  # module k takes the token k + 1 ahead, and the previous state (the model's normed one)
        h = main(torch.tensor(tokens), output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(T_LEN)[None].expand(2, T_LEN)
        want = []
        for k in range(DEPTH):
            ids = torch.tensor(layers.ahead(tokens, k + 1))
            h = reference.forward_layer(k, h, positions, None, input_ids=ids)
            want.append(reference._project_to_logits(h).numpy())
    got, model = _ours(cfg, params, tokens.astype(np.int32))
    for k in range(DEPTH):  # a position past T - k - 1 looks ahead past the row: not a prediction
        np.testing.assert_allclose(got[k][:, :T_LEN - k - 1], want[k][:, :T_LEN - k - 1], atol=1e-4, rtol=1e-4)

    # The loss: module k's cross-entropy of the token k + 2 ahead, summed, averaged over the modules (numpy).
    batch = {"tokens": tokens.astype(np.int32), "positions": np.asarray(positions, np.int32),
             "segment_ids": np.ones((2, T_LEN), np.int32)}
    ce, count, aux = jax.jit(objectives.loss_terms, static_argnums=0)(*nnx.split(model), batch)
    per_module = []
    for k in range(DEPTH):
        logits = want[k][:, :T_LEN - k - 2].astype(np.float64)
        log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        target = tokens[:, k + 2:]
        per_module.append(np.sum(log_z - np.take_along_axis(logits, target[..., None], -1)[..., 0]))
    np.testing.assert_allclose(float(aux[objectives.MTP_LOSS]), np.mean(per_module), rtol=1e-5)
    assert float(count) == 2 * (T_LEN - 1)  # the main head's count

    # Export then import: bit-exact, the modules included; their copies of the embedding and head are the model's.
    fields, back = hf.import_dir(out)
    assert fields["mtp_layers"] == DEPTH
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_packed_documents_equal_each_alone_and_look_ahead_within_their_own(exported):
    cfg, params, _ = exported
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, T_LEN)).astype(np.int32)
    cut = 7
    positions = np.concatenate([np.arange(cut), np.arange(T_LEN - cut)])[None].astype(np.int32)
    segments = np.array([[1] * cut + [2] * (T_LEN - cut)], np.int32)
    packed, model = _ours(cfg, params, tokens, positions, segments)
    for lo, hi in ((0, cut), (cut, T_LEN)):
        alone, _ = _ours(cfg, params, tokens[:, lo:hi])
        for k in range(DEPTH):  # positions whose look-ahead stays inside the document
            np.testing.assert_allclose(packed[k][:, lo:hi - k - 1], alone[k][:, :hi - lo - k - 1], atol=1e-5)
    targets, weights = objectives.next_token_targets({"tokens": tokens, "segment_ids": segments}, 3)  # module 1's
    assert np.asarray(weights).tolist() == [[1.0] * (cut - 3) + [0.0] * 3 + [1.0] * (T_LEN - cut - 3) + [0.0] * 3]
    np.testing.assert_array_equal(np.asarray(targets)[0, :T_LEN - 3], tokens[0, 3:])


def test_a_run_reads_fewer_modules_than_the_checkpoint_holds_never_more(exported):
    cfg, params, out = exported
    fields, one = hf.import_dir(out, mtp_layers=1)
    assert fields["mtp_layers"] == 1
    np.testing.assert_array_equal(one["mtp"]["eh_proj"], params["mtp"]["eh_proj"][:1])
    fewer = ModelConfig(**{**fields, "dtype": "float32", "param_dtype": "float32"})
    hf.check_fields(hf.read_config(out), fewer, out)  # 1 of the 2: allowed
    assert set(hf.load_params(out, fewer)) == set(params)
    with pytest.raises(hf.HFMismatch, match="mtp_layers"):
        hf.check_fields(hf.read_config(out), ModelConfig(**{**fields, "mtp_layers": 3}), out)


def test_the_step_minimises_the_weighted_loss_and_reports_it_apart(exported):
    """One SGD step (learning rate 1): every weight moves by the next-token loss's gradient plus mtp_loss_weight
    times the modules' loss's; "loss" is the next-token cross-entropy alone and mtp/loss the modules' (numpy-checked
    above), each per scored token."""
    cfg, params, _ = exported
    model = nnx.merge(*transformer.from_params(cfg, jax.tree.map(jnp.asarray, params)))
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, T_LEN)).astype(np.int32)
    batch = {"tokens": tokens, "positions": np.tile(np.arange(T_LEN, dtype=np.int32), (2, 1)),
             "segment_ids": np.ones((2, T_LEN), np.int32)}
    mesh = mesh_lib.make_mesh({}, devices=jax.devices()[:1])
    rules = mesh_lib.resolve_rules("dp")

    fn = step_lib.make_train_step(graphdef, optax.sgd(1.0), lambda _: 1.0, 1, mesh, rules, mtp_weight=0.3)
    new, metrics = jax.jit(fn)({"step": jnp.int32(0), "params": state, "opt_state": optax.sgd(1.0).init(state)},
                               batch)
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), state, new["params"])

    @jax.jit
    def reference(p):
        terms = lambda p: objectives.loss_terms(graphdef, p, batch)  # noqa: E731
        main = jax.grad(lambda p: terms(p)[0] / terms(p)[1])(p)
        mtp = jax.grad(lambda p: terms(p)[2][objectives.MTP_LOSS] / terms(p)[1])(p)
        return main, mtp, terms(p)

    main, mtp, (ce, count, aux) = reference(state)
    want = jax.tree.map(lambda a, b: np.asarray(a) + 0.3 * np.asarray(b), main, mtp)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4), moved, want)
    assert np.abs(np.asarray(mtp["mtp"]["eh_proj"])).max() > 1e-3  # the modules train, from their loss alone
    assert not any(np.asarray(g).any() for g in jax.tree.leaves(main["mtp"]))
    np.testing.assert_allclose(float(metrics["loss"]), float(ce / count), rtol=1e-6)
    np.testing.assert_allclose(float(metrics[objectives.MTP_LOSS]), float(aux[objectives.MTP_LOSS] / count),
                               rtol=1e-6)


@pytest.mark.parametrize("setting, field, reason", [
    ({"mtp_layers": -1}, "mtp_layers", "must be a non-negative integer, got -1"),
    ({"mtp_layers": 1, "mtp_loss_weight": -0.5}, "mtp_loss_weight", "must be >= 0"),
    ({"mtp_layers": 1, "lora_rank": 4}, "mtp_layers", "do not train under LoRA"),
    ({"mtp_layers": 1, "sliding_window": 8}, "mtp_layers", "do not combine with sliding windows"),
    ({"mtp_layers": 1, "pipeline": 2}, "mtp_layers", "do not run in a pipeline yet"),
    ({"mtp_layers": 1}, None, None),
])
def test_bad_settings_are_named_at_config_time(setting, field, reason):
    cfg = config_lib.base_config()
    if stages := setting.pop("pipeline", 0):
        cfg.pipeline.update(stages=stages)
        cfg.mesh.update(pipeline=stages, data=-1)
    cfg.model.update(**setting)
    if field is None:
        config_lib.validate(cfg, 1)
        return
    with pytest.raises(config_lib.ConfigError, match=f"^model.{field}: .*{reason}"):
        config_lib.validate(cfg, stages or 1)
