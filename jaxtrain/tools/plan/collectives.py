"""The collectives table: every collective in a compiled program, its mesh axes, and its bytes per device a step.

Each op counts as often as its computation runs (while bodies by trip count, `hlo_lib.multiplicities`). The CPU
compiler has no reduce-scatter: it all-reduces and keeps a slice, which GPU and TPU compilers turn into a
reduce-scatter, so an all-reduce whose results are only sliced afterwards is counted as the reduce-scatter it
stands for. How bytes and wire bytes are counted: docs/planning.md.
"""

from __future__ import annotations

import math
import re

from jaxtrain.observe import hlo as hlo_lib
from jaxtrain.tools.plan.replica_groups import groups_to_axes, op_groups

_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "convert", "get-tuple-element")


def _only_sliced(module, name: str, n: int, depth: int = 0) -> bool:
    """Whether every use of the value `name` keeps 1/n of it through a dynamic-slice: directly, through
    element-preserving ops (bitcast, copy, convert, ...), or inside fusions (a fusion's root continues at
    the fusion's users). That is an all-reduce + slice, which GPU/TPU pipelines turn into a reduce-scatter."""
    instr = module["by_name"].get(name)
    users = module["users"].get(name, [])
    if instr is not None and instr.get("root") and instr["comp"] in module["fusion_of"]:
        users = users + module["users"].get(module["fusion_of"][instr["comp"]]["name"], [])
    if not users or depth > 12:
        return False
    size = hlo_lib.numel(module["shapes"][name])
    for user, index in users:
        op = user["op"]
        if op == "dynamic-slice" and index == 0:
            if hlo_lib.numel(user["shape"]) * n != size:
                return False
        elif op in _PASS_THROUGH and index == 0:
            if hlo_lib.numel(user["shape"]) != size or not _only_sliced(module, user["name"], n, depth + 1):
                return False
        elif op == "fusion":
            called = re.search(r"\bcalls=%?([\w.\-]+)", user["rest"])
            params = [i for i in module["computations"].get(called.group(1), []) if i["op"] == "parameter"
                      and i["rest"].startswith(f"{index})")] if called else []
            if not params or not _only_sliced(module, params[0]["name"], n, depth + 1):
                return False
        else:
            return False
    return True


def _scattered_elements(module, instr, n: int) -> list[bool]:
    """For each result of an all-reduce (a tuple has several): is it only sliced to 1/n afterwards?"""
    if not instr["shape"].startswith("("):
        return [_only_sliced(module, instr["name"], n)]
    elements = hlo_lib.tuple_elements(instr["shape"])
    out = [False] * len(elements)
    for user, _ in module["users"].get(instr["name"], []):
        if user["op"] == "get-tuple-element":
            index = int(re.search(r"\bindex=(\d+)", user["rest"]).group(1))
            out[index] = _only_sliced(module, user["name"], n)
    return out


def _scatter_axes(module, result, axes: tuple[str, ...], mesh_shape: dict, replica_axes: tuple[str, ...],
                  ) -> tuple[tuple[str, ...], list[bool]]:
    """For an all-reduce over `axes` whose results are not only sliced over all of them: the part of `axes` over
    which they are (a gradient reduced over data x fsdp and kept as its fsdp shard), and which results. The
    slice's size gives the part's size; equal sizes are told apart by preferring parts without `replica_axes`,
    then the earlier mesh axes (the HLO does not name the axes a slice splits)."""
    import itertools  # noqa: PLC0415
    parts = [part for k in range(1, len(axes)) for part in itertools.combinations(axes, k)]
    parts.sort(key=lambda part: (any(a in replica_axes for a in part), [axes.index(a) for a in part]))
    for part in parts:
        sliced = _scattered_elements(module, result, math.prod(mesh_shape[a] for a in part))
        if any(sliced):
            return part, sliced
    return (), []


_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "ragged-all-to-all": lambda n: (n - 1) / n, "collective-permute": lambda n: 1.0}


def collectives(hlo, mesh_shape: dict, replica_axes: tuple[str, ...] = (), branch_weights=None) -> list[dict]:
    """Every collective in compiled HLO (text or `hlo_lib.parse_hlo`'s result), one dict per op (an all-reduce whose
    results are partly sliced afterwards gives two, or three): kind, axes, partial, group_size, count (executions
    per step), bytes and wire_bytes per device per step, as_all_reduce (a reduce-scatter the CPU compiler emitted
    as all-reduce + dynamic-slice). An all-reduce whose results are only sliced over part of its axes counts as a
    reduce-scatter over that part and an all-reduce of the slice over the rest (GPU's AllReduceSplitter rewrites
    it so); `replica_axes` (mesh.replica_axes) breaks ties between parts of one size. `branch_weights(instr)`: how
    often each branch of a conditional runs (hlo.multiplicities; by default every branch once). See
    docs/planning.md."""
    module = hlo_lib.parse_hlo(hlo) if isinstance(hlo, str) else hlo
    mult, unknown = hlo_lib.multiplicities(module, branch_weights)
    num_devices = math.prod(mesh_shape.values())
    done_of = {}  # start name -> its -done instruction
    for instrs in module["computations"].values():
        for instr in instrs:
            if instr["op"].endswith("-done") and hlo_lib.operands(instr):
                done_of[hlo_lib.operands(instr)[0]] = instr
    out = []
    for comp, instrs in module["computations"].items():
        for instr in instrs:
            op = instr["op"]
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in hlo_lib.COLLECTIVES:
                continue
            result = done_of.get(instr["name"], instr) if op.endswith("-start") else instr
            groups = op_groups(instr, kind, num_devices)
            if groups is None:  # a replica_groups form this parser does not know: counted on axes "?"
                axes, exact, size = ("?",), False, 2
            else:
                size = 2 if kind == "collective-permute" else max((len(g) for g in groups), default=1)
                if not groups or size < 2:
                    continue  # no traffic: every device alone, or sending to itself
                axes, exact = groups_to_axes(groups, mesh_shape)
            count = mult.get(comp, 0)
            common = {"axes": axes, "partial": not exact, "group_size": size, "count": count,
                      "name": instr["name"], "async": op.endswith("-start"), "trip_count_unknown": comp in unknown}
            result_bytes = hlo_lib.shape_bytes(result["shape"])
            if kind == "ragged-all-to-all" and op.endswith("-start"):
                # What moves depends on the data; its buffers are the worst case (every row to one device). Counted:
                # the smaller of what a device sends and receives, its own rows when routing is balanced.
                arrays = re.findall(r"\w+\[[\d,]*\]", instr["shape"])[:2]
                result_bytes = min(map(hlo_lib.shape_bytes, arrays), default=result_bytes)
            # (kind, axes, group size, payload bytes, emitted as all-reduce + slice)
            parts = [(kind, axes, size, result_bytes * (size if kind == "reduce-scatter" else 1), False)]
            if kind == "all-reduce":  # all-reduce + slice to 1/n = reduce-scatter (the CPU pipeline has none)
                shape = result["shape"]
                elements = hlo_lib.tuple_elements(shape) if shape.startswith("(") else [shape]
                scattered = _scattered_elements(module, result, size)
                rs = sum(hlo_lib.shape_bytes(e) for e, sc in zip(elements, scattered) if sc)
                split, partly = _scatter_axes(module, result, axes, mesh_shape, replica_axes) if (
                    exact and not all(scattered)) else ((), [])
                n = math.prod(mesh_shape[a] for a in split)
                partly = partly or [False] * len(elements)
                rs_part = sum(hlo_lib.shape_bytes(e) for e, sc, p in zip(elements, scattered, partly) if p and not sc)
                rest = tuple(a for a in axes if a not in split)
                parts = [p for p in (("all-reduce", axes, size, result_bytes - rs - rs_part, False),
                                     ("reduce-scatter", axes, size, rs, True),
                                     ("reduce-scatter", split, n, rs_part, True),
                                     ("all-reduce", rest, size // n, rs_part / n, True)) if p[3]]
            for k, op_axes, op_size, payload, as_all_reduce in parts:
                out.append(dict(common, kind=k, axes=op_axes, group_size=op_size, bytes=payload * count,
                                wire_bytes=_WIRE[k](op_size) * payload * count, as_all_reduce=as_all_reduce))
    return out


def summarize_collectives(ops: list[dict]) -> list[dict]:
    """Per (kind, axes): count, bytes, wire_bytes summed."""
    rows: dict[tuple, dict] = {}
    for op in ops:
        key = (op["kind"], op["axes"])
        row = rows.setdefault(key, {"kind": op["kind"], "axes": op["axes"], "count": 0, "bytes": 0.0,
                                    "wire_bytes": 0.0, "partial": False, "trip_count_unknown": False})
        row["count"] += op["count"]
        row["bytes"] += op["bytes"]
        row["wire_bytes"] += op["wire_bytes"]
        row["partial"] |= op["partial"]
        row["trip_count_unknown"] |= op["trip_count_unknown"]
        row["as_all_reduce"] = row.get("as_all_reduce", False) | op.get("as_all_reduce", False)
    return sorted(rows.values(), key=lambda r: (hlo_lib.COLLECTIVES.index(r["kind"]), r["axes"]))
