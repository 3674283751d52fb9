"""Reading compiled HLO text: computations, instructions, shapes, how often each computation runs, and matmul
FLOPs. Shared by the planner (`jaxtrain plan`) and the profile summary (`jaxtrain.observe.profiling`)."""

from __future__ import annotations

import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")


DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
               "s2": 0.25, "u2": 0.25, "token": 0}


SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string, tuples summed: 'f32[2,3]' -> 24, '(f32[2], bf16[4])' -> 16."""
    total = 0.0
    for dtype, dims in SHAPE.findall(re.sub(r"/\*.*?\*/", "", shape)):
        size = DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else None)
        if size is None:
            continue
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def dims(shape: str) -> list[int]:
    m = SHAPE.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _split_instruction(line: str):
    """'  %x = (f32[2], s32[]) op(%a, %b), attr=...' -> (name, shape, op, rest) or None."""
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    return m.group(1), shape, op.group(1), rest[op.end():]


def operands(instr) -> list[str]:
    """Operand names: the %names before the op's closing parenthesis."""
    return re.findall(r"%([\w.\-]+)", instr["rest"].split(")", 1)[0])


def parse_hlo(text: str) -> dict:
    """{"computations": {name: [instr]}, "entry": name, "shapes": {instr name: shape}, "by_name": {name: instr},
    "users": {name: [(user instr, operand index)]}, "fusion_of": {fused computation: fusion instr}};
    instr = dict(name, shape, op, rest, comp, root)."""
    comps, by_name, entry, current = {}, {}, None, None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        if not line[0].isspace():
            header = _COMP_HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = header.group(2)
                comps[current] = []
                if header.group(1):
                    entry = current
            elif line.startswith("}"):
                current = None
            continue
        if current is None:
            continue
        parts = _split_instruction(line)
        if parts:
            name, shape, op, rest = parts
            instr = {"name": name, "shape": shape, "op": op, "rest": rest, "comp": current,
                     "root": line.lstrip().startswith("ROOT ")}
            comps[current].append(instr)
            by_name[name] = instr
    users: dict[str, list] = {}
    fusion_of = {}  # fused computation -> the fusion instruction that calls it
    for instrs in comps.values():
        for instr in instrs:
            for i, operand in enumerate(operands(instr)):
                users.setdefault(operand, []).append((instr, i))
            called = re.search(r"\bcalls=%?([\w.\-]+)", instr["rest"]) if instr["op"] == "fusion" else None
            if called:
                fusion_of[called.group(1)] = instr
    return {"computations": comps, "entry": entry, "by_name": by_name, "users": users, "fusion_of": fusion_of,
            "shapes": {name: instr["shape"] for name, instr in by_name.items()}}


def numel(shape: str) -> int:
    return math.prod(dims(shape))


def tuple_elements(shape: str) -> list[str]:
    """'(f32[2]{0}, /*index=1*/bf16[3,4]{1,0})' -> ['f32[2]', 'bf16[3,4]']."""
    return [f"{d}[{dims}]" for d, dims in SHAPE.findall(re.sub(r"/\*.*?\*/", "", shape))]


def called(instr) -> list[tuple[str, str]]:
    """(computation, role) pairs an instruction calls; role is the attribute (body, condition, calls, ...)."""
    if instr["op"].endswith("-done") or instr["op"] == "async-update":
        return []  # the -start already accounts for the wrapped computation
    out = []
    for role, target in re.findall(r"\b(calls|to_apply|body|condition|true_computation|false_computation)="
                                   r"%?([\w.\-]+)", instr["rest"]):
        out.append((target, role))
    for role, group in re.findall(r"\b(branch_computations|called_computations)=\{([^}]*)\}", instr["rest"]):
        out += [(t.strip().lstrip("%"), role) for t in group.split(",") if t.strip()]
    return out


def trip_count(instr, module) -> int | None:
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', instr["rest"])
    if m:
        return int(m.group(1))
    cond = re.search(r"\bcondition=%?([\w.\-]+)", instr["rest"])
    body = module["computations"].get(cond.group(1), []) if cond else []
    consts = [int(c) for i in body if i["op"] == "constant" and re.fullmatch(r"s(32|64)\[\]", i["shape"])
              for c in re.findall(r"^(-?\d+)\)", i["rest"])]
    has_lt = any(i["op"] == "compare" and "direction=LT" in i["rest"] for i in body)
    return consts[0] if has_lt and len(consts) == 1 and consts[0] > 0 else None


def multiplicities(module, branch_weights=None) -> tuple[dict, set]:
    """How many times each computation runs per call of the entry; and the computations reached through a
    while loop of unknown trip count (counted once). `branch_weights(instr)`: for a conditional, how often each
    branch runs per run of it (one weight per branch, `called` order), or None: every branch once (what the
    collectives count, an upper bound)."""
    callers: dict[str, list] = {}
    unknown_loops = set()
    for comp, instrs in module["computations"].items():
        for instr in instrs:
            targets = called(instr)
            weights = branch_weights(instr) if branch_weights and instr["op"] == "conditional" else None
            for i, (target, role) in enumerate(targets):
                factor = 1 if weights is None else weights[i]
                if instr["op"] == "while" and role == "body":
                    trips = trip_count(instr, module)
                    if trips is None:
                        unknown_loops.add(target)
                    factor = trips or 1
                callers.setdefault(target, []).append((comp, factor))
    memo: dict[str, float] = {}

    def mult(comp, seen=()):
        if comp == module["entry"]:
            return 1
        if comp not in memo:
            memo[comp] = sum(mult(c, seen + (comp,)) * f for c, f in callers.get(comp, []) if c not in seen)
        return memo[comp]

    out = {c: mult(c) for c in module["computations"]}
    # Unknown trip counts propagate to what those loop bodies call.
    flagged = set(unknown_loops)
    changed = True
    while changed:
        changed = False
        for comp, instrs in module["computations"].items():
            if comp in flagged:
                for instr in instrs:
                    for target, _ in called(instr):
                        if target not in flagged:
                            flagged.add(target)
                            changed = True
    return out, flagged


def ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def instruction_flops(module, instr) -> float:
    """2 * output elements * contracted elements of one dot / convolution of `parse_hlo`'s module, or of a custom
    call shaped as a grouped matmul (0 otherwise)."""
    if instr["op"] == "custom-call":
        return (_cudnn_attention_flops(module, instr) or _ring_flash_flops(module, instr)
                or _grouped_matmul_flops(module, instr))
    if instr["op"] not in ("dot", "convolution"):
        return 0.0
    out = math.prod(dims(instr["shape"]))
    names = operands(instr)
    lhs = dims(module["shapes"].get(names[0], "")) if names else []
    if instr["op"] == "dot":
        contract = ints(re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr["rest"]).group(1)) \
            if "lhs_contracting_dims" in instr["rest"] else []
        k = math.prod(lhs[i] for i in contract if i < len(lhs))
    else:  # convolution: contracted = kernel elements / output features
        rhs = dims(module["shapes"].get(names[1], "")) if len(names) > 1 else []
        k = math.prod(rhs) / max(dims(instr["shape"])[-1:] or [1])
    return 2.0 * out * k


def _cudnn_attention_flops(module, instr) -> float:
    """cuDNN's fused attention (`__cudnn$fmha...`): 2 (d_qk + d_v) per unmasked query-key pair and head in the
    forward; the backward recomputes the scores and takes dv, dp, dq and dk: 2 (3 d_qk + 2 d_v). Pairs follow
    its mask: causal, within a sliding window, or all."""
    target = re.search(r'custom_call_target="__cudnn\$fmha(\w*)"', instr["rest"])
    shape = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', instr["rest"])
    names = operands(instr)
    if not target or not shape or len(names) < 3:
        return 0.0
    b, h, sq, sk = ints(shape.group(1))
    d_qk, d_v = dims(module["shapes"].get(names[0], ""))[-1], dims(module["shapes"].get(names[2], ""))[-1]
    window = re.search(r'"sliding_window_length":\s*(\d+)', instr["rest"])
    window = int(window.group(1)) if window else 0
    mask = re.search(r'"mask_type":\s*"(\w+)"', instr["rest"])
    if (mask and "CAUSAL" in mask.group(1)) or window:
        visible = np.minimum(np.arange(1, sq + 1) + max(sk - sq, 0), window or sk)  # keys each query sees
        pairs = float(visible.sum())
    else:
        pairs = float(sq) * sk
    per_pair = 3 * d_qk + 2 * d_v if target.group(1).endswith("Backward") else d_qk + d_v
    return 2.0 * b * h * pairs * per_pair


# models.gpu_flash's kernels: matmuls per (query, key) pair and head, each 2 * head_dim FLOPs: the forward's q.k
# and p.v; dq's q.k, dp and ds.k; dk/dv's q.k, dp, ds.q and p.do.
_RING_FLASH_MATMULS = {"forward": 2, "dq": 3, "dkv": 4}


def _ring_flash_flops(module, instr) -> float:
    """One of models.gpu_flash's Triton kernels, q [b, tq, N, D] and k [b, tk, KV, D] its 6th and 7th operands:
    every (query, key) pair of the block, as a conditional counts its costliest branch (the kernel skips the
    tiles the mask empties as it runs). models.tpu_flash's Mosaic kernels bear the same names over other
    operands: they count by their bytes only."""
    kind = re.search(r'op_name="[^"]*/ring_flash_(forward|dq|dkv)/pallas_call"', instr["rest"])
    names = operands(instr)
    if not kind or 'custom_call_target="__gpu$xla.gpu.triton"' not in instr["rest"] or len(names) < 7:
        return 0.0
    b, tq, heads, d = dims(module["shapes"].get(names[5], ""))
    tk = dims(module["shapes"].get(names[6], ""))[1]
    return 2.0 * d * _RING_FLASH_MATMULS[kind.group(1)] * b * heads * tq * tk


def _grouped_matmul_flops(module, instr) -> float:
    """A kernel taking x [m, k] and w [groups, k, n] to [m, n] (tokamax's ragged_dot, a Pallas or Mosaic custom
    call), or w [groups, n, k] read transposed (models.gpu_grouped's input gradient), multiplies each row by one
    group's weight: 2 m k n. One taking x [m, k] and g [m, n] to [groups, k, n] (a grouped weight gradient:
    models.gpu_grouped) adds each row's outer product to one group's: 2 m k n too."""
    out = dims(instr["shape"]) if not instr["shape"].startswith("(") else []
    shapes = [dims(module["shapes"].get(name, "")) for name in operands(instr)]  # a kernel's own operands too
    if len(out) == 3:
        for x in (s for s in shapes if len(s) == 2 and s[1] == out[1]):
            if any(len(g) == 2 and g[0] == x[0] and g[1] == out[2] for g in shapes):
                return 2.0 * x[0] * x[1] * out[2]
        return 0.0
    if len(out) != 2:
        return 0.0
    for x in (s for s in shapes if len(s) == 2 and s[0] == out[0]):
        if any(len(w) == 3 and {(w[1], w[2]), (w[2], w[1])} & {(x[1], out[1])} for w in shapes):
            return 2.0 * x[0] * x[1] * out[1]
    return 0.0


def chosen_branches(module, instr_cost, branch_weights=None):
    """A `multiplicities` branch_weights that runs one branch per run of a conditional: as
    `branch_weights(instr, costs)` weighs them (costs: `instr_cost` summed over one run of each branch), or, where
    that gives None, the most expensive branch. A lax.switch in a scan (pipeline_exec's actions) runs one branch
    a tick; counting every branch overstates its work by their number."""
    memo: dict = {}

    def cost(comp):  # instr_cost over one run of `comp`, what it calls included (as multiplicities weighs them)
        if comp not in memo:
            total = 0.0
            for instr in module["computations"].get(comp, []):
                targets = called(instr)
                factors = weights(instr) if instr["op"] == "conditional" else [
                    (trip_count(instr, module) or 1) if instr["op"] == "while" and role == "body" else 1
                    for _, role in targets]
                total += instr_cost(instr) + sum(f * cost(t) for f, (t, _) in zip(factors, targets))
            memo[comp] = total
        return memo[comp]

    def weights(instr):
        costs = [cost(target) for target, _ in called(instr)]
        chosen = branch_weights(instr, costs) if branch_weights else None
        if chosen is None:
            chosen = [float(i == max(range(len(costs)), key=costs.__getitem__)) for i in range(len(costs))]
        return chosen

    return weights


def dot_flops(hlo, branch_weights=None) -> float:
    """`instruction_flops` of every dot / convolution in compiled HLO (text or `parse_hlo`'s result), weighted by
    how often its computation runs (per device). A conditional runs one branch: `chosen_branches`."""
    module = parse_hlo(hlo) if isinstance(hlo, str) else hlo
    flops = lambda instr: instruction_flops(module, instr)  # noqa: E731
    mult, _ = multiplicities(module, chosen_branches(module, flops, branch_weights))
    return sum(flops(instr) * mult.get(comp, 0) for comp, instrs in module["computations"].items() for instr in instrs)
