"""The report `jaxtrain plan` prints: a plan's figures (`planner.plan`'s dict) as text tables.

Memory per device (shardings, compiled and analytic side by side, and whether the peak fits the target), compute
per step (model FLOPs, XLA's counts, the ideal step at the given MFU, the XLA:GPU roofline) and the collectives per
mesh axis. Formatting only: every figure is computed by the planner.
"""

from __future__ import annotations


def _b(x) -> str:
    if x is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _r(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _t(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 10 else f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-2 else \
        f"{seconds * 1e6:,.0f} us"


def _f(x) -> str:
    if x is None:
        return "-"
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} FLOP"


def format_report(r: dict) -> str:
    """The plan's figures as text: a header, memory per device, compute per step and the collectives."""
    return "\n".join([*_header_lines(r), "", *_memory_lines(r), *_memory_notes(r), "", *_compute_lines(r), "",
                      *_collective_lines(r)])


def _header_lines(r: dict) -> list[str]:
    c, tg, m = r["config"], r["target"], r["model"]
    mesh = " ".join(f"{k}={v}" for k, v in c["mesh"].items())
    return [
        f"plan: {m['params'] / 1e6:,.2f}M params, {m['layers']} layers | target {tg['backend']} "
        f"({tg['device_kind']}), {c['dtype']} compute, {c['param_dtype']} params | {tg['num_devices']} devices, "
        f"mesh {mesh}, rules {c['rules']!r}",
        f"compiled in {r['compile_s']:.1f}s for {tg['compiled_on']} (shapes only, nothing allocated; "
        + ("XLA:GPU's fusion, scheduling and buffer reuse, without autotuning" if tg["compiler"] == "gpu" else
           "the CPU compiler's fusion and buffer reuse") + f") | batch {c['batch_size']} x {c['seq_len']} = "
        f"{m['tokens_per_step']:,} tokens/step, {c['microbatches']} microbatch(es), remat {c['remat']}",
    ]


def _memory_lines(r: dict) -> list[str]:
    """The memory table: each part from the shardings or the compiler beside the analytic figure."""
    mem = r["memory"]
    lines = [f"{'memory per device':<28}{'sharding/compiled':>20}{'analytic':>14}{'analytic/compiled':>19}"]
    labels = {"params": "params (shardings)", "optimizer": "optimizer state (shardings)",
              "gradients": "gradients (trained params)", "reference": "DPO reference (frozen)",
              "grad_residual": "error-feedback residual",
              "arguments": "arguments (compiled)",
              "temporaries": "temporaries (compiled temp)"}
    for row in mem["rows"]:
        lines.append(f"  {labels[row['name']]:<26}{_b(row['compiled']):>20}{_b(row['analytic']):>14}"
                     f"{_r(row['ratio']):>19}")
    compiled = mem["compiled"]
    if not compiled:
        return [*lines, "  (memory_analysis() not available on this backend)"]
    lines.append(f"  {'outputs / aliased (donated)':<26}{_b(compiled.get('output')):>20} / "
                 f"{_b(compiled.get('alias'))}")
    if "peak" in compiled:
        lines.append(f"  {'peak = args+out-alias+temp':<26}{_b(compiled['peak']):>20}")
    host = {k[5:]: v for k, v in compiled.items() if k.startswith("host_")}
    if host or mem["analytic"]["host"]["optimizer"] or mem["analytic"]["host"]["activations"]:
        a_host = mem["analytic"]["host"]
        lines.append(f"  {'host memory (offloaded)':<26}{_b(host.get('argument', 0.0) + host.get('temp', 0.0)):>20}"
                     f"{_b(a_host['optimizer'] + a_host['activations']):>14}   compiled host arguments "
                     f"{_b(host.get('argument', 0.0))} + temp {_b(host.get('temp', 0.0))}; analytic optimizer "
                     f"state {_b(a_host['optimizer'])} + activations {_b(a_host['activations'])}")
    if compiled.get("generated_code"):
        lines.append(f"  {'generated code':<26}{_b(compiled['generated_code']):>20}")
    return lines


def _memory_notes(r: dict) -> list[str]:
    """Whether the step fits the target, the analytic temporaries' parts, and where the compiled figures differ
    from the target's (the CPU compiler's f32 activations, XLA's attention)."""
    c, tg, mem = r["config"], r["target"], r["memory"]
    compiled, a = mem["compiled"], mem["analytic"]
    lines = []
    hbm = tg.get("memory_bytes")
    if hbm:
        need = {"compiled peak": (compiled or {}).get("peak"), "analytic": a["arguments"] + a["temporaries"]}
        lines.append(f"  fits in {_b(hbm)} ({tg['device_kind']})? " + ", ".join(
            f"{k} {_b(v)}: {'yes' if v <= hbm else 'NO'}" for k, v in need.items() if v))
    if roll := mem.get("rollout"):  # an RL objective's rollouts: the resident state plus their K/V cache
        lines.append(f"  rollouts: K/V cache {_b(roll['kv_cache'])} per device for {roll['rows']:,} rows; with the "
                     f"state {_b(roll['peak'])}" + (f": {'fits' if roll['peak'] <= hbm else 'does NOT fit'}"
                                                    if hbm else ""))
    lines.append(f"  analytic temporaries = gradients {_b(a['gradients'])} + activations {_b(a['activations'])} "
                 f"({_b(a['activations_per_layer'])} per layer, {a['tokens_per_device_microbatch']:,} tokens "
                 f"per device per microbatch)")
    lines += _pipeline_memory_lines(a.get("pipeline"), r["pipeline"])
    if c["dtype"] != "float32" and tg["compiler"] == "cpu":
        temp = (compiled or {}).get("temp")
        lines.append(f"  note: the CPU compiler computes {c['dtype']} matmuls in f32 and keeps f32 activations; with "
                     f"f32 activations the analytic temporaries are {_b(a['temporaries_f32_activations'])}"
                     + (f" (analytic/compiled {_r(a['temporaries_f32_activations'] / temp)})" if temp else "")
                     + f"; on the {tg['backend']} expect about the {c['dtype']} figure")
    if c["attention_impl"] != c["compiled_attention"]:
        lines.append(f"  note: compiled with XLA's attention (the CPU has no {c['attention_impl']} kernel), which "
                     f"keeps [batch, heads, seq, seq] scores that the target's fused kernel does not; the analytic "
                     f"counts the fused kernel's (its softmax statistics only)")
    return lines


def _pipeline_memory_lines(est: dict | None, p: dict) -> list[str]:
    """What the schedule makes a stage hold: the analytic parts beside the table's peak."""
    if not est:
        return []
    if not est["explicit"]:
        return [f"  pipeline {est['schedule']} under autodiff: the backward keeps every tick's chunk activations, "
                f"{est['in_flight']} ticks (the table's peak {max(p['peak_activations'])}, plus the bubble's ticks)"]
    parts = est["activation_parts"]
    return [f"  pipeline {est['schedule']}: a stage holds at most {est['in_flight']} (microbatch, chunk) inputs at "
            f"once (the table's peak per stage {p['peak_activations']}; every device allocates the most): "
            f"{_b(parts['in_flight'])} with their output gradients, + one chunk's layers for one microbatch in its "
            f"backward's recompute {_b(parts['chunk'])}, + the stage's inputs and input gradients "
            f"{_b(parts['stage_io'])}, + the executor's gradient buffers {_b(est['gradient_buffers'])}"]


def _compute_lines(r: dict) -> list[str]:
    """FLOPs per step (the model's, XLA's counts), the peak, the ideal step, the roofline and the pipeline bubble."""
    tg, f, s = r["target"], r["flops"], r["speed"]
    # DPO adds the reference model's forward to each step.
    flops_label = "model FLOPs ((6N + attn) x 4/3, DPO)" if r["memory"]["sharding"].get("reference") else \
        "model FLOPs (6N + attention)"
    lines = [
        "compute per step (all devices)",
        f"  {flops_label:<38}{_f(f['model_per_step']):>16}",
        f"  {'XLA cost_analysis flops':<38}{_f(f['cost_analysis_total']):>16}   "
        f"x{_r(f['cost_analysis_vs_model'])} of model (while-loop bodies counted once)",
        f"  {'HLO dot FLOPs x trip counts':<38}{_f(f['hlo_dots_total']):>16}   "
        f"x{_r(f['hlo_dots_vs_model'])} of model (with remat, full attention; a conditional's "
        f"{f.get('conditionals', 'costliest branch')})",
        f"  peak {_f(tg['peak_flops_per_device'])}/s per device x {tg['num_devices']} ({tg['peak_source']})",
        f"  at {s['mfu']:.0%} MFU: ideal step {_t(s['ideal_step_s'])}, {s['tokens_per_s']:,.0f} tokens/s",
    ]
    roof = s.get("roofline")
    if roof and roof["mfu"]:
        lines += _roofline_lines(roof)
    p = r["pipeline"]
    if p["stages"] > 1:
        lines.append(f"  pipeline {p['stages']} stages x {p['microbatches']} microbatches ({p['schedule']}"
                     f"{', %d repeats' % p['repeats'] if p['repeats'] > 1 else ''}): bubble "
                     f"{p['bubble']:.1%}, so at most {1 - p['bubble']:.0%} of that MFU: step "
                     f"{_t(s['bubble_step_s'])}, {s['bubble_tokens_per_s']:,.0f} tokens/s")
        lines += ["    " + line for line in p.get("chart", "").splitlines()]
    return lines


def _roofline_lines(roof: dict) -> list[str]:
    lines = [f"  roofline of the XLA:GPU program: {_t(roof['seconds'])} a step, {roof['mfu']:.1%} MFU if each "
             f"of its {roof['kernels']} kernels ran at max(FLOPs / peak, bytes / "
             f"{roof['bandwidth'] / 1e12:.2f} TB/s), one after another (collectives overlapped; a pipeline's "
             f"bubble included: its idle ticks compute, or wait for the slowest stage)"]
    eight = roof.get("matmul_flops_8bit") or 0
    in_8bit = f", {_f(eight)} of them in 8-bit at 2x the peak" if eight else ""
    lines.append(f"    matmuls {_t(roof['matmul_seconds'])} ({_f(roof['matmul_flops'])}{in_8bit}); other kernels "
                 f"{_t(roof['other_seconds'])} moving {_b(roof['other_bytes'])}, the largest:")
    for k in roof["top"]:
        lines.append(f"      {_t(k['seconds']):>10}  {k['name']} x{k['runs']:g}  {k['op_name'][-70:]}")
    return lines


def _collective_lines(r: dict) -> list[str]:
    lines = [
        "collectives per step, per device (bytes = payload; wire = ring traffic)",
        f"  {'op':<20}{'axes':<16}{'count':>7}{'bytes':>14}{'wire bytes':>14}{'analytic':>14}{'analytic/compiled':>19}",
    ]
    for row in r["collectives"]:
        flags = "".join(note for key, note in (("as_all_reduce", "  (all-reduce + slice on CPU)"),
                                               ("partial", "  partial-axis"),
                                               ("trip_count_unknown", "  trip-count-unknown")) if row.get(key))
        count = row["count"]
        lines.append(f"  {row['kind']:<20}{','.join(row['axes']) or '-':<16}{count:>7.0f}{_b(row['bytes']):>14}"
                     f"{_b(row['wire_bytes']):>14}{_b(row.get('analytic_bytes')):>14}{_r(row['ratio']):>19}{flags}")
    if not r["collectives"]:
        lines.append("  (none: one device, or nothing is sharded)")
    est = r["memory"]["analytic"].get("pipeline")
    if est and est["explicit"]:
        sends = est["sends"]
        lines.append(f"  pipeline {est['schedule']} ppermutes: the schedule needs {sends['hand_offs']} microbatch "
                     f"hand-offs of {_b(sends['microbatch_bytes'])} a step from the busiest stage, "
                     f"{_b(sends['needed'])}; the executor sends one each way every tick, idle ones too: "
                     f"2 x {sends['ticks']} ticks, {_b(sends['sent'])} (the collective-permute row)")
    return lines
