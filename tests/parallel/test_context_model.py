"""model.context_parallel wired into the model and the step, on 8 fake CPU devices (conftest): ring (sequence 8;
data 2 x sequence 4, zigzag layout), Ulysses (data 2 x sequence 4) and USP (sequence 8: the ring across 2 groups of
Ulysses 4, zigzag over the ring) attention train like one device, loss and gradient norm of each of 3 steps within
1e-5 in f32 (steps 2 and 3 start from the updated weights, so the gradients agree too), on packed rows whose
documents cross the shard borders, with layers that alternate a sliding window and global attention. Under ring and
USP the compiled step passes K/V blocks and gathers no float array; bad heads, sequence lengths, kernels and
combinations are refused by the config's validation, naming the field."""

import re

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import trainer as trainer_lib
from jaxtrain.errors import ConfigError
from parallel_worker import MESH_KEYS

B, T = 8, 64
# Documents per row (the rest padding): shards are 8 (sequence 8) or 16 (sequence 4) tokens, zigzag chunks half that.
DOCS = ([5, 13, 9, 20, 11], [30, 3, 27], [64], [7, 7, 7, 7, 7, 7, 7, 7, 7], [40, 24], [1, 2, 3, 50], [17, 33],
        [12, 12, 12, 12])


def packed_batches(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
        for row, lengths in enumerate(DOCS):
            at = 0
            for i, length in enumerate(lengths):
                seg[row, at:at + length], pos[row, at:at + length] = i + 1, np.arange(length)
                at += length
        tokens = np.where(seg > 0, rng.integers(1, vocab, (B, T), dtype=np.int32), 0)
        out.append({"tokens": tokens, "positions": pos, "segment_ids": seg})
    return out


def configure(tiny_config, mesh: dict, **model):
    mesh = {"data": -1, **{a: 1 for a in MESH_KEYS if a != "data"}, **mesh}
    return tiny_config(**{**{f"mesh.{a}": n for a, n in mesh.items()}, "optim.warmup_steps": 0,
                          "train.seq_len": T, "train.batch_size": B, **{f"model.{k}": v for k, v in model.items()}})


def run(cfg, batches, devices=None):
    """({"loss", "grad_norm"}: per step, from the seed's init; the compiled step's HLO text)."""
    devices = devices or jax.devices()
    trainer = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, len(devices)), devices=devices)
    global_batches = [trainer_lib.global_batch(b, trainer.batch_sharding) for b in batches]
    step = trainer.train_step.lower(trainer.abstract_state, global_batches[0]).compile()
    state, history = trainer.init(), {"loss": [], "grad_norm": []}
    for batch in global_batches:
        state, metrics = step(state, batch)
        for key in history:
            history[key].append(float(metrics[key]))
    return {k: np.array(v) for k, v in history.items()}, step.as_text()


_REFERENCE = {}


def one_device(tiny_config, batches):
    """The same model on one device, where every mode is the plain attention: one run for all the cases."""
    if not _REFERENCE:
        _REFERENCE.update(run(configure(tiny_config, {"data": 1}, **WINDOW), batches, jax.devices()[:1])[0])
    return _REFERENCE


# Layer 0 attends through a 12-token window, layer 1 globally: the window is picked per layer, and both kinds run.
WINDOW = {"sliding_window": 12, "global_every": 2}
CASES = {  # id: (mesh, mode, other model fields)
    "ring_sequence8": ({"sequence": 8}, "ring", {}),
    "ring_data2_sequence4": ({"data": 2, "sequence": 4}, "ring", {}),
    "ulysses_data2_sequence4": ({"data": 2, "sequence": 4}, "ulysses", {}),
    # The ring across 2 groups of 4 (zigzag over the 2), Ulysses within each: 2 of the 8 heads, 1 of the 4 KV heads.
    "usp_sequence8_ring2_ulysses4": ({"sequence": 8}, "usp", {"ulysses_ways": 4}),
}


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_trains_like_one_device(tiny_config, case):
    mesh, mode, fields = CASES[case]
    cfg = configure(tiny_config, mesh, context_parallel=mode, **WINDOW, **fields)
    batches = packed_batches(3, cfg.model.vocab_size)
    got, hlo = run(cfg, batches)
    want = one_device(tiny_config, batches)
    assert want["loss"][-1] < want["loss"][0]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    m = cfg.model
    ways = fields.get("ulysses_ways", 1)
    rows, block = B // mesh.get("data", 1), T // mesh["sequence"] * ways
    if mode != "ulysses":  # K/V blocks go round the ring; nothing but int fields (segment ids, positions) is gathered
        moved = re.findall(r"= (\S+) (all-gather|collective-permute)(?:-start)?\(", hlo)
        assert any(kind == "collective-permute" and shape.startswith(f"f32[{rows},{block},{m.n_kv_heads // ways},")
                   for shape, kind in moved), moved
        assert all(shape.startswith(("s32[", "(s32[")) for shape, kind in moved if kind == "all-gather"), moved
    if mode != "ring":  # the heads traded for the sequence and back
        assert hlo.count(" all-to-all(") >= 2


@pytest.mark.parametrize("overrides, field", [
    ({"mesh.sequence": 8, "model.context_parallel": "ulysses"}, "model.n_kv_heads"),  # 4 KV heads over 8
    ({"mesh.sequence": 4, "model.context_parallel": "ulysses", "model.n_heads": 6, "model.n_kv_heads": 2},
     "model.n_heads"),
    ({"mesh.sequence": 8, "model.context_parallel": "ring", "train.seq_len": 72}, "train.seq_len"),
    ({"mesh.sequence": 4, "model.context_parallel": "ring", "model.attn_softcap": 50.0}, "model.context_parallel"),
    ({"mesh.sequence": 8, "model.context_parallel": "usp", "model.ulysses_ways": 3}, "model.ulysses_ways"),
    ({"mesh.sequence": 8, "model.context_parallel": "usp", "model.ulysses_ways": 8}, "model.n_kv_heads"),
    ({"mesh.sequence": 4, "model.context_parallel": "usp", "model.mtp_layers": 1}, "model.context_parallel"),
    # cuDNN's kernel is for K/V gathered whole; the ring's steps take pallas's.
    ({"mesh.sequence": 4, "model.context_parallel": "ring", "model.attention_impl": "cudnn"}, "model.attention_impl"),
    ({"mesh.sequence": 8, "model.context_parallel": "usp", "model.attention_impl": "cudnn"}, "model.attention_impl"),
])
def test_bad_context_parallel_settings_name_the_field(tiny_config, overrides, field):
    cfg = tiny_config(**{"mesh.data": -1, "train.seq_len": T, **overrides})
    with pytest.raises(ConfigError, match=re.escape(field) + ":"):
        config_lib.validate(cfg, 8)


@pytest.mark.parametrize("overrides, backend, message", [
    ({}, "gpu", None),
    ({}, "cpu", "model.attention_impl: pallas runs on GPUs and TPUs only"),
    ({"model.head_dim": 8}, "gpu", "model.attention_impl: pallas's GPU flash kernels need model.head_dim in 16, 32,"),
    ({"model.head_dim": 64, "train.seq_len": 512}, "tpu", None),
    ({"model.head_dim": 32, "train.seq_len": 512}, "tpu",
     "model.attention_impl: pallas's TPU flash kernels need model.head_dim in 64, 128, 256, got 32"),
    ({"model.head_dim": 64, "train.seq_len": 256}, "tpu",
     "train.seq_len: 256 gives ring blocks of 64 tokens (4 ring members); pallas's TPU flash kernels need a "
     "multiple of 128"),
    ({"mesh.sequence": 8, "train.seq_len": 96}, "gpu", "train.seq_len: 96 gives ring blocks of 12 tokens"),
    ({"mesh.sequence": 8, "model.context_parallel": "usp", "model.ulysses_ways": 2, "train.seq_len": 96}, "gpu",
     "train.seq_len: 96 gives ring blocks of 24 tokens"),
    ({"model.context_parallel": "allgather"}, "gpu", "model.attention_impl: pallas runs the steps of ring"),
], ids=["ok", "cpu", "head_dim", "tpu_ok", "tpu_head_dim", "tpu_ring_block", "ring_block", "usp_block",
        "allgather"])
def test_the_ring_kernel_s_settings_are_checked_before_anything_compiles(tiny_config, overrides, backend, message):
    """model.attention_impl=pallas (jaxtrain.models.gpu_flash, tpu_flash): GPUs and TPUs only, a head_dim their
    tiles take, ring blocks (seq_len over the ring's members) a multiple of the smallest tile (16 on GPUs, 128 on
    TPUs), and a ring to run in."""
    cfg = tiny_config(**{"mesh.data": -1, "mesh.sequence": 4, "train.seq_len": T, "model.context_parallel": "ring",
                         "model.attention_impl": "pallas", "model.head_dim": 16, **overrides})
    if message is None:
        config_lib.validate(cfg, 8, backend=backend)
        return
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        config_lib.validate(cfg, 8, backend=backend)
