"""Training a few steps on synthetic batches, shared by tests/test_parallelism.py; run as a script (in a process
that sees 16 devices) it trains every mesh axis at once and writes what it measured as JSON (not a test module).

argv: OUT_JSON
"""

import json
import sys

import jax
import numpy as np

from jaxtrain import config as config_lib
from jaxtrain import trainer as trainer_lib

MESH_KEYS = ("data", "pipeline", "fsdp", "expert", "sequence", "tensor")


def synthetic_batches(n: int, batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Packed-looking batches: two documents per row (positions restart), the last row ends in padding."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, vocab, (batch, seq_len), dtype=np.int32)
        segment_ids = np.ones((batch, seq_len), np.int32)
        positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1))
        for row, cut in enumerate(rng.integers(4, seq_len - 4, batch)):
            segment_ids[row, cut:] = 2
            positions[row, cut:] -= cut
        segment_ids[-1, -3:] = tokens[-1, -3:] = positions[-1, -3:] = 0
        out.append({"tokens": tokens, "positions": positions, "segment_ids": segment_ids})
    return out


def train_steps(cfg, batches, devices=None):
    """{metric: [per step]} of one train step per batch, from the seed's init."""
    devices = devices or jax.devices()
    facts = config_lib.validate(cfg, len(devices))
    trainer = trainer_lib.build_trainer(cfg, facts, devices=devices)
    state = trainer.init()
    history = {}
    for batch in batches:
        state, metrics = trainer.train_step(state, trainer_lib.global_batch(batch, trainer.batch_sharding))
        for key, value in metrics.items():
            if key in ("loss", "grad_norm") or key.startswith("moe/"):
                history.setdefault(key, []).append(float(value))
    return {k: np.array(v) for k, v in history.items()}


def leaf_errors(got, want) -> dict:
    """{parameter path: max |got - want| / max |want|}."""
    flat_got = dict(jax.tree_util.tree_flatten_with_path(got)[0])
    return {jax.tree_util.keystr(path): float(np.max(np.abs(flat_got[path] - w)) / max(np.max(np.abs(w)), 1e-30))
            for path, w in jax.tree_util.tree_flatten_with_path(want)[0]}


def tiny_config(mesh: dict, **overrides):
    c = config_lib.base_config()
    c.model.update(vocab_size=512, d_model=32, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64)
    c.data.vocab_size = 512
    c.train.update(batch_size=16, seq_len=32, steps=10)
    c.optim.warmup_steps = 0
    c.mesh.update({a: mesh.get(a, 1) for a in MESH_KEYS})
    for key, value in overrides.items():
        group, field = key.split(".")
        c[group][field] = value
    return c


COMBINED = {
    "data2_fsdp2_tensor2_pipeline2": ({"data": 2, "fsdp": 2, "tensor": 2, "pipeline": 2},
                                      {"pipeline.stages": 2, "pipeline.microbatches": 2}),
    "data2_expert2_tensor2_pipeline2": ({"data": 2, "expert": 2, "tensor": 2, "pipeline": 2},
                                        {"model.n_experts": 4, "model.moe_capacity_factor": 1.0,
                                         "pipeline.stages": 2, "pipeline.microbatches": 2}),
}


def main(out_path: str) -> int:
    batches = synthetic_batches(1, 16, 32, 512) * 3  # one batch thrice: the loss must fall
    results = {}
    for name, (mesh, overrides) in COMBINED.items():
        cfg = tiny_config(mesh, **overrides)
        reference = tiny_config({}, **{k: v for k, v in overrides.items() if not k.startswith("pipeline.")})
        got = train_steps(cfg, batches)
        want = train_steps(reference, batches, devices=jax.devices()[:1])
        results[name] = {"devices": jax.device_count(), "mesh": mesh,
                         "metrics": {k: [got[k].tolist(), want[k].tolist()] for k in want}}
        print(name, json.dumps(results[name]), flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
