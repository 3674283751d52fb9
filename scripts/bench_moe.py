"""Train-step throughput of a mixture of experts: capacity routing against dropless routing, in one process.

    python scripts/bench_moe.py [--config configs/bench_cpu.py] [--experts 8] [--top_k 2] [--expert_d_ff 512]
                                [--capacity_factor 1.25] [--steps 3] [--gathered] [--tokamax] [--all_to_all]
                                [--dispatch_capacity 0]

The config's MLPs become `--experts` experts of width `--expert_d_ff`, each token routed to its top `--top_k`
(the defaults keep a token's active MLP width at bench_cpu's 1024). The model is built with `model.moe_routing`
"capacity" and "dropless", and each jitted train step is timed on scripts/bench_step.py's synthetic batch: a
compile and a warm step each, then `--steps` steps of each in turn (a change in the machine's load hits all),
medians. `--gathered` adds "dropless_gathered", dropless with `moe.per_shard` made the identity while it compiles,
so XLA gathers every token onto every device; run it on a mesh, e.g.
XLA_FLAGS=--xla_force_host_platform_device_count=8 ... --config.mesh.data=8 --config.train.batch_size=8.
`--tokamax` adds "dropless_tokamax" (`model.moe_kernel=tokamax`; on CPU its XLA fallback, so there it measures
only the wrapper's cost). `--all_to_all` adds "dropless_all_to_all" (`model.moe_dispatch=all_to_all`: each routed
row sent to its expert's device and back; run it on a mesh with an expert axis), its receive buffer bounded by
`--dispatch_capacity` (model.moe_dispatch_capacity; 0 = the worst case). Ends with one JSON line, e.g.
{"capacity": {"tokens_per_sec": ..., ...}, "dropless": {...}, "dropless_over_capacity": ...}
"""

import json
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import warm_trainer  # the same batch and warm-up as the dense benchmark


def moe_config(base, name: str):
    """The config of a run: "capacity", "dropless", "dropless_gathered" or "dropless_tokamax"."""
    cfg = base.copy_and_resolve_references()
    cfg.model.update(n_experts=_EXPERTS.value, moe_top_k=_TOP_K.value, d_ff=_EXPERT_D_FF.value,
                     moe_capacity_factor=_CAPACITY_FACTOR.value, moe_routing=name.split("_")[0],
                     moe_kernel="tokamax" if name == "dropless_tokamax" else "xla",
                     moe_dispatch="all_to_all" if name == "dropless_all_to_all" else "gather",
                     moe_dispatch_capacity=_DISPATCH_CAPACITY.value if name == "dropless_all_to_all" else 0.0)
    return cfg


def main(argv):
    del argv
    import jax
    import numpy as np

    from jaxtrain.models import moe

    base = _CONFIG.value
    runs = {}
    names = ("capacity", "dropless", *(["dropless_gathered"] if _GATHERED.value else []),
             *(["dropless_tokamax"] if _TOKAMAX.value else []), *(["dropless_all_to_all"] if _ALL_TO_ALL.value else []))
    for name in names:
        per_shard = moe.per_shard
        if name == "dropless_gathered":  # the step compiles (and is warmed) inside warm_trainer
            moe.per_shard = lambda fn, *args, **kwargs: fn
        try:
            trainer, state, batch, _, startup_s = warm_trainer(moe_config(base, name))
        finally:
            moe.per_shard = per_shard
        runs[name] = {"trainer": trainer, "state": state, "batch": batch, "times": [],
                      "startup_to_warm_s": startup_s}
    # The two steps alternate, so that a change in the machine's load (other processes) hits both alike.
    for _ in range(_STEPS.value):
        for run in runs.values():
            t = time.perf_counter()
            run["state"], run["metrics"] = run["trainer"].train_step(run["state"], run["batch"])
            jax.block_until_ready(run["metrics"])
            run["times"].append(time.perf_counter() - t)

    tokens = base.train.batch_size * base.train.seq_len
    result = {}
    for routing, run in runs.items():
        step_s = float(np.median(run["times"]))
        result[routing] = r = {"step_ms": 1e3 * step_s, "tokens_per_sec": tokens / step_s,
                               "startup_to_warm_s": run["startup_to_warm_s"], "loss": float(run["metrics"]["loss"]),
                               "dropped_fraction": float(run["metrics"]["moe/dropped_fraction"])}
        print(f"{routing:>17}: step {r['step_ms']:.1f} ms (median of {_STEPS.value}) | "
              f"{r['tokens_per_sec']:,.0f} tok/s "
              f"| dropped {100 * r['dropped_fraction']:.1f}% | warm after {r['startup_to_warm_s']:.0f} s",
              file=sys.stderr)
    ratio = result["dropless"]["tokens_per_sec"] / result["capacity"]["tokens_per_sec"]
    dtype = runs["dropless"]["trainer"].model_cfg.dtype
    print(f"dropless / capacity tokens/s: {ratio:.2f} ({jax.device_count()} {jax.devices()[0].device_kind} "
          f"device(s), {dtype})", file=sys.stderr)
    if "dropless_gathered" in result:
        result["dropless_over_gathered"] = (result["dropless"]["tokens_per_sec"] /
                                            result["dropless_gathered"]["tokens_per_sec"])
        print(f"dropless / dropless gathered onto every device: {result['dropless_over_gathered']:.2f}",
              file=sys.stderr)
    if "dropless_tokamax" in result:
        result["tokamax_over_xla"] = (result["dropless_tokamax"]["tokens_per_sec"] /
                                      result["dropless"]["tokens_per_sec"])
        print(f"dropless with tokamax's ragged_dot / with XLA's: {result['tokamax_over_xla']:.2f}", file=sys.stderr)
    if "dropless_all_to_all" in result:
        result["all_to_all_over_gather"] = (result["dropless_all_to_all"]["tokens_per_sec"] /
                                            result["dropless"]["tokens_per_sec"])
        print(f"dropless by all-to-all / gathered along expert: {result['all_to_all_over_gather']:.2f}",
              file=sys.stderr)
    print(json.dumps({**result, "dropless_over_capacity": ratio, "config": base.workdir, "experts": _EXPERTS.value,
                      "top_k": _TOP_K.value, "expert_d_ff": _EXPERT_D_FF.value,
                      "capacity_factor": _CAPACITY_FACTOR.value, "dispatch_capacity": _DISPATCH_CAPACITY.value,
                      "devices": jax.device_count(),
                      "device_kind": jax.devices()[0].device_kind, "dtype": dtype}))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=True)
    _EXPERTS = flags.DEFINE_integer("experts", 8, "Experts per MoE layer.")
    _TOP_K = flags.DEFINE_integer("top_k", 2, "Experts per token.")
    _EXPERT_D_FF = flags.DEFINE_integer("expert_d_ff", 512, "Each expert's hidden width (model.d_ff).")
    _CAPACITY_FACTOR = flags.DEFINE_float("capacity_factor", 1.25, "Capacity routing's model.moe_capacity_factor.")
    _STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per routing (after 2 warm-up steps each).")
    _GATHERED = flags.DEFINE_bool("gathered", False, "Also time dropless without the per-shard sort.")
    _TOKAMAX = flags.DEFINE_bool("tokamax", False, "Also time dropless with model.moe_kernel=tokamax.")
    _ALL_TO_ALL = flags.DEFINE_bool("all_to_all", False, "Also time dropless with model.moe_dispatch=all_to_all.")
    _DISPATCH_CAPACITY = flags.DEFINE_float("dispatch_capacity", 0.0, "all_to_all's model.moe_dispatch_capacity.")
    app.run(main)
