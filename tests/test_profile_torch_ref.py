"""scripts/profile_torch_ref.py puts every op of both profiles in a category: one traced step of a tiny model each,
jaxtrain's from the HLO's stacks and torch's from the profiler's names, and the names torch.compile's kernels get."""

import os
from pathlib import Path
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(str(Path(__file__).resolve().parents[1]), "scripts"))
import bench_step  # noqa: E402
import profile_torch_ref as ptr  # noqa: E402
import torch_llama  # noqa: E402

from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain import trainer as trainer_lib  # noqa: E402
from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.observe import hlo as hlo_lib  # noqa: E402

VOCAB = 512
MAIN = ("layer matmuls", "attention", "head + loss", "optimizer")


def tiny():
    c = base_config()
    c.workdir = "unused"
    c.model.update(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, d_ff=64,
                   tie_embeddings=False, attention_block=16)
    c.train.update(batch_size=2, seq_len=32, steps=10)
    c.optim.update(warmup_steps=2)
    c.data.update(vocab_size=VOCAB)
    return c


def test_both_profiles_fill_every_category():
    cfg = tiny()
    devices = jax.devices()[:1]
    trainer = trainer_lib.build_trainer(cfg, config_lib.validate(cfg, 1), devices=devices)
    state = trainer.init()
    params = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state["params"]))
    batch_np = bench_step.synthetic_batch(cfg)
    batch = trainer_lib.global_batch(batch_np, trainer.batch_sharding)
    hlo_text = trainer.train_step.lower(state, batch).compile().as_text()
    state, _ = trainer.train_step(state, batch)
    frames = ptr.stack_frames(hlo_text)
    assert frames and all(frames.values())
    state, cats, ops = ptr.profile_jax(trainer, state, batch, hlo_text, 1)
    assert all(cats[c] > 0 for c in MAIN), cats
    module = hlo_lib.parse_hlo(hlo_text)
    for _, cat, op, what in ops:  # every matmul lands in a named category, none in "other"
        assert cat in ptr.CATEGORIES or cat.split(": ")[1] in ptr.OTHER_PARTS, (op, cat)
        if what.startswith("matmul"):
            assert not cat.startswith("other"), (op, what, cat)
    assert ptr.hlo_op_category(module, frames, ops[0][2]) == ops[0][1]

    ref = torch_llama.TorchTrainer(cfg, trainer.model_cfg, params)
    tbatch = torch_llama.prepare_batch(batch_np)
    ref.train_step(tbatch)
    cats, _ = ptr.profile_torch(ref, tbatch, 1, VOCAB)
    assert all(cats[c] > 0 for c in MAIN), cats


@pytest.mark.parametrize("name,ancestors,shapes,want", [
    ("aten::mm", ["aten::matmul"], [[2048, 256], [256, 32000]], "head + loss"),
    ("aten::mm", ["MmBackward0"], [[2048, 1024], [1024, 256]], "layer matmuls"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], [], "attention"),
    ("aten::fill_", ["aten::zero_", "aten::zeros", "aten::_scaled_dot_product_flash_attention_for_cpu_backward"],
     [[4, 512, 4, 64], []], "attention"),
    ("aten::_fused_adamw_", ["Optimizer.step#AdamW.step"], [], "optimizer"),
    ("aten::linalg_vector_norm", ["aten::_foreach_norm"], [[32000, 256]], "optimizer"),
    ("aten::_log_softmax", ["aten::log_softmax"], [[2048, 32000]], "head + loss"),
    ("graph_0_cpp_fused__log_softmax_div_mul_nll_loss_forward_sum_view_7", ["## Call CompiledFxGraph x ##"], [],
     "head + loss"),
    ("graph_0_cpp_fused__unsafe_view_add_mean_mul_pow_rsqrt_6", [], [], "other: norms"),
    ("graph_0_cpp_fused_add_arange_cos_div_mul_neg_pow_sin_slice_transpose_5", [], [], "other: rope"),
    ("aten::index_select", ["aten::embedding"], [[32000, 256], [], [2048]], "other: embedding"),
    ("aten::add", [], [[4, 512, 256], [4, 512, 256], []], "other: elementwise, copies"),
])
def test_torch_names(name, ancestors, shapes, want):
    assert ptr.torch_category(name, ancestors, shapes, 32000) == want
