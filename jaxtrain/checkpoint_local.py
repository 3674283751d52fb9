"""Node-local checkpoints (`checkpoint.local_mode="node"`): each process writes only its own shards, to a disk of
its own, and one peer holds a replica of them. No file is shared; no process reads another's directory.

Process p's copy of a step is `<local_dir>/process-<p>/<step>/`: its unique shards (own.bin), the shards of its
predecessor p-k that p does not hold itself (replica.bin) and manifest.json (each shard's place and sha256, the
integrity record, the data state, the layout's fingerprint). The buddy offset k leaves the fewest bytes to copy
(none where `data` replicas span processes). The copy is a jitted `ppermute` over a (process, local device) mesh;
the files are written in a background thread and renamed into place (the commit). The Checkpointer verifies a
restore against the integrity record; only if that fails are the shards read again, each checked against its
sha256, which finds the damaged copy and takes that process's shards from its buddy.

Orbax's `experimental.emergency` does not fit: it keeps local copies only on non-primary `data` replicas, needs
two or more (no copy for fsdp across hosts), restores the first copy that lists a step without verifying it, and
moves shards through a socket server of its own (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import threading
import time

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import distributed

MODES = ("shared", "node")  # `shared`: one Orbax directory every process sees (the local tier before this module)
REPLICAS = ("peer", "none")
_FORMAT = 1
_MANIFEST, _OWN, _REPLICA = "manifest.json", "own.bin", "replica.bin"
_CHUNK_WORDS = 2**24  # uint32 words per device and round of a transfer (64 MiB): bounds the device memory it takes
_CANDIDATE_OFFSETS = 8  # buddy offsets priced per layout
# Statuses exchanged at restore.
OK, MISSING, DAMAGED = 0, 1, 2


class Damaged(Exception):
    """The step cannot be restored from the node-local tier; the damaged copies are already set aside."""


def _key(index, shape) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


@functools.lru_cache(maxsize=4096)
def _placement(sharding, shape: tuple[int, ...]) -> tuple:
    """((device, shard key), ...) of every device of `sharding`, by device id."""
    return tuple((d, _key(i, shape)) for d, i in sorted(sharding.devices_indices_map(shape).items(),
                                                         key=lambda kv: kv[0].id))


class Layout:
    """Which shards each process holds, in a fixed order per process, and the buddy offset (see module doc).

    `flat`: [(array path, array or ShapeDtypeStruct with its sharding)]. Built from global facts only, so every
    process computes the same one without talking to the others."""

    def __init__(self, flat):
        self.n = jax.process_count()
        self.names = [name for name, _ in flat]
        self.leaves = [(tuple(x.shape), np.dtype(x.dtype), x.sharding) for _, x in flat]
        self.own: list[list[tuple[int, tuple]]] = [[] for _ in range(self.n)]
        self.holders: dict[tuple[int, tuple], set[int]] = {}
        self.device_keys: list[dict] = []  # per leaf: {this process's device: shard key}
        described = []
        for i, (shape, dtype, sharding) in enumerate(self.leaves):
            placement = _placement(sharding, shape)
            seen = [set() for _ in range(self.n)]
            for device, key in placement:
                p = device.process_index
                self.holders.setdefault((i, key), set()).add(p)
                if key not in seen[p]:
                    seen[p].add(key)
                    self.own[p].append((i, key))
            self.device_keys.append({d: k for d, k in placement if d.process_index == jax.process_index()})
            described.append([self.names[i], list(shape), dtype.name, [[d.id, d.process_index, k]
                                                                      for d, k in placement]])
        self.fingerprint = hashlib.sha256(json.dumps([self.n, described]).encode()).hexdigest()[:32]
        self.offset = self._best_offset()

    def nbytes(self, entry) -> int:
        i, key = entry
        return math.prod(b - a for a, b in key) * self.leaves[i][1].itemsize

    def payload(self, p: int, offset: int | None = None) -> list[tuple[int, tuple]]:
        """The shards of process p its buddy (p + offset) does not hold itself: what it sends at a save."""
        buddy = (p + (self.offset if offset is None else offset)) % self.n
        return [e for e in self.own[p] if buddy not in self.holders[e]]

    def _best_offset(self) -> int:
        if self.n == 1:
            return 0
        near = sorted({(q - 0) % self.n for e in self.own[0] for q in self.holders[e]} - {0})
        candidates = sorted({1, *near[:_CANDIDATE_OFFSETS]})
        cost = {k: sum(self.nbytes(e) for p in range(self.n) for e in self.payload(p, k)) for k in candidates}
        return min(candidates, key=lambda k: (cost[k], k))


# ===== Moving bytes between processes ===============================================================================


@functools.lru_cache(maxsize=4)
def _transfer_mesh() -> Mesh:
    """(process, local device) over every device; one device per process where processes hold different counts."""
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in range(jax.process_count())]
    width = min(len(ds) for ds in by_process)
    return Mesh(np.array([ds[:width] for ds in by_process]), ("proc", "local"))


@functools.lru_cache(maxsize=16)
def _permute(mesh: Mesh, pairs: tuple[tuple[int, int], ...]):
    return jax.jit(jax.shard_map(lambda x: lax.ppermute(x, "proc", pairs), mesh=mesh, in_specs=P("proc", "local"),
                                 out_specs=P("proc", "local")))


def transfer(send: np.ndarray, pairs: tuple[tuple[int, int], ...], length: int) -> np.ndarray:
    """The uint8 buffer each process receives when process a sends `send` to process b for each (a, b) in `pairs`
    (all processes call it with the same `pairs` and `length`, the longest buffer sent). In rounds of at most
    _CHUNK_WORDS words per device, spread over each process's devices."""
    if not pairs or not length:
        return np.zeros(0, np.uint8)
    mesh = _transfer_mesh()
    width = mesh.devices.shape[1]
    words = -(-length // 4)
    per_device = min(_CHUNK_WORDS, 1 << max(0, (-(-words // width) - 1).bit_length()))  # a power of two: few programs
    rounds = -(-words // (width * per_device))
    padded = np.zeros(rounds * width * per_device * 4, np.uint8)
    padded[:len(send)] = send[:len(padded)]
    chunks = padded.view(np.uint32).reshape(rounds, width, per_device)
    received = np.empty_like(chunks)
    sharding = NamedSharding(mesh, P("proc", "local"))
    mine = list(mesh.devices[jax.process_index()])
    fn = _permute(mesh, pairs)
    for r in range(rounds):
        x = jax.make_array_from_single_device_arrays(
            (mesh.devices.shape[0], width * per_device), sharding,
            [jax.device_put(chunks[r, j][None], d) for j, d in enumerate(mine)])
        for shard in fn(x).addressable_shards:
            received[r, mine.index(shard.device)] = np.asarray(shard.data)[0]
    return received.reshape(-1).view(np.uint8)


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _mapped(path: str) -> np.ndarray:
    """A step file's bytes, mapped read-only rather than read: a node-local dir is tmpfs or a disk's page cache,
    and reading into fresh memory faulted in every page of it first (0.6 s of a 247 MB restore on 2 cores). The
    files are written once and renamed into place, never rewritten, so the mapping stays what was verified."""
    return np.memmap(path, np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)


def _sha(data) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


# ===== Is the directory this process's own? ========================================================================


def check_private(root) -> str | None:
    """Why `root` cannot be a node-local directory, the same answer on every process (collective), or None: some
    process cannot write it, or processes share it. Each writes a marker `.jaxtrain-node-<process>` holding a
    random nonce; after an allgather of the nonces (every marker is written by then), each looks for the others'
    markers with their current nonces (a marker left by a killed run holds another), and a second allgather
    shares what each saw. Processes sharing one disk can lose it together, with their replicas: a node-local
    copy is only as safe as that disk, so the dir must be each process's own."""
    root = os.path.abspath(str(root))
    p, n = jax.process_index(), jax.process_count()
    nonce, problem = secrets.randbits(31), None  # allgather sends int32 (no jax_enable_x64)
    marker = [os.path.join(root, f".jaxtrain-node-{q}") for q in range(n)]
    try:
        os.makedirs(root, exist_ok=True)
        with open(marker[p], "w") as f:
            f.write(str(nonce))
    except OSError as e:
        nonce, problem = -1, f"{root}: not writable by process {p} ({e.strerror or e})"
    try:
        if n == 1:
            return problem
        nonces = distributed.allgather([nonce, -1, 0])[:, 0]
        seen = [q for q in range(n) if q != p and min(nonce, nonces[q]) >= 0
                and _reads(marker[q]) == str(nonces[q])]
        table = distributed.allgather([nonce < 0, len(seen), 0])
    finally:
        if nonce >= 0:
            with contextlib.suppress(OSError):
                os.remove(marker[p])
    if unwritable := [q for q in range(n) if table[q, 0]]:
        return problem or f"{root}: not writable by process {unwritable[0]}"
    if sharing := [q for q in range(n) if table[q, 1]]:
        listed = ", ".join(map(str, sharing[:8])) + (f" and {len(sharing) - 8} more" if len(sharing) > 8 else "")
        return (f"{root} is shared by processes {listed} (each sees another's marker file there): local_mode=node "
                f"needs each node's own disk or /dev/shm; use checkpoint.local_mode=shared for a directory every "
                f"process sees")
    return None


def _reads(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


# ===== The tier =====================================================================================================


class NodeTier:
    """This process's node-local directory `<root>/process-<index>`, keeping its newest `keep` steps.

    Every method that takes a layout is collective: all processes call it at the same point. `replica`: "peer"
    (a buddy holds a replica) or "none"."""

    def __init__(self, root, keep: int, replica: str = "peer"):
        self.root = os.path.abspath(str(root))
        self.path = os.path.join(self.root, f"process-{jax.process_index()}")
        self.keep, self.replica = keep, replica
        self.saving: int | None = None  # step of the save in flight
        self.closed = False
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._layout: tuple[list, Layout] | None = None
        self._swept = False  # partial saves of an earlier process removed (at the first save, not by readers)

    # -- what is here --

    def layout(self, flat) -> Layout:
        described = [(name, tuple(x.shape), np.dtype(x.dtype), x.sharding) for name, x in flat]
        if self._layout is None or self._layout[0] != described:
            self._layout = (described, Layout(flat))
        return self._layout[1]

    def step_path(self, step: int) -> str:
        return os.path.join(self.path, str(step))

    def all_steps(self) -> list[int]:
        """This process's committed steps (a step dir exists only once renamed into place)."""
        try:
            return sorted(int(n) for n in os.listdir(self.path) if n.isdigit())
        except FileNotFoundError:
            return []

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def manifest(self, step: int) -> dict:
        with open(os.path.join(self.step_path(step), _MANIFEST)) as f:
            return json.load(f)

    def reload(self) -> None:
        """Nothing cached: the directory is read each time."""

    # -- saving --

    def in_progress(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_save(self, step: int, flat, record: dict, data_json: str) -> str | None:
        """Copies this process's shards to the host, sends the buddy its replica (collective) and writes both in
        the background; returns why it could not start, or None."""
        error = self.wait()
        layout = self.layout(flat)
        if not distributed.allgather([step not in self.all_steps()]).any():
            return error  # committed everywhere already (the step a run resumed from)
        own, problem = [], None
        try:
            own = self._host_shards(flat, layout)
        except Exception as e:  # noqa: BLE001 - reported by the caller; the collective below still runs
            problem = f"saving step {step} to {self.path} failed: {type(e).__name__}: {e}"
        p, k = jax.process_index(), layout.offset
        received = np.zeros(0, np.uint8)
        if self.replica == "peer" and k:
            lengths = [sum(layout.nbytes(e) for e in layout.payload(q)) for q in range(layout.n)]
            if max(lengths):
                wanted = {e for e in layout.payload(p)}
                send = np.concatenate([np.zeros(0, np.uint8)] + [b for e, b in zip(layout.own[p], own) if e in wanted])
                if problem:
                    send = np.zeros(lengths[p], np.uint8)
                pairs = tuple((q, (q + k) % layout.n) for q in range(layout.n))
                received = transfer(send, pairs, max(lengths))[:lengths[(p - k) % layout.n]]
        if problem:
            return problem
        self._sweep()
        manifest = {"format": _FORMAT, "step": step, "process": p, "processes": layout.n, "offset": k,
                    "layout": layout.fingerprint, "record": record, "data": json.loads(data_json)}
        self.saving, self._error = step, None
        self._thread = threading.Thread(target=self._write, args=(step, layout, own, received, manifest),
                                        name=f"jaxtrain-node-save-{step}", daemon=True)
        self._thread.start()
        return error

    def _host_shards(self, flat, layout: Layout) -> list[np.ndarray]:
        """This process's own shards (layout.own order) as uint8 host buffers."""
        by_key = {}
        for i, (_, x) in enumerate(flat):
            for shard in x.addressable_shards:
                by_key.setdefault((i, layout.device_keys[i][shard.device]), shard)
        return [_bytes(np.asarray(by_key[e].data)) for e in layout.own[jax.process_index()]]

    def _write(self, step: int, layout: Layout, own: list[np.ndarray], received: np.ndarray, manifest: dict):
        tmp = self.step_path(step) + f".tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            p, k = jax.process_index(), layout.offset
            entries = []
            with open(os.path.join(tmp, _OWN), "wb") as f:
                offset = 0
                for (i, key), data in zip(layout.own[p], own):
                    f.write(memoryview(data))
                    entries.append(self._entry(layout, i, key, "own", offset, data))
                    offset += data.size
                _sync(f)
            with open(os.path.join(tmp, _REPLICA), "wb") as f:
                f.write(memoryview(received))
                _sync(f)
            offset = 0
            for i, key in layout.payload((p - k) % layout.n) if received.size else []:
                n = layout.nbytes((i, key))
                entries.append(self._entry(layout, i, key, "replica", offset, received[offset:offset + n]))
                offset += n
            manifest["shards"] = entries
            with open(os.path.join(tmp, _MANIFEST), "w") as f:
                json.dump(manifest, f)
                _sync(f)
            if os.path.exists(self.step_path(step)):  # the same step, committed earlier: keep that copy
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, self.step_path(step))  # the commit
            for old in self.all_steps()[:-self.keep]:
                shutil.rmtree(self.step_path(old), ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - reported by wait()
            shutil.rmtree(tmp, ignore_errors=True)  # this save's own partial write: nothing else to clean it
            self._error = f"saving step {step} to {self.path} failed: {type(e).__name__}: {e}"

    @staticmethod
    def _entry(layout: Layout, i: int, key, file: str, offset: int, data) -> dict:
        return {"array": layout.names[i], "index": [list(ab) for ab in key], "file": file, "offset": offset,
                "nbytes": int(data.size), "sha256": _sha(data)}

    def _sweep(self) -> None:
        if self._swept:
            return
        os.makedirs(self.path, exist_ok=True)
        for name in os.listdir(self.path):
            if re.fullmatch(r"\d+\.tmp-\d+", name):  # a save killed midway: never committed, never verified
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)
        self._swept = True

    def wait(self) -> str | None:
        """Waits for the save in flight; returns its error or None."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.saving, error, self._error = None, self._error, None
        return error

    def rebuild(self, step: int) -> str | None:
        """After a failed save: nothing to rebuild (the next save writes a fresh step dir)."""
        self.saving = None
        return None

    def close(self) -> None:
        self.wait()

    # -- restoring --

    def agreed_steps(self, flat) -> tuple[dict[int, tuple[str, ...]], list[int]]:
        """({step: each process's source, "local_dir" or "peer"} of every step that each process can read from its
        own copy or its buddy's, the same on all processes (one allgather); this process's steps saved with
        another layout (another mesh, process count or state), which no process uses)."""
        layout = self.layout(flat)
        mine, other = [], []
        for step in reversed(self.all_steps()):
            try:
                fits = self.manifest(step)["layout"] == layout.fingerprint
            except Exception:  # noqa: BLE001 - an unreadable manifest is damage, which the load reports
                fits = True
            (mine if fits else other).append(step)
        width = self.keep + 8
        table = distributed.allgather((mine[:width] + [-1] * width)[:width])
        have = [set(int(s) for s in row if s >= 0) for row in table]
        agreed = {}
        for step in sorted(set().union(*have)):
            sources = []
            for p in range(layout.n):
                if step in have[p]:
                    sources.append("local_dir")
                elif self._buddy(layout) and step in have[(p + layout.offset) % layout.n]:
                    sources.append("peer")
            if len(sources) == layout.n:
                agreed[step] = tuple(sources)
        return agreed, other

    def _buddy(self, layout: Layout) -> bool:
        return self.replica == "peer" and layout.offset > 0

    def load(self, step: int, flat, sources: tuple[str, ...], check_shards: bool = True):
        """(arrays in `flat`'s order, the integrity record, the data state, the sources used, notes for the log)
        of `step`, each shard checked for its size and, with `check_shards`, its sha256. A process whose own copy
        is damaged gets its shards from its buddy too; a damaged copy is moved aside. Raises Damaged (on every
        process) when some process can get its shards from neither."""
        layout = self.layout(flat)
        p, n, k = jax.process_index(), layout.n, layout.offset
        buddy = self._buddy(layout)
        shards, header, status, bad = None, None, MISSING, -1
        if sources[p] == "local_dir":
            status, bad, shards, header = self._read_own(step, layout.own[p], layout, check_shards)
        table = distributed.allgather([status, bad])
        needy = [q for q in range(n) if table[q, 0] != OK]
        serve, serve_bad, payload = -1, -1, np.zeros(0, np.uint8)
        if buddy and (p - k) % n in needy:  # this process serves its predecessor
            serve, serve_bad, body, head = self._read_own(step, layout.own[(p - k) % n], layout, check_shards)
            if serve == OK:
                text = json.dumps(head).encode()
                payload = np.concatenate([np.frombuffer(len(text).to_bytes(8, "little") + text, np.uint8), *body])
        table2 = distributed.allgather([serve, serve_bad, payload.size])
        server = {q: (q + k) % n for q in needy}
        unserved = [q for q in needy if not buddy or table2[server[q], 0] != OK]
        notes = []
        for q in needy:
            if table[q, 0] == DAMAGED:
                notes.append(self._note(step, q, table[q, 1], layout)
                             + ("" if q in unserved else f"; its shards came from process {server[q]}"))
            if buddy and table2[server[q], 0] == DAMAGED:
                notes.append(self._note(step, server[q], table2[server[q], 1], layout,
                                        f" (holding process {q}'s replica)"))
        if DAMAGED in (status, serve):
            self.move_aside(step)
        if unserved:
            raise Damaged(f"process {', '.join(map(str, unserved))} can get its shards of step {step} from neither "
                          f"its own copy nor a peer's" + (f" ({'; '.join(notes)})" if notes else ""))
        received = transfer(payload, tuple((server[q], q) for q in needy), int(table2[:, 2].max()))
        if p in needy:
            size = int(received[:8].view(np.uint64)[0])
            header, offset, shards = json.loads(received[8:8 + size].tobytes()), 8 + size, []
            for e in layout.own[p]:
                shards.append(received[offset:offset + layout.nbytes(e)])
                offset += layout.nbytes(e)
        used = tuple("peer" if q in needy else "local_dir" for q in range(n))
        arrays = self._arrays(layout, dict(zip(layout.own[p], shards)))
        return arrays, header["record"], header["data"], used, notes

    def _read_own(self, step: int, wanted, layout: Layout, check: bool = True):
        """(status, the leaf that failed or -1, the shards `wanted` ([(leaf, key)]) of this process's copy of
        `step`, {"record", "data"} of its manifest), each shard checked for its size and, with `check`, its
        sha256."""
        if step not in self.all_steps():
            return MISSING, -1, None, None
        try:
            manifest = self.manifest(step)
            if manifest.get("format") != _FORMAT or manifest.get("layout") != layout.fingerprint:
                raise ValueError("manifest of another format or layout")
            index = {(e["array"], tuple(tuple(ab) for ab in e["index"])): e for e in manifest["shards"]}
            files, out = {}, []
            for i, key in wanted:
                e = index[(layout.names[i], key)]
                if e["file"] not in files:
                    files[e["file"]] = _mapped(os.path.join(self.step_path(step), f"{e['file']}.bin"))
                data = files[e["file"]][e["offset"]:e["offset"] + e["nbytes"]]
                if data.size != layout.nbytes((i, key)) or (check and _sha(data) != e["sha256"]):
                    return DAMAGED, i, None, None
                out.append(data)
            return OK, -1, out, {"record": manifest["record"], "data": manifest["data"]}
        except Exception:  # noqa: BLE001 - missing or truncated files, broken JSON
            return DAMAGED, -1, None, None

    def _note(self, step: int, q: int, leaf: int, layout: Layout, what: str = "") -> str:
        why = f"checksum mismatch in {layout.names[leaf]}" if leaf >= 0 else "unreadable"
        return (f"process {q}'s node-local copy of step {step}{what} is damaged ({why}); moved aside to "
                f"{step}.corrupt-<unix time> in its directory")

    @staticmethod
    def _arrays(layout: Layout, shards: dict) -> list[jax.Array]:
        out = []
        for i in range(len(layout.leaves)):
            shape, dtype, sharding = layout.leaves[i]
            kind = getattr(sharding, "memory_kind", None)
            pieces = []
            for device, key in sorted(layout.device_keys[i].items(), key=lambda kv: kv[0].id):
                # No copy here: device_put makes the one a device needs (none for an aligned CPU shard, which
                # then stays backed by the read-only mapping; jax never writes into a buffer it does not own).
                host = np.frombuffer(shards[(i, key)], dtype).reshape([b - a for a, b in key])
                pieces.append(jax.device_put(host, SingleDeviceSharding(device, memory_kind=kind)))
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
        return out

    def move_aside(self, step: int) -> str | None:
        """Renames this process's copy of `step` to `<step>.corrupt-<unix time>` (never deleted); None if it has
        none."""
        src = self.step_path(step)
        if not os.path.isdir(src):
            return None
        dst, n = f"{src}.corrupt-{int(time.time())}", 1
        while os.path.exists(dst):
            dst, n = f"{src}.corrupt-{int(time.time())}-{n}", n + 1
        os.rename(src, dst)
        return dst


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
