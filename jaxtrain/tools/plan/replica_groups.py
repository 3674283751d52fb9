"""Replica groups -> mesh axes: which devices a collective in compiled HLO talks among, and along which axes.

XLA prints a collective's groups of partition ids in several forms (explicit lists, iota, its own mesh); partition
id i is the i-th device of the mesh in row-major order, so a group's mesh axes are those along which its members'
coordinates differ. The collectives table (`collectives.py`) names every op's axes this way.
"""

from __future__ import annotations

import math
import re

from jaxtrain.observe import hlo as hlo_lib


def _iota(reshape: list[int], perm: list[int] | None):
    import numpy as np  # noqa: PLC0415
    array = np.arange(math.prod(reshape)).reshape(reshape)
    return array.transpose(perm) if perm else array


def parse_replica_groups(text: str, num_devices: int | None = None) -> list[list[int]]:
    """The groups of partition ids in an HLO `replica_groups=` value, in any of its printed forms:

    explicit   {{0,1},{2,3}}        ({} = one group of all `num_devices`)
    iota       [2,4]<=[8]   or  [4,2]<=[4,2]T(1,0)   (iota over the reshape dims, transposed, as [groups, size])
    mesh axes  mesh['a'=4,'b'=2] {'a'}   (optional `, device_ids=([2,4]T(1,0))` or an id list; a sub-axis
               'a':(pre)size groups over that part of the axis)
    """
    import numpy as np  # noqa: PLC0415
    text = text.strip().rstrip(",")
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            return [list(range(num_devices))] if num_devices else []
        return [hlo_lib.ints(g) for g in re.findall(r"\{([^{}]*)\}", inner)]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        groups, size = hlo_lib.ints(m.group(1))
        array = _iota(hlo_lib.ints(m.group(2)), hlo_lib.ints(m.group(3)) if m.group(3) else None)
        return array.reshape(groups, size).tolist()
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = m.group(2)
        if ids:
            it = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$", ids.strip())
            devices = (_iota(hlo_lib.ints(it.group(1)), hlo_lib.ints(it.group(2)) if it.group(2) else None) if it
                       else np.array(hlo_lib.ints(ids)))
            devices = devices.reshape(sizes)
        else:
            devices = np.arange(math.prod(sizes)).reshape(sizes)
        # A sub-axis 'a':(pre)size is the middle factor of axis a reshaped to [pre, size, rest] (major to
        # minor), as in XLA's MeshAxesReplicaGroupList: split every axis at all its references' cuts.
        refs = [(n, int(p) if p else None, int(s) if s else None)
                for n, p, s in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", m.group(3)) if n]
        split, owner = [], []  # factor sizes, and (axis, first pre-size it covers)
        for name, size in zip(names, sizes):
            cuts = sorted({1, size} | {p for n, p, s in refs if n == name and p}
                          | {p * s for n, p, s in refs if n == name and p})
            for lo, hi in zip(cuts, cuts[1:]):
                split.append(hi // lo)
                owner.append((name, lo))
        group_dims = []
        for name, pre, size in refs:
            group_dims += [i for i, (n, lo) in enumerate(owner)
                           if n == name and (pre is None or pre <= lo < pre * size)]
        rest = [i for i in range(len(split)) if i not in group_dims]
        size = math.prod(split[i] for i in group_dims)
        return devices.reshape(split).transpose(rest + group_dims).reshape(-1, size).tolist()
    raise ValueError(f"unrecognised replica_groups {text[:80]!r}")


def groups_to_axes(groups, mesh_shape: dict) -> tuple[tuple[str, ...], bool]:
    """Mesh axes along which the members of the groups differ, in mesh order; and whether every group is
    exactly a full product of those axes (False = the groups cover part of an axis)."""
    import numpy as np  # noqa: PLC0415
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    varying: set[str] = set()
    exact = True
    for group in groups:
        if len(group) < 2:
            continue
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        axes = [names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1]
        varying |= set(axes)
        exact &= len(set(map(tuple, coords))) == math.prod(mesh_shape[a] for a in axes)
    return tuple(a for a in names if a in varying), exact


def _group_attr(rest: str) -> str | None:
    m = re.search(r"\breplica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)?\))?\s*\{[^}]*\}"
                  r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,\s]*\},?\s*)*\})", rest)
    return m.group(1) if m else None


def op_groups(instr, kind: str, num_devices: int) -> list[list[int]] | None:
    """Partition-id groups of a collective (for collective-permute: its source != target pairs); None if the
    replica_groups form is unknown."""
    if kind == "collective-permute":
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", instr["rest"])
        return [p for p in map(hlo_lib.ints, re.findall(r"\{(\d+,\d+)\}", pairs.group(1))) if p[0] != p[1]] \
            if pairs else []
    attr = _group_attr(instr["rest"])
    if attr is None:  # absent = all devices in one group
        return None if "replica_groups=" in instr["rest"] else [list(range(num_devices))]
    try:
        return parse_replica_groups(attr, num_devices)
    except ValueError:
        return None
