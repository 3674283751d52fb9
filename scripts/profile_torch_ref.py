"""Where jaxtrain's train step and its PyTorch twin spend their time, by category, in one run.

    python scripts/profile_torch_ref.py [--config configs/bench_cpu.py] [--rounds 3] [--steps 2] [--top 0]
    python scripts/profile_torch_ref.py --config.model.dtype=bfloat16   # torch under torch.autocast
    python scripts/profile_torch_ref.py --rounds 8 --xla_option ynn_off=xla_cpu_experimental_ynn_fusion_type:

jaxtrain: a jax.profiler trace summed per compiled op by jaxtrain.observe.profiling, each op categorised by the
Python stack in the HLO metadata (cross_entropy.py: head + loss, attention.py: attention, optax / optim.py:
optimizer, other dots: layer matmuls). torch (scripts/torch_llama.py eager, and torch.compile with inductor's
kernel profiling): torch.profiler's self CPU time per op, by its name, its ancestors' names and input shapes.
Each round profiles --steps steps of each in turn and times one unprofiled step of each; figures are medians
over the rounds, a ratio (torch / jaxtrain ms, > 1: jaxtrain faster) the median of the per-round ratios.
Prints the CPU model and ISA flags, the tables on stderr, then one JSON line. --xla_option NAME=KEY:VALUE;...
(repeatable) instead times jaxtrain's step compiled with those XLA options against the default, interleaved.
"""

import collections
import json
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402  (scripts/ is not a package)
from jaxtrain.observe import hlo as hlo_lib  # noqa: E402

CATEGORIES = ("layer matmuls", "attention", "head + loss", "optimizer", "other")
OTHER_PARTS = ("norms", "rope", "embedding", "elementwise, copies")

# ===== jaxtrain: HLO ops -> categories by their Python stack ================================================


def stack_frames(hlo_text: str) -> dict:
    """{stack_frame_id: ("file.py:function", ...) innermost first} from the compiled HLO's FileNames,
    FunctionNames, FileLocations and StackFrames tables (a parent id is printed one above its frame's id)."""
    tables = {}
    for name in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", hlo_text, re.S | re.M)
        tables[name] = {int(line.split()[0]): line.split(None, 1)[1] for line in (m.group(1).splitlines() if m
                                                                                  else []) if line.strip()}
    files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    funcs = {i: v.strip('"') for i, v in tables["FunctionNames"].items()}
    attrs = lambda v: {k: int(x) for k, x in re.findall(r"(\w+)=(\d+)", v)}  # noqa: E731
    locs = {i: attrs(v) for i, v in tables["FileLocations"].items()}
    frames = {i: attrs(v) for i, v in tables["StackFrames"].items()}
    out = {}
    for fid in frames:
        chain, seen, f = [], set(), fid
        while f in frames and f not in seen:
            seen.add(f)
            loc = locs.get(frames[f]["file_location_id"], {})
            chain.append(f"{files.get(loc.get('file_name_id'), '?')}:{funcs.get(loc.get('function_name_id'), '?')}")
            f = frames[f]["parent_frame_id"] - 1
        out[fid] = tuple(chain)
    return out


_OPTIMIZER = re.compile(r"/optax/|/optim\.py:|:tree_norm$|:unless_non_finite$|train_step\.<locals>\.update$")


def frame_category(chain, is_dot: bool) -> str:
    """A category of CATEGORIES, or "other: <part>", for an op traced from the Python stack `chain`."""
    text = "\n".join(chain)
    if any(_OPTIMIZER.search(c) for c in chain):
        return "optimizer"
    if "cross_entropy.py:" in text or ":_cross_entropy_sum" in text:
        return "head + loss"
    if "/attention.py:" in text or ":Attention.attend" in text or ":attention_mask" in text:
        return "attention"
    if is_dot:
        return "layer matmuls"
    if ":RMSNorm.__call__" in text:
        return "other: norms"
    if re.search(r":(rope|rotary_lookup)\b", text):
        return "other: rope"
    if ":Transformer.embed_tokens" in text:
        return "other: embedding"
    return "other: elementwise, copies"


def _frame(instr, frames):
    m = re.search(r"stack_frame_id=(\d+)", instr["rest"])
    return frames.get(int(m.group(1))) if m else None


def _own_category(module, frames, instr) -> str | None:
    """From the instruction's own stacks: its (fused) dots' if they have one, else its own, its body root's or
    any member's; None when XLA left it no stack."""
    called = re.search(r"\bcalls=%?([\w.\-]+)", instr["rest"])
    body = module["computations"].get(called.group(1), []) if called else []
    dots = [d for d in [instr] + body if d["op"] in ("dot", "convolution")]
    cats = [frame_category(c, True) for d in dots if (c := _frame(d, frames)) is not None]
    if cats:
        return max(set(cats), key=cats.count)
    for cand in [instr] + [d for d in body if d["root"]] + body:
        if (chain := _frame(cand, frames)) is not None:
            return frame_category(chain, bool(dots))
    return None


def hlo_op_category(module, frames: dict, name: str) -> str:
    """The category of the executed instruction `name` of `jaxtrain.observe.hlo.parse_hlo`'s module, from the
    stacks in its metadata; an instruction without one (XLA made it) takes its nearest operands' category."""
    instr = module["by_name"][name]
    is_dot = any(d["op"] in ("dot", "convolution") for d in [instr] + module["computations"].get(
        (re.search(r"\bcalls=%?([\w.\-]+)", instr["rest"]) or [None, ""])[1], []))
    queue, seen = [instr], {name}
    while queue:
        cur = queue.pop(0)
        cat = _own_category(module, frames, cur)
        if cat is not None:
            return "layer matmuls" if is_dot and cat.startswith("other") else cat
        for o in hlo_lib.operands(cur):
            if o in module["by_name"] and o not in seen and len(seen) < 32:
                seen.add(o)
                queue.append(module["by_name"][o])
    return "layer matmuls" if is_dot else "other: elementwise, copies"


def profile_jax(trainer, state, batch, hlo_text: str, steps: int, module=None, frames=None):
    """(state, {category: ms per step}, [(ms, category, op, what)]) from a jax.profiler trace of `steps` steps."""
    import jax

    from jaxtrain.observe import profiling

    module = module or hlo_lib.parse_hlo(hlo_text)
    frames = frames if frames is not None else stack_frames(hlo_text)
    logdir = tempfile.mkdtemp(prefix="profile_torch_ref_jax.")
    try:
        jax.profiler.start_trace(logdir, create_perfetto_trace=True)
        for _ in range(steps):
            state, m = trainer.train_step(state, batch)
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
        summary = profiling.summarize(profiling.latest_trace(logdir), hlo_text, steps)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    cats, ops = collections.Counter(), []
    for op in summary["ops"]:
        cat = hlo_op_category(module, frames, op["op"])
        cats[cat] += op["ms"]
        ops.append((op["ms"], cat, op["op"], f"{op['kind']}: {op['what']}"))
    return state, cats, ops


# ===== torch: profiler events -> categories by name, ancestors and shapes ===================================

_TORCH_OPTIMIZER = re.compile(r"^Optimizer\.|_foreach_|_fused_adam|linalg_vector_norm|^aten::(stack|clamp|isfinite)$")
_TORCH_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|ScaledDotProduct", re.I)
_TORCH_LOSS = re.compile(r"log_softmax|nll_loss|cross_entropy|LogSoftmax|NllLoss", re.I)
_TORCH_MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                 "mkldnn::_linear_pointwise"}
# Inductor's kernels name the aten ops they fused (cpp_fused_add_mean_mul_pow_rsqrt_3, ...).
_TORCH_PARTS = (("rope", re.compile(r"_cos_|_sin_|aten::(cos|sin|cat)$|CatBackward")),
                ("embedding", re.compile(r"embedding|index_select", re.I)),
                ("norms", re.compile(r"rsqrt|mean|pow|PowBackward|MeanBackward")))


def torch_category(name: str, ancestors, shapes, vocab: int) -> str:
    """A category of CATEGORIES, or "other: <part>", for a torch.profiler event: its `name`, its `ancestors`'
    names (innermost first) and its input `shapes` (lists of dims)."""
    names = [name, *ancestors]
    if any(_TORCH_OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if any(_TORCH_ATTENTION.search(n) for n in names):
        return "attention"
    has_vocab = any(vocab in s for s in shapes if isinstance(s, (list, tuple)))
    embedding = any(re.search(r"embedding|index_select", n, re.I) for n in names)
    if name in _TORCH_MATMUL:
        return "head + loss" if has_vocab else "layer matmuls"
    if _TORCH_LOSS.search(name) or any(_TORCH_LOSS.search(n) for n in ancestors[:2]) or (has_vocab and not
                                                                                      embedding):
        return "head + loss"
    for part, pattern in _TORCH_PARTS:
        if any(pattern.search(n) for n in names[:3]):
            return f"other: {part}"
    return "other: elementwise, copies"


def profile_torch(trainer, batch, steps: int, vocab: int):
    """({category: ms per step}, [(ms, category, name, shapes)]) from torch.profiler's self CPU times."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            trainer.train_step(batch)
    cats, by_op = collections.Counter(), collections.Counter()
    for e in prof.events():
        ms = e.self_cpu_time_total / 1e3 / steps
        if ms <= 0:
            continue
        ancestors, p = [], e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        shapes = e.input_shapes or []
        cat = torch_category(e.name, ancestors, shapes, vocab)
        cats[cat] += ms
        by_op[(cat, e.name, str(shapes)[:70])] += ms
    return cats, [(ms, cat, name, shp) for (cat, name, shp), ms in by_op.items()]


# ===== report =============================================================================================


def cpu_info() -> dict:
    """The CPU's model name and the ISA flags that decide the matmul kernels (AVX-512, its BF16, AMX)."""
    model, flags_ = "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags_:
                flags_ = set(value.split())
    except OSError:
        pass
    wanted = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    return {"model": model, "cores": os.cpu_count(), "flags": {f: f in flags_ for f in wanted}}


def _rollup(cats: dict) -> dict:
    """{category: ms} with the "other: <part>" entries summed into "other"."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for cat, ms in cats.items():
        out[cat.split(":")[0]] += ms
    return out


def main(argv):
    del argv
    cache_dir = tempfile.mkdtemp(prefix="profile_torch_ref_inductor.")  # a cold compile with kernel profiling
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        _main()
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def _option_value(v: str):
    return {"true": True, "false": False}.get(v.lower(), int(v) if re.fullmatch(r"-?\d+", v) else v)


def compare_xla_options(cfg, specs, rounds: int) -> dict:
    """{name: {"wall_ms", "cpu_ms", "speed_wall", "speed_cpu", "fusions"}}: jaxtrain's step compiled with each
    spec's options (`jit(...).lower(...).compile(compiler_options=...)`) and with none ("default"), one step of
    each per round; speeds are the default's time over the variant's, medians of the per-round ratios."""
    import jax

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    variants = {"default": {}}
    for spec in specs:
        name, _, opts = spec.partition("=")
        variants[name] = {k: _option_value(v) for k, _, v in (o.partition(":") for o in opts.split(";") if o)}
    trainer, state, batch, _, _ = bench_step.warm_trainer(cfg)
    lowered = trainer.train_step.lower(state, batch)
    compiled, fusions = {}, {}
    for name, opts in variants.items():
        try:
            compiled[name] = lowered.compile(compiler_options=opts)
        except Exception as e:  # noqa: BLE001  (XLA rejects an unknown option or value: report, go on)
            log(f"{name}: {opts} | not compiled: {str(e).splitlines()[0][:200]}")
            continue
        text = compiled[name].as_text()
        fusions[name] = {k: text.count(f'"kind":"__{k}_fusion"') for k in ("ynn", "xnn", "onednn")}
        state, m = compiled[name](state, batch)
        jax.block_until_ready(m)
        log(f"{name}: {opts} | fusions {fusions[name]}")
    wall, cpu = {n: [] for n in compiled}, {n: [] for n in compiled}
    for _ in range(rounds):
        for name, step in compiled.items():
            t, c = time.perf_counter(), time.process_time()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            wall[name].append(1e3 * (time.perf_counter() - t))
            cpu[name].append(1e3 * (time.process_time() - c))
    out = {}
    for name in compiled:
        speed = lambda xs: float(np.median([d / x for d, x in zip(xs["default"], xs[name])]))  # noqa: E731
        out[name] = {"wall_ms": float(np.median(wall[name])), "cpu_ms": float(np.median(cpu[name])),
                     "speed_wall": speed(wall), "speed_cpu": speed(cpu),
                     "speed_wall_range": [min(d / x for d, x in zip(wall["default"], wall[name])),
                                          max(d / x for d, x in zip(wall["default"], wall[name]))],
                     "fusions": fusions[name]}
        r = out[name]
        log(f"{name:<24} wall {r['wall_ms']:8.1f} ms, {r['speed_wall']:.3f}x the default's speed (rounds "
            f"{r['speed_wall_range'][0]:.2f}-{r['speed_wall_range'][1]:.2f}x) | CPU {r['cpu_ms']:8.1f} ms, "
            f"{r['speed_cpu']:.3f}x")
    return out


def _main():
    import jax
    import torch
    import torch._inductor.config as inductor_config

    import torch_llama
    from jaxtrain import trainer as trainer_lib

    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    cfg, steps, rounds = _CONFIG.value, _STEPS.value, _ROUNDS.value
    torch.set_num_threads(os.cpu_count())
    cpu = cpu_info()
    log(f"CPU: {cpu['model']}, {cpu['cores']} cores | " + " ".join(f"{k}{'+' if v else '-'}"
                                                                  for k, v in cpu["flags"].items()))
    log(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} | jax {jax.__version__} | torch {torch.__version__}")
    if _XLA_OPTIONS.value:
        log(f"load avg {os.getloadavg()[0]:.2f}; {rounds} rounds")
        print(json.dumps({"cpu": cpu, "xla_options": compare_xla_options(cfg, _XLA_OPTIONS.value, rounds),
                          "load_avg_end": os.getloadavg()[0]}))
        return

    trainer, state, batch, _, _ = bench_step.warm_trainer(cfg)
    hlo_text = trainer.train_step.lower(state, batch).compile().as_text()
    module, frames = hlo_lib.parse_hlo(hlo_text), stack_frames(hlo_text)
    params = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state["params"]))
    batch_np = bench_step.synthetic_batch(cfg)
    jax_batch = trainer_lib.global_batch(batch_np, trainer.batch_sharding)
    tbatch = torch_llama.prepare_batch(batch_np)
    vocab = trainer.model_cfg.vocab_size

    torch_trainers = {"torch eager": torch_llama.TorchTrainer(cfg, trainer.model_cfg, params, compile=False)}
    inductor_config.cpp.enable_kernel_profile = True  # inductor's fused kernels become profiler events
    torch_trainers["torch.compile"] = torch_llama.TorchTrainer(cfg, trainer.model_cfg, params, compile=True)
    for t in torch_trainers.values():
        t.train_step(tbatch)  # compiles under torch.compile
        t.train_step(tbatch)

    names = ["jaxtrain", *torch_trainers]
    cats = {n: [] for n in names}
    step_ms = {n: [] for n in names}
    ops = {n: collections.Counter() for n in names}
    for r in range(rounds):
        for n in names:
            t0 = time.perf_counter()
            if n == "jaxtrain":
                state, m = trainer.train_step(state, jax_batch)
                jax.block_until_ready(m)
            else:
                torch_trainers[n].train_step(tbatch)
            step_ms[n].append(1e3 * (time.perf_counter() - t0))
            if n == "jaxtrain":
                state, c, op_rows = profile_jax(trainer, state, jax_batch, hlo_text, steps, module, frames)
            else:
                c, op_rows = profile_torch(torch_trainers[n], tbatch, steps, vocab)
            cats[n].append(c)
            for ms, cat, op, what in op_rows:
                ops[n][(cat, op, what)] += ms / rounds
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {step_ms[n][-1]:.0f} ms" for n in names)
            + f" (unprofiled) | load avg {os.getloadavg()[0]:.2f} | profiled: "
            + ", ".join(f"{n} " + " ".join(f"{v:.0f}" for v in _rollup(cats[n][-1]).values()) for n in names))

    # --- tables -----------------------------------------------------------------------------------------------
    rolled = {n: [_rollup(c) for c in cats[n]] for n in names}
    med = lambda xs: float(np.median(xs))  # noqa: E731
    result = {"config": cfg.workdir, "dtype": trainer.model_cfg.dtype, "rounds": rounds, "steps": steps,
              "cpu": cpu, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "step_ms": {n: med(step_ms[n]) for n in names}, "categories": {}, "other_parts": {},
              "per_round": {n: {"step_ms": step_ms[n], "categories": rolled[n]} for n in names}}
    torch_names = list(torch_trainers)
    hdr = f"{'category':<22} {'jaxtrain ms':>12}" + "".join(f" {n + ' ms':>17}" for n in torch_names) + \
        "".join(f" {'ratio ' + n.split()[-1]:>14}" for n in torch_names)
    lines = [f"{cfg.workdir} {trainer.model_cfg.dtype}: per step, medians of {rounds} rounds of {steps} profiled "
             f"steps; ratio = torch / jaxtrain, the median of the per-round ratios", hdr]
    for cat in (*CATEGORIES, "total (profiled)"):
        get = (lambda n, i: sum(rolled[n][i].values())) if cat.startswith("total") else \
            (lambda n, i, cat=cat: rolled[n][i][cat])
        row = {n: med([get(n, i) for i in range(rounds)]) for n in names}
        ratios = {n: med([get(n, i) / get("jaxtrain", i) if get("jaxtrain", i) else float("nan")
                          for i in range(rounds)]) for n in torch_names}
        result["categories"][cat] = {**{f"{n} ms": row[n] for n in names}, **{f"ratio {n}": ratios[n]
                                                                              for n in torch_names}}
        lines.append(f"{cat:<22} {row['jaxtrain']:12.1f}" + "".join(f" {row[n]:17.1f}" for n in torch_names)
                     + "".join(f" {ratios[n]:13.2f}x" for n in torch_names))
    row = {n: med(step_ms[n]) for n in names}
    ratios = {n: med([b / a for a, b in zip(step_ms["jaxtrain"], step_ms[n])]) for n in torch_names}
    lines.append(f"{'step (unprofiled)':<22} {row['jaxtrain']:12.1f}" + "".join(f" {row[n]:17.1f}"
                                                                                  for n in torch_names)
                 + "".join(f" {ratios[n]:13.2f}x" for n in torch_names))
    result["step_ratio"] = ratios
    lines += ["", "other, by part (ms): " + " | ".join(
        f"{n}: " + ", ".join(f"{p} {med([c.get('other: ' + p, 0.0) for c in cats[n]]):.1f}" for p in OTHER_PARTS)
        for n in names)]
    for n in names:
        result["other_parts"][n] = {p: med([c.get("other: " + p, 0.0) for c in cats[n]]) for p in OTHER_PARTS}
    log("\n".join(lines))
    if _TOP.value:
        for n in names:
            log(f"\n{n}: the top {_TOP.value} ops (ms per step, mean over rounds)")
            for (cat, op, what), ms in ops[n].most_common(_TOP.value):
                log(f"  {ms:8.2f}  {cat:<28} {op[:60]:<60} {what[:90]}")
    print(json.dumps(result))


if __name__ == "__main__":
    _CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_cpu.py", "Model/batch config.",
                                              lock_config=True)
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds; each profiles --steps steps of every implementation.")
    _STEPS = flags.DEFINE_integer("steps", 2, "Profiled steps per implementation and round.")
    _TOP = flags.DEFINE_integer("top", 0, "Also list each implementation's N costliest ops with their category.")
    _XLA_OPTIONS = flags.DEFINE_multi_string("xla_option", [], "NAME=KEY:VALUE;...: time jaxtrain's step compiled "
                                             "with these XLA options against the default instead (repeatable).")
    app.run(main)
