"""A roofline bound of one device's step, read from a compiled program (the report's XLA:GPU section).

Every kernel outside the collectives takes max(FLOPs / peak, bytes / memory bandwidth), and they run one after
another, weighted by how often their computation runs. Autotuning, launch gaps and overlap are left out, so the
figure is an optimistic bound on MFU, not a prediction of the step time.
"""

from __future__ import annotations

import re

from jaxtrain.observe import hlo as hlo_lib

# Kernels: the ops that launch work in a non-fused computation. Collectives are left out (async on GPUs, they
# overlap the compute; their bytes are in the collectives table). Scalar ops of loop bodies and conditions cost
# nothing measurable and are left out too.
_KERNEL_OPS = {"fusion", "custom-call", "copy", "transpose", "reduce", "dot", "convolution", "scatter", "gather",
               "dynamic-update-slice", "dynamic-slice", "broadcast", "concatenate", "slice", "pad", "sort",
               "select-and-scatter", "reduce-window"}


# 8-bit matmuls (fp8, int8: model.quant) run at twice the bf16 peak on H100/H200 (1,979 against 989 TFLOP/s
# dense) and on TPU v5e/v5p/v6e (int8 TOPS = 2 x bf16 TFLOP/s).
EIGHT_BIT_SPEEDUP = 2.0


def _is_8bit(module, instr) -> bool:
    """Whether a dot's operands are 8-bit (f8e4m3fn, f8e5m2, s8, u8)."""
    lhs = module["shapes"].get((hlo_lib.operands(instr) or [""])[0], "")
    return re.match(r"\(?(f8\w*|[su]8)\[", lhs) is not None


def _flops_within(module, comp: str, seen=()) -> tuple[float, float]:
    """(all, 8-bit) dot / convolution FLOPs of a fused computation and what it calls."""
    total = eight = 0.0
    for instr in module["computations"].get(comp, []):
        flops = hlo_lib.instruction_flops(module, instr)
        total += flops
        eight += flops if flops and _is_8bit(module, instr) else 0.0
        for target, _ in hlo_lib.called(instr):
            if target not in seen:
                t, e = _flops_within(module, target, seen + (comp,))
                total, eight = total + t, eight + e
    return total, eight


def _fusion_bytes(module, fusion, comp: str) -> float:
    """Bytes a fusion reads and writes: a parameter only sliced inside (a layer of a stacked weight) counts its
    slices, and a buffer updated in place (dynamic-update-slice into a scan's stacked outputs) counts the update."""
    body = module["computations"][comp]
    users: dict[str, list] = {}
    for instr in body:
        for i, name in enumerate(hlo_lib.operands(instr)):
            users.setdefault(name, []).append((instr, i))

    def uses_of(name):  # a bitcast moves no data (a layer's [1, ...] view of a stacked buffer): see through it
        for instr, i in users.get(name, []):
            yield from uses_of(instr["name"]) if instr["op"] == "bitcast" else [(instr, i)]

    args = hlo_lib.operands(fusion)
    total, written = 0.0, hlo_lib.shape_bytes(fusion["shape"])
    for instr in body:
        if instr["op"] != "parameter":
            continue
        index = int(re.match(r"(\d+)", instr["rest"]).group(1))
        uses = list(uses_of(instr["name"]))
        if uses and all(u["op"] in ("dynamic-slice", "slice") and i == 0 for u, i in uses):
            total += sum(hlo_lib.shape_bytes(u["shape"]) for u, _ in uses)
        elif uses and all(u["op"] == "dynamic-update-slice" and i == 0 for u, i in uses):
            written = sum(hlo_lib.shape_bytes(module["shapes"].get(hlo_lib.operands(u)[1], "")) for u, _ in uses)
        elif index < len(args):
            total += hlo_lib.shape_bytes(module["shapes"].get(args[index], ""))
    return total + written


def _kernel(module, instr) -> tuple[float, float, float] | None:
    """(FLOPs, 8-bit FLOPs, bytes) of one kernel: an op of _KERNEL_OPS in a non-fused computation; else None."""
    if instr["comp"] in module["fusion_of"] or instr["op"] not in _KERNEL_OPS:
        return None
    called = re.search(r"\bcalls=%?([\w.\-]+)", instr["rest"])
    if instr["op"] == "fusion" and called and called.group(1) in module["computations"]:
        return (*_flops_within(module, called.group(1)), _fusion_bytes(module, instr, called.group(1)))
    nbytes = hlo_lib.shape_bytes(instr["shape"]) + sum(hlo_lib.shape_bytes(module["shapes"].get(o, ""))
                                                       for o in hlo_lib.operands(instr))
    own = hlo_lib.instruction_flops(module, instr)
    inner = _flops_within(module, called.group(1)) if called else (0.0, 0.0)
    return own + inner[0], (own if own and _is_8bit(module, instr) else 0.0) + inner[1], nbytes


def roofline(hlo, peak_flops: float, bandwidth: float, top: int = 5, branch_weights=None) -> dict:
    """A roofline estimate of one device's step from compiled HLO: every kernel takes max(FLOPs / peak_flops,
    bytes / bandwidth) and they run one after another (one stream), times how often its computation runs; 8-bit
    matmul FLOPs count at EIGHT_BIT_SPEEDUP x peak_flops.
    cuDNN's attention and a custom call shaped as a grouped matmul (tokamax's ragged_dot) count their FLOPs
    (hlo.instruction_flops); other custom calls count by their bytes only. A conditional runs one branch
    (`hlo.chosen_branches` with `branch_weights`; by default the slowest).
    Returns the seconds, the matmul and other kernels' parts, and the `top` other kernels by time."""
    module = hlo_lib.parse_hlo(hlo) if isinstance(hlo, str) else hlo

    def seconds(k):
        flops, eight, nbytes = k
        return max((flops - eight) / peak_flops + eight / (EIGHT_BIT_SPEEDUP * peak_flops), nbytes / bandwidth)

    kernel_of = {instr["name"]: k for instrs in module["computations"].values() for instr in instrs
                 if (k := _kernel(module, instr)) is not None}
    cost = lambda instr: seconds(kernel_of[instr["name"]]) if instr["name"] in kernel_of else 0.0  # noqa: E731
    mult, _ = hlo_lib.multiplicities(module, hlo_lib.chosen_branches(module, cost, branch_weights))
    kernels = []
    for comp, instrs in module["computations"].items():
        times = mult.get(comp)
        for instr in instrs if times else ():
            if instr["name"] not in kernel_of:
                continue
            flops, eight, nbytes = kernel_of[instr["name"]]
            op_name = re.search(r'op_name="([^"]*)"', instr["rest"])
            kernels.append({"name": instr["name"], "kind": "matmul" if flops else instr["op"], "runs": times,
                            "flops": flops * times, "flops_8bit": eight * times, "bytes": nbytes * times,
                            "seconds": seconds(kernel_of[instr["name"]]) * times,
                            "op_name": op_name.group(1) if op_name else ""})
    matmul = [k for k in kernels if k["kind"] == "matmul"]
    other = sorted((k for k in kernels if k["kind"] != "matmul"), key=lambda k: -k["seconds"])
    return {"seconds": sum(k["seconds"] for k in kernels), "kernels": len(kernels),
            "matmul_seconds": sum(k["seconds"] for k in matmul), "matmul_flops": sum(k["flops"] for k in matmul),
            "matmul_flops_8bit": sum(k["flops_8bit"] for k in matmul),
            "other_seconds": sum(k["seconds"] for k in other), "other_bytes": sum(k["bytes"] for k in other),
            "peak_flops": peak_flops, "bandwidth": bandwidth, "top": other[:top]}
