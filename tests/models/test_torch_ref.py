"""The PyTorch reference (scripts/torch_llama.py, timed by scripts/bench_torch_ref.py) trains exactly like jaxtrain:
from the same init, 3 optimizer steps on the same batches give the same losses and the same params."""

import dataclasses
import os
from pathlib import Path
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(str(Path(__file__).resolve().parents[2]), "scripts"))
import torch_llama  # noqa: E402

from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain.config import base_config  # noqa: E402
from jaxtrain import trainer as trainer_lib

VOCAB, B, T = 512, 8, 32


def tiny(tie: bool):
    """conftest's tiny_config sizes, without the prepared corpus (the batches here are synthetic)."""
    c = base_config()
    c.workdir = "unused"
    c.model.update(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64,
                   tie_embeddings=tie)
    c.train.update(batch_size=B, seq_len=T, steps=10)
    # Step 1 runs at lr 0, steps 2 and 3 at lr/2 and lr. The gradient norm is about 0.55, 0.59, 0.69 on
    # these batches: clip_norm 0.6 leaves steps 1-2 alone and clips step 3, so both branches are compared.
    c.optim.update(warmup_steps=2, clip_norm=0.6)
    c.data.update(vocab_size=VOCAB)
    return c


def batches():
    """One document per row (torch takes the is_causal path), then packed rows (documents restart their
    positions; the explicit mask path), then packed rows ending in padding (segment 0)."""
    rng = np.random.default_rng(0)
    out = [{"tokens": rng.integers(2, VOCAB, (B, T), dtype=np.int32), "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()}]
    for padded in (False, True):
        seg = np.zeros((B, T), np.int32)
        pos = np.zeros((B, T), np.int32)
        for r in range(B):
            end = int(rng.integers(T // 2, T)) if padded else T
            cuts = sorted(rng.choice(np.arange(2, end - 1), size=int(rng.integers(1, 4)), replace=False))
            for i, (a, z) in enumerate(zip([0, *cuts], [*cuts, end])):
                seg[r, a:z], pos[r, a:z] = i + 1, np.arange(z - a)
        tokens = np.where(seg > 0, rng.integers(2, VOCAB, (B, T)), 0).astype(np.int32)
        out.append({"tokens": tokens, "segment_ids": seg, "positions": pos})
    return out


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_torch_reference_trains_like_jaxtrain(tie):
    cfg = tiny(tie)
    devices = jax.devices()[:1]  # one device compiles faster; sharding is not what is compared here
    facts = config_lib.validate(cfg, len(devices))
    trainer = trainer_lib.build_trainer(cfg, facts, devices=devices)
    state = trainer.init()
    init = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state["params"]))
    ref = torch_llama.TorchTrainer(cfg, trainer.model_cfg, init)
    assert ref.n_no_decay == (2 * cfg.model.n_layers + 1) * cfg.model.d_model  # only the norm scales

    clipped = []
    data = batches()
    assert torch_llama.prepare_batch(data[0])["mask"] is None and torch_llama.prepare_batch(data[1])["mask"] is not None
    for i, batch in enumerate(data):
        state, m = trainer.train_step(state, trainer_lib.global_batch(batch, trainer.batch_sharding))
        t = ref.train_step(torch_llama.prepare_batch(batch))
        m = jax.device_get(m)
        assert bool(m["finite"]) and t["finite"]
        assert t["lr"] == pytest.approx(float(m["lr"]), rel=1e-6, abs=0), f"step {i + 1}"
        np.testing.assert_allclose(float(t["loss"]), float(m["loss"]), rtol=1e-5, err_msg=f"loss, step {i + 1}")
        np.testing.assert_allclose(float(t["grad_norm"]), float(m["grad_norm"]), rtol=1e-4,
                                   err_msg=f"grad norm, step {i + 1}")
        clipped.append(float(m["grad_norm"]) > cfg.optim.clip_norm)
    assert clipped[1:] == [False, True], clipped  # an unclipped and a clipped update at lr > 0

    ours = torch_llama._flat(jax.device_get(state["params"]))
    theirs = torch_llama._flat(torch_llama.to_jax_layout(ref.model, init))
    assert set(ours) == set(theirs)
    moved = 0.0
    for path in ours:
        np.testing.assert_allclose(theirs[path], np.asarray(ours[path]), rtol=0, atol=1e-4, err_msg=".".join(path))
        moved = max(moved, float(np.abs(np.asarray(ours[path]) - torch_llama._flat(init)[path]).max()))
    assert moved > 1e-3  # the steps really changed the weights (lr 3e-3), so the check above means something


def test_torch_reference_in_bf16_is_autocast_and_tracks_jaxtrain_bf16():
    """model.dtype=bfloat16: torch runs under torch.autocast (bf16 matmuls, f32 params), jaxtrain in its bf16
    compute; the two track each other to bf16 precision and both differ from the f32 run (both really ran bf16)."""
    cfg = tiny(True)
    cfg.model.dtype = "bfloat16"
    devices = jax.devices()[:1]
    facts = config_lib.validate(cfg, len(devices))
    trainer = trainer_lib.build_trainer(cfg, facts, devices=devices)
    state = trainer.init()
    init = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state["params"]))
    ref = torch_llama.TorchTrainer(cfg, trainer.model_cfg, init)
    f32_cfg = tiny(True)
    f32 = torch_llama.TorchTrainer(f32_cfg, config_lib.model_config(f32_cfg, "cpu"), init)
    assert ref.autocast and not f32.autocast
    for i, batch in enumerate(batches()):
        state, m = trainer.train_step(state, trainer_lib.global_batch(batch, trainer.batch_sharding))
        t = ref.train_step(torch_llama.prepare_batch(batch))
        t32 = f32.train_step(torch_llama.prepare_batch(batch))
        np.testing.assert_allclose(float(t["loss"]), float(m["loss"]), rtol=1e-2, err_msg=f"loss, step {i + 1}")
        assert float(t["loss"]) != float(t32["loss"]) and float(m["loss"]) != float(t32["loss"])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        torch_llama.Llama(dataclasses.replace(config_lib.model_config(tiny(True), "cpu"), dtype="float16"))
