"""Orbax checkpoints with save policies, an optional fast local tier, integrity checks and fault handling.

Each step directory holds three Orbax items: `state/` (the sharded train state), `data/` (the data pipeline's
position, JSON) and `integrity/` (shape, dtype and a sharding-independent checksum per array, a hash of data/,
and the stacked layers' order). Orbax commits a step atomically and garbage-collects old steps only after a
new one commits, but it does not notice a flipped bit in array data: restore recomputes the checksums, and a
copy that fails to load or verify is moved aside (`<step>.corrupt-<unix time>`, never deleted) in favour of
the previous one. Restoring into an abstract target with the current shardings reshards on the fly (another
mesh or device count), and the layers are moved into the restoring run's pipeline order after verifying. The
local tier is one more such directory, or node-local per process with a replica on a peer (checkpoint_local).
docs/reliability.md has the whole story.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

from jaxtrain import checkpoint_local, compile_cache, files, storage
from jaxtrain.errors import CheckpointError, CheckpointMismatch, ConfigError, DataError
from jaxtrain.fields import Group
from jaxtrain.parallel import distributed
from jaxtrain.parallel import pipeline as pipeline_parallel

_FORMAT = 1
WRITE_ERROR_POLICIES = ("stop", "continue")
# The config's `checkpoint` group. `dir`: where the checkpoints live ("" = <workdir>/checkpoints; a local path,
# gs:// or s3://). Saves every `every_steps` and every `every_minutes` (0 = off); keeps the latest `keep` plus every
# `keep_period`-th step (0 = none). `local_dir` (optional) is a faster disk saved every `local_every_steps`;
# restore takes the newest verified copy in either. `local_mode`: "shared" (one Orbax directory every process
# sees) or "node" (each process's own shards in `<local_dir>/process-<i>`, on its own disk or /dev/shm, with a
# replica on a peer unless `local_replica` is "none"). `on_write_error`: "stop" (exit 4) or "continue" (warn; the
# next save tries again). A good checkpoint is never deleted.
CONFIG = dict(dir="", every_steps=50, every_minutes=0.0, keep=3, keep_period=0, local_dir="", local_every_steps=0,
              local_keep=2, local_mode="shared", local_replica="peer", on_write_error="stop")
URL_SCHEMES = ("gs://", "s3://")  # tensorstore's gcs driver through Orbax; its s3 one through compat.orbax_s3
# Orbax builds tensorstore specs for local paths and gs:// only. jaxtrain.compat.orbax_s3.install(), which entry
# points and train.run call, extends them to s3:// and records here whether it could (None: it did).
S3_NEEDS_INSTALL = ("s3:// checkpoints need jaxtrain.compat.install() in this process first (jaxtrain's commands "
                    "and train.run call it)")
s3_problem: str | None = S3_NEEDS_INSTALL


def check_config(c) -> None:
    """ConfigError naming the first bad field of the `checkpoint` group."""
    g = Group(c, "checkpoint")
    g.positive_int("every_steps")
    g.number("every_minutes", lo=0)
    g.positive_int("keep")
    g.positive_int("keep_period", allow_zero=True)
    g.positive_int("local_every_steps", allow_zero=True)
    g.positive_int("local_keep")
    g.choice("local_mode", checkpoint_local.MODES)
    g.choice("local_replica", checkpoint_local.REPLICAS)
    if c.local_mode == "node" and "://" in str(c.local_dir):
        raise ConfigError("checkpoint.local_dir", f"{c.local_dir}: local_mode=node writes to each machine's own "
                          f"disk or /dev/shm: give a local path")
    for name in ("dir", "local_dir"):
        value = c[name]
        if not isinstance(value, str):
            raise ConfigError(f"checkpoint.{name}", f"must be a path or empty, got {value!r}")
        if "://" in value and not value.startswith(URL_SCHEMES):
            raise ConfigError(f"checkpoint.{name}", f"{value}: Orbax writes checkpoints to a local path or "
                              f"{' '.join(URL_SCHEMES)} only")
        client = {"gs://": "gcsfs", "s3://": "s3fs"}.get(value[:5])  # epath's way to the metadata files
        if client and importlib.util.find_spec(client) is None:
            raise ConfigError(f"checkpoint.{name}", f"{value}: needs {client} (pip install 'jaxtrain[cloud]')")
        if value.startswith("s3://") and s3_problem:
            raise ConfigError(f"checkpoint.{name}", f"{value}: {s3_problem}")
    if bool(c.local_dir) != bool(c.local_every_steps):
        raise ConfigError("checkpoint.local_every_steps", "set both checkpoint.local_dir and "
                          "checkpoint.local_every_steps, or neither")
    g.choice("on_write_error", WRITE_ERROR_POLICIES)
_COMMIT_MARKER = "commit_success.txt"  # Orbax >= 0.12.8 writes it on every backend, then renames on POSIX


class _Corrupt(Exception):
    """This copy of a step is unusable; an older one may be."""


# ===== Checksums =====================================================================================================
# Exact integer arithmetic: every element's bits as uint32 words, times an odd factor that depends on the element's
# global position, summed modulo 2**32. Wrapping addition is associative and commutative, so the result is
# bit-identical whatever the sharding and reduction order. A changed word changes its term (an odd factor is
# invertible mod 2**32), so any single flipped bit changes the sum. A second sum over a bijective remix of the
# words, with unrelated factors, makes accidental collisions of multi-element damage unlikely (about 2**-64).


def _fmix(h):
    """murmur3's finaliser: a bijection on uint32 that scatters nearby inputs."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x):
    """The exact bits of `x` as uint32 words (narrow types zero-extended, 64-bit ones split in two)."""
    dt = jnp.dtype(x.dtype)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return _words(jnp.stack([x.real, x.imag], axis=-1))
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = (jnp.finfo if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo)(dt).bits
    if bits < 8:  # int4, float4...: widening to 32 bits keeps every value (and the sign of zero) distinct
        return _words(x.astype(jnp.float32 if jnp.issubdtype(dt, jnp.floating) else jnp.int32))
    unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint32}[bits]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _terms(x):
    """The two sums' terms, per word of `x`: the word, and its remix, each times a factor of its global position."""
    w = _words(x)
    pos = jnp.zeros(w.shape, jnp.uint32)  # row-major global index (mod 2**32), built from iotas: no int64 needed
    stride = 1
    for d in reversed(range(w.ndim)):
        pos = pos + lax.broadcasted_iota(jnp.uint32, w.shape, d) * np.uint32(stride)
        stride = stride * w.shape[d] % 2**32
    f1 = _fmix(pos) | np.uint32(1)
    f2 = _fmix(pos ^ np.uint32(0x5BD1E995)) | np.uint32(1)
    return w * f1, _fmix(w) * f2


def _array_checksum(x):
    # Both sums in one variadic reduce: one pass over the words, which XLA:CPU also runs about 10x faster than two
    # jnp.sum calls (scripts/bench_checksum.py). The same sums: wrapping addition does not care about the order.
    terms, zero = _terms(x), np.uint32(0)
    sums = lax.reduce(terms, (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(terms[0].ndim)))
    return jnp.stack(sums)


@compile_cache.cached
@jax.jit
def _checksum_leaves(leaves):  # host-memory leaves (optim.offload) are summed on their device
    return [_array_checksum(jax.device_put(x, jax.memory.Space.Device)) for x in leaves]


def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _flatten(tree) -> list[tuple[str, object]]:
    flat = [(_path_str(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for name, leaf in flat:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"checkpoint state leaf {name!r} is a {type(leaf).__name__}; expected an array")
    return flat


def checksums(tree) -> dict[str, str]:
    """{array path: 16 hex digits}, computed on the arrays' devices; only the digests leave them."""
    flat = _flatten(tree)
    sums = jax.device_get(_checksum_leaves([leaf for _, leaf in flat]))
    return {name: f"{int(s[0]):08x}{int(s[1]):08x}" for (name, _), s in zip(flat, sums)}


def _describe(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:300]}"  # tensorstore appends kilobytes of spec JSON


def _canonical_json(data) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


# Every decision that changes what gets saved or restored must be the same on all processes, or their collectives
# (and Orbax's barriers) stop lining up: such decisions go through distributed.any_process / from_process_0.


# ===== One checkpoint directory =====================================================================================


def directory(c, workdir) -> str:
    """The checkpoint directory of the config's `checkpoint` group `c` for `workdir`."""
    return c.dir or os.path.join(str(workdir), "checkpoints")


def _bucket_problem(url) -> str | None:
    """Why checkpoints cannot go to `url`'s bucket: it does not exist (Orbax would create an S3 bucket
    silently, with the endpoint's defaults)."""
    bucket = storage.bucket_of(url)
    try:
        if storage.exists(bucket):
            return None
    except DataError as e:
        return str(e)
    return (f"{url}: bucket {bucket} does not exist (or these credentials cannot see it); jaxtrain does not create "
            f"buckets: create it with its location and retention settings first")


def check_paths(directory, local_directory: str | None = None, field: str = "workdir") -> None:
    """ConfigError unless both can be checkpoint directories, and different ones; a run checks this before its
    workdir exists, rather than fail its first save after training started."""
    problem = files.dir_problem(directory) if "://" not in str(directory) else _bucket_problem(directory)
    if problem:
        raise ConfigError(field, f"checkpoints: {problem}" if field == "workdir" else problem)
    if local_directory:
        local = str(local_directory)
        if "://" not in local and (problem := files.dir_problem(local)):
            raise ConfigError("checkpoint.local_dir", problem)
        if os.path.abspath(local) == os.path.abspath(str(directory)):
            raise ConfigError("checkpoint.local_dir", f"{local} is the checkpoint directory itself; give a separate "
                              f"(faster, local) directory")


def _state_handler() -> ocp.StandardCheckpointHandler:
    """Orbax's handler for the train state, writing replicated arrays without replica-parallel slices where they
    gain nothing: in a one-process run (one writer either way) and below 1 MiB a slice. Each slice is a compiled
    program per shape and device: 64 in the first save of a tiny model on 8 CPU devices. Either kind of
    checkpoint restores with either setting (only the chunks differ: whole shards, or slices of them)."""
    from orbax.checkpoint._src.metadata import array_metadata_store  # as Orbax's own default ArrayHandler has

    arrays = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(), use_replica_parallel=jax.process_count() > 1,
        min_slice_bytes_for_replica_parallel=2**20)
    handler = ocp.StandardCheckpointHandler()
    # StandardCheckpointHandler takes no type registry; its PyTree handler does (an Orbax without `_impl` saves
    # as before, in slices).
    if isinstance(getattr(handler, "_impl", None), ocp.PyTreeCheckpointHandler):
        registry = ocp.type_handlers.create_type_handler_registry(
            *[(t, ocp.type_handlers.get_type_handler(t)) for t in (int, float, bytes, np.number, np.ndarray, str)],
            (jax.Array, arrays))
        handler._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, save_concurrent_gb=96,
                                                    restore_concurrent_gb=96)  # StandardCheckpointHandler's
    return handler


class _Dir:
    """A CheckpointManager over one directory, rebuilt after a failed save: a manager whose background save
    failed keeps stale errors and a step list without the steps it meant to garbage-collect."""

    def __init__(self, path: str, keep: int, keep_period: int, async_save: bool):
        self.path = path if "://" in path else os.path.abspath(path)  # tensorstore needs absolute local paths
        if self.path.startswith("s3://") and s3_problem:
            raise CheckpointError(f"{self.path}: {s3_problem}")
        policy = ocp.checkpoint_managers.LatestN(keep)
        if keep_period:
            policy = ocp.checkpoint_managers.AnyPreservationPolicy(
                [policy, ocp.checkpoint_managers.EveryNSteps(keep_period)])
        # Synchronous directory creation: an unwritable directory then fails the save call itself, instead of
        # leaving the save's other writers blocked on a "directory created" signal until Orbax's timeout.
        self.options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, enable_async_checkpointing=async_save, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False), cleanup_tmp_directories=True,
            temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath if self.path.startswith(
                "s3://") else None)  # S3 has no rename: the commit marker, written last, commits a step
        self.saving: int | None = None  # step of the save in flight
        self.abandoned: set[int] = set()  # steps whose failed save may leave a tmp dir behind (remove_abandoned)
        self.manager = self._open(self.options)
        self.closed = False  # a rebuild could not reopen the directory (its endpoint down): reopened by the next save

    def _open(self, options):
        return ocp.CheckpointManager(self.path, options=options, item_handlers={
            "state": _state_handler(), "data": ocp.JsonCheckpointHandler(),
            "integrity": ocp.JsonCheckpointHandler()})

    def rebuild(self, step: int) -> str | None:
        """A fresh manager after the failed save of `step`; returns why it could not be made, or None."""
        with contextlib.suppress(Exception):  # leftovers of the failure that is being reported already
            self.manager.close()
        self.saving = None
        # No tmp cleanup yet: writers of the failed save may still be running (Orbax reports the first error
        # without waiting for the rest) and would race the removal. The next save removes it.
        self.abandoned.add(step)
        return self._reopen()

    def _reopen(self) -> str | None:
        try:  # Orbax lists the directory: a bucket whose endpoint is down fails here too
            self.manager = self._open(dataclasses.replace(self.options, cleanup_tmp_directories=False))
        except Exception as e:  # noqa: BLE001 - reported as CheckpointError by the caller (exit 4, not a traceback)
            self.closed = True
            return f"{self.path}: cannot reopen the checkpoint directory after a failed save ({_describe(e)})"
        self.closed = False
        return None

    def remove_abandoned(self):
        """Removes the tmp dirs of earlier failed saves (primary process, best effort): on a full disk partial
        writes must not pile up. Their steps are kept: a writer of a failed save may still be running (Orbax
        reports the first error without waiting for the rest) and write its dir again after a removal, so each
        save and the close remove what they find."""
        if jax.process_index() != 0:
            self.abandoned.clear()
        if not self.abandoned:
            return
        steps = {str(step) for step in self.abandoned}
        with contextlib.suppress(OSError):
            for tmp in epath.Path(self.path).glob("*.orbax-checkpoint-tmp*"):
                if tmp.name.split(".")[0] in steps:
                    with contextlib.suppress(OSError):  # a dir still being written: the next call retries
                        tmp.rmtree()

    def wait(self) -> str | None:
        """Waits for the save in flight; returns its error or None."""
        step, self.saving = self.saving, None
        try:
            self.manager.wait_until_finished()
            return None
        except Exception as e:  # noqa: BLE001 - reported as CheckpointError by the caller
            return f"saving step {step} to {self.path} failed: {_describe(e)}"

    def in_progress(self) -> bool:
        return self.manager.is_saving_in_progress()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def reload(self) -> None:
        self.manager.reload()

    def close(self) -> None:
        if not self.closed:
            self.manager.close()
            self.remove_abandoned()

    def start_save(self, step: int, state, record: dict, canonical: str) -> str | None:
        if self.closed and (problem := self._reopen()):
            return problem
        if step in self.manager.all_steps():
            return None  # already committed here (e.g. the step a run resumed from)
        self.remove_abandoned()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(json.loads(canonical)),
                                  integrity=ocp.args.JsonSave(record))
        try:
            self.manager.save(step, args=args, force=True)
            self.saving = step
            return None
        except Exception as e:  # noqa: BLE001 - reported as CheckpointError by the caller
            return f"saving step {step} to {self.path} failed: {_describe(e)}"

    def step_path(self, step: int) -> epath.Path:
        return epath.Path(self.path) / str(step)

    def load(self, step: int, abstract_state, run_id: str | None = None, resettable: tuple[str, ...] = ()):
        """(state, data_state, layer order, the `resettable` items that start from zeros) of `step`, verified.
        Raises _Corrupt, or CheckpointError if the checkpoint does not match `abstract_state` (a different model:
        older steps would not help either). A `resettable` top-level item whose saved arrays differ from the
        target's, or are missing, is not read: it starts from zeros.

        The outcome is the same on every process, and so are the collectives on the way: a process whose shards
        fail to read must not skip the checksum computation that the others run. That is also why the items
        are read with their handlers directly: CheckpointManager.restore ends in a barrier without timeout,
        which a process that raised would never reach.
        """
        path = self.step_path(step)
        record = _agreed(lambda: _read_record(path, abstract_state, step, self.path, run_id, resettable))
        reset = [k for k in resettable
                 if k in abstract_state and _saved_arrays(record["arrays"], k) != _shapes(abstract_state, k)]
        target = {k: v for k, v in abstract_state.items() if k not in reset}
        unread = tuple(k for k in resettable if k not in target)
        partial = any(_saved_arrays(record["arrays"], k) for k in unread)
        state, data = _agreed(lambda: _read_items(path, target, partial))
        _verify(state, data, record, unread)
        for k in reset:
            state[k] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), abstract_state[k])
        return state, data, record["layer_order"], reset

    def move_aside(self, step: int) -> str:
        """Renames a bad step out of Orbax's sight (its listing only matches bare step numbers, and tmp cleanup
        only `*.orbax-checkpoint-tmp*`), so the step can be saved again and nobody deletes the evidence."""
        src = self.step_path(step)
        stamp = int(time.time())
        stamp = int(distributed.allgather([stamp])[0, 0])  # process 0's
        dst, n = src.parent / f"{src.name}.corrupt-{stamp}", 1
        while dst.exists():
            dst, n = src.parent / f"{src.name}.corrupt-{stamp}-{n}", n + 1
        distributed.allgather([])  # everyone has picked the name before it exists
        if jax.process_index() == 0:
            if storage.is_url(src):
                storage.move_dir(str(src), str(dst))
            else:
                src.rename(dst)
        distributed.allgather([])
        self.manager.reload()
        return str(dst)


def _verify(state, data, record: dict, unread: tuple[str, ...] = ()) -> None:
    """Raises _Corrupt on every process unless `state` and `data` match the integrity record (a collective)."""
    sums = checksums(state)  # a collective: every process gets here
    bad = sorted(name for name, (_, _, digest) in record["arrays"].items()
                 if sums.get(name) != digest and not _under(name, unread))

    def verdict():
        if bad:
            raise _Corrupt(f"checksum mismatch in {', '.join(bad)}")
        if hashlib.sha256(_canonical_json(data).encode()).hexdigest() != record["data_sha256"]:
            raise _Corrupt("data state differs from its recorded hash")

    _agreed(verdict)


def _agreed(fn):
    """fn()'s result if it succeeded on every process; otherwise raises the worst outcome anywhere (a mismatch
    with the requested state beats damage) on all of them."""
    try:
        result, error = fn(), None
    except (_Corrupt, CheckpointError) as e:
        result, error = None, e
    except Exception as e:  # noqa: BLE001 - truncated or missing files, broken JSON, ...: damage
        result, error = None, _Corrupt(f"failed to load: {_describe(e)}")
    rank = 2 if isinstance(error, CheckpointError) else int(error is not None)
    if jax.process_count() > 1:
        worst = int(distributed.allgather([rank]).max())
        if worst > rank:
            error = (CheckpointError if worst == 2 else _Corrupt)("failed on another process")
    if error is not None:
        raise error
    return result


def _read_record(path: epath.Path, abstract_state, step: int, directory: str, run_id: str | None = None,
                 resettable: tuple[str, ...] = ()) -> dict:
    if not (path / _COMMIT_MARKER).exists():
        raise _Corrupt(f"missing commit marker {_COMMIT_MARKER}")
    try:
        record = ocp.JsonCheckpointHandler().restore(path / "integrity")
    except Exception as e:
        raise _Corrupt(f"unreadable integrity record: {_describe(e)}") from e
    return _parse_record(record, abstract_state, step, directory, run_id, resettable)


def _parse_record(record: dict, abstract_state, step: int, directory: str, run_id: str | None = None,
                  resettable: tuple[str, ...] = ()) -> dict:
    """An integrity record as read, checked: its step and run, and its arrays against `abstract_state`'s."""
    try:
        record = dict(record)
        record["arrays"] = {name: (tuple(a["shape"]), a["dtype"], a["checksum"])
                            for name, a in record["arrays"].items()}
        record["data_sha256"] = str(record["data_sha256"])
        order = record.get("layer_order")
        record["layer_order"] = None if order is None else tuple(int(i) for i in order)
        if order is not None and not pipeline_parallel.is_layer_order(record["layer_order"], len(order)):
            raise ValueError(f"layer_order {order} is not an order of layers")
    except Exception as e:
        raise _Corrupt(f"unreadable integrity record: {_describe(e)}") from e
    _check_identity(record, step, run_id)
    _check_matches({n: a for n, a in record["arrays"].items() if not _under(n, resettable)},
                   {k: v for k, v in abstract_state.items() if k not in resettable}, step, directory)
    return record


def _under(name: str, keys) -> bool:
    """Whether the array path `name` lies in one of the top-level items `keys`."""
    return any(name == k or name.startswith(f"{k}/") for k in keys)


def _saved_arrays(arrays: dict, key: str) -> dict:
    """{path: (shape, dtype)} of the saved arrays under the top-level item `key` (an integrity record's)."""
    return {name: (shape, dtype) for name, (shape, dtype, _) in arrays.items() if _under(name, (key,))}


def _shapes(abstract_state, key: str) -> dict:
    return {name: (tuple(leaf.shape), str(jnp.dtype(leaf.dtype))) for name, leaf in _flatten(
        {key: abstract_state[key]})}


def _misplaced(path: epath.Path, step: int, run_id: str | None) -> str | None:
    """Why a step directory holds another checkpoint than its name says (per its integrity record); None if it
    holds its own, or if the record is unreadable (damage: the restore path reports that)."""
    try:
        record = ocp.JsonCheckpointHandler().restore(path / "integrity")
        _check_identity(record, step, run_id)
    except _Corrupt as e:
        return str(e)
    except Exception:  # noqa: BLE001
        return None
    return None


def _misplaced_node(tier: checkpoint_local.NodeTier, step: int, run_id: str | None) -> str | None:
    """_misplaced for this process's node-local copy of `step`."""
    try:
        _check_identity(tier.manifest(step)["record"], step, run_id)
    except _Corrupt as e:
        return str(e)
    except Exception:  # noqa: BLE001 - damage: the restore reports it
        return None
    return None


def _check_node_local(path: str) -> None:
    """ConfigError on every process unless each can write `path` and none shares it with another (collective:
    a marker file each, checkpoint_local.check_private). os.access would not do: it says yes to root."""
    if problem := checkpoint_local.check_private(path):
        raise ConfigError("checkpoint.local_dir", problem)


def _check_identity(record: dict, step: int, run_id: str | None) -> None:
    """A step directory must hold its own step of its own run: a moved, swapped or copied one restores the wrong
    state. Records without a run id (older checkpoints) and runs without one (tools reading weights) skip that."""
    if int(record.get("step", step)) != step:
        raise _Corrupt(f"it holds the checkpoint of step {record['step']}, not {step} (a moved or copied step "
                       f"directory)")
    if run_id and record.get("run_id") and record["run_id"] != run_id:
        raise _Corrupt(f"it holds a checkpoint of another run (run id {record['run_id']}, this workdir's is "
                       f"{run_id}): copied from another workdir")


def _read_items(path: epath.Path, abstract_state, partial: bool = False):
    """`partial`: the saved state has items `abstract_state` leaves out, which are not read."""
    if partial:
        handler = ocp.PyTreeCheckpointHandler()
        args = ocp.args.PyTreeRestore(item=abstract_state, partial_restore=True,
                                      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
    else:
        handler, args = ocp.StandardCheckpointHandler(), ocp.args.StandardRestore(abstract_state)
    try:
        state = handler.restore(path / "state", args=args)
    finally:
        handler.close()
    return state, ocp.JsonCheckpointHandler().restore(path / "data")


def _check_matches(arrays: dict, abstract_state, step: int, directory: str) -> None:
    want = {name: (tuple(leaf.shape), str(jnp.dtype(leaf.dtype))) for name, leaf in _flatten(abstract_state)}
    have = {name: (shape, dtype) for name, (shape, dtype, _) in arrays.items()}
    if want == have:
        return
    problems = [f"missing {n}" for n in sorted(want.keys() - have.keys())]
    problems += [f"unexpected {n}" for n in sorted(have.keys() - want.keys())]
    problems += [f"{n}: saved {have[n]}, requested {want[n]}" for n in sorted(want.keys() & have.keys())
                 if want[n] != have[n]]
    raise CheckpointMismatch(f"checkpoint step {step} in {directory} does not match the requested state: "
                          + "; ".join(problems))


# ===== Public API ===================================================================================================


class Checkpointer:
    """Saves asynchronously by policy to a persistent directory and optionally to a faster local one.

    Policies: the persistent directory is due every `every_steps` steps or after `every_minutes` since its last
    save, and keeps the latest `keep` steps plus every `keep_period`-th step forever. The local directory is due
    every `local_every_steps` steps, at persistent steps too (a restart then finds the newest step on the fast
    tier), and keeps `local_keep` steps. A save that nobody asked `should_save` about (end of run, preemption)
    goes to the persistent directory.

    On a multi-host run every method must be called by all processes at the same steps. With `local_mode`
    "shared", `local_directory` must be visible to all of them (Orbax writes each process's shards into one
    shared step directory); with "node", each process keeps its own shards in its own subdirectory of a
    directory no other process sees (checked at construction: ConfigError), and a peer a replica of them unless
    `local_replica` is "none" (checkpoint_local).

    `layer_order`: the order of the stacked layers in the states this saves, and into which it restores
    (`pipeline_parallel.layer_order`; None = the model's). See the module docstring. `resettable`: top-level
    state items (accumulators) a restore may do without: saved in another shape or not at all, they start from
    zeros, and a restore target without them skips them.
    """

    def __init__(self, directory, *, keep: int, keep_period: int = 0, every_steps: int = 0,
                 every_minutes: float = 0, local_directory: str | None = None, local_every_steps: int = 0,
                 local_keep: int = 2, local_mode: str = "shared", local_replica: str = "peer",
                 async_save: bool = True, log=print, clock=time.monotonic,
                 layer_order: tuple[int, ...] | None = None, run_id: str | None = None,
                 resettable: tuple[str, ...] = ()):
        if keep < 1 or (local_directory and local_keep < 1):
            raise ValueError("checkpoint keep counts must be >= 1")
        check_paths(directory, local_directory)
        if local_directory and local_mode == "node":
            _check_node_local(str(local_directory))
        self.every_steps, self.every_minutes, self.local_every_steps = every_steps, every_minutes, local_every_steps
        self.log, self.clock = log, clock
        self.run_id = run_id  # recorded in each save, checked on restore (process 0 needs it; others follow)
        self.resettable = tuple(resettable)
        self.layer_order = None if layer_order is None or list(layer_order) == sorted(layer_order) else \
            tuple(layer_order)
        self.persistent = _Dir(str(directory), keep, keep_period, async_save)
        self.local: _Dir | checkpoint_local.NodeTier | None = None
        if local_directory and local_mode == "node":
            self.local = checkpoint_local.NodeTier(local_directory, local_keep, local_replica)
        elif local_directory:
            self.local = _Dir(str(local_directory), local_keep, 0, async_save)
        self._last_persistent_save = clock()
        self._plan: tuple[int, list[_Dir]] | None = None  # should_save's decision for save()
        # The last restore's {"tier": "local_dir", "peer" (a process's shards came from another's node-local
        # copy) or "dir", "step", "path"}; node-local restores add "sources", each process's tier.
        self.restored_from: dict | None = None
        self._node_sources: tuple[str, ...] = ()

    @property
    def _dirs(self) -> list:
        return [d for d in (self.local, self.persistent) if d is not None]  # local first: faster, preferred

    @property
    def _node(self) -> checkpoint_local.NodeTier | None:
        return self.local if isinstance(self.local, checkpoint_local.NodeTier) else None

    def should_save(self, step: int) -> bool:
        """Whether `step` is due for a save; the same answer on every process.

        Step rules are evaluated locally (every process knows the step). The clock rule is evaluated on
        process 0 and sent to the others (`distributed.from_process_0`), because wall
        clocks and step times differ between hosts.
        """
        persistent = bool(self.every_steps and step % self.every_steps == 0)
        if self.every_minutes:
            timed = self.clock() - self._last_persistent_save >= 60 * self.every_minutes
            persistent |= distributed.from_process_0(timed)
        local = bool(self.local and self.local_every_steps and step % self.local_every_steps == 0)
        targets = ([self.local] if local else []) + ([self.persistent] if persistent else [])  # local: read first
        self._plan = (step, targets)
        return bool(targets)

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Starts an asynchronous save; returns once the arrays are copied off the devices.

        Raises CheckpointError if this save could not start or an earlier background save failed (this step is
        still attempted then); the last committed checkpoint is kept either way.
        """
        planned = self._plan[1] if self._plan and self._plan[0] == step else []
        targets, self._plan = planned or [self.persistent], None
        canonical = _canonical_json(data_state)  # also a snapshot: the caller may mutate data_state meanwhile
        sums = checksums(state)
        arrays = {name: {"shape": list(leaf.shape), "dtype": str(jnp.dtype(leaf.dtype)), "checksum": sums[name]}
                  for name, leaf in _flatten(state)}
        record = {"format": _FORMAT, "step": step, "arrays": arrays,
                  "data_sha256": hashlib.sha256(canonical.encode()).hexdigest()}
        if self.run_id:
            record["run_id"] = self.run_id
        if self.layer_order:
            record["layer_order"] = list(self.layer_order)
        # Orbax would wait for a target's previous save anyway; the other directory is only polled.
        errors = self._collect(self._dirs, block=targets)
        for d in targets:
            error = d.start_save(step, _flatten(state) if d is self._node else state, record, canonical)
            if distributed.any_process(error is not None):
                error = error or f"saving step {step} to {d.path} failed on another process"
                if error not in errors:  # a directory that could not be reopened just above says so once
                    errors.append(error)
                if not d.closed and (problem := d.rebuild(step)):
                    errors.append(problem)
            elif d is self.persistent:
                self._last_persistent_save = self.clock()
        if errors:
            raise CheckpointError("; ".join(errors))

    def wait(self) -> None:
        """Blocks until the saves in flight have committed; raises CheckpointError if one failed."""
        if errors := self._collect(self._dirs, block=self._dirs):
            raise CheckpointError("; ".join(errors))

    def close(self) -> None:
        errors = self._collect(self._dirs, block=self._dirs)
        for d in self._dirs:
            d.close()
        if errors:
            raise CheckpointError("; ".join(errors))

    def _collect(self, dirs: list[_Dir], block: list[_Dir]) -> list[str]:
        """Outcomes of the saves in flight, the same on every process. A directory whose save failed (on any
        process) gets a fresh manager on all of them: Orbax's constructor has barriers."""
        errors = []
        for d in dirs:
            if d.saving is None:
                continue
            if d not in block and distributed.any_process(d.in_progress()):
                continue
            step, error = d.saving, d.wait()
            if distributed.any_process(error is not None):
                errors.append(error or f"saving step {step} to {d.path} failed on another process")
                if problem := d.rebuild(step):
                    errors.append(problem)
        return errors

    def _load(self, d, step: int, abstract_state, node_steps: dict | None = None):
        if d is self._node:
            return self._load_node(step, abstract_state, node_steps[step])
        state, data, order, reset = d.load(step, abstract_state, self.run_id, self.resettable)
        for key in reset:
            self.log(f"checkpoint step {step}: its {key} was saved in another shape or not at all (another "
                     f"mesh or setting); it starts from zeros")
        return state, data, order

    def _load_node(self, step: int, abstract_state, sources: tuple[str, ...]):
        """(state, data_state, layer order) of `step` from the node-local tier: each process's shards from its
        own copy or its buddy's (raising checkpoint_local.Damaged if some process has neither), verified against
        the integrity record like any other copy. The shards' sha256 are read only if that fails: they find the
        damaged copy, which the second read replaces from the buddy's."""
        for check_shards in (False, True):
            arrays, record, data, self._node_sources, notes = self._node.load(
                step, _flatten(abstract_state), sources, check_shards)
            for note in notes:
                self.log(note)
            record = _agreed(lambda: _parse_record(record, abstract_state, step, self._node.root, self.run_id))
            state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_state), arrays)
            try:
                _verify(state, data, record)
                return state, data, record["layer_order"]
            except _Corrupt as e:
                if check_shards:
                    raise
                self.log(f"checkpoint step {step} in {self._node.root} (node-local) does not match its integrity "
                         f"record ({e}); reading it again with each process's shards checked against their sha256")

    def _node_steps(self, abstract_state) -> dict[int, tuple[str, ...]]:
        """{step: each process's source} of the node-local steps every process can read (one collective)."""
        if self._node is None:
            return {}
        agreed, other = self._node.agreed_steps(_flatten(abstract_state))
        if other:
            self.log(f"node-local checkpoint steps {sorted(other)} in {self._node.path} were saved with another "
                     f"mesh, process count or state; they are not used (and not deleted)")
        return agreed

    def _steps(self, d, node_steps: dict) -> list[int]:
        return sorted(node_steps) if d is self._node else d.all_steps()

    def _set_aside(self, d, step: int, why) -> None:
        if d is self._node:  # each process its own copy
            d.move_aside(step)
            self.log(f"checkpoint step {step} in {d.root} (node-local) is unusable: {why}; each process's copy "
                     f"moved aside to {step}.corrupt-<unix time> in its directory, trying an older one")
        else:
            moved = d.move_aside(step)
            self.log(f"checkpoint step {step} in {d.path} is unusable: {why}; moved aside to {moved}, "
                     "trying an older one")

    def _in_own_order(self, state, data, saved_order):
        """(state, data) with the stacked layers moved from the checkpoint's order into this run's, leaf by leaf
        (each donated: at most one extra leaf on the devices)."""
        if saved_order == self.layer_order:
            return state, data

        def move(path, x):
            if not pipeline_parallel.stacked_path(path):
                return x
            reorder = jax.jit(lambda x: pipeline_parallel.reorder_layers({"blocks": x}, saved_order,
                                                                         self.layer_order)["blocks"],
                              out_shardings=x.sharding, donate_argnums=0)
            return reorder(x)

        try:
            return jax.tree_util.tree_map_with_path(move, state), data
        except ValueError as e:  # a recorded order for another number of layers: the record is damaged
            raise _Corrupt(str(e)) from None

    def set_aside_misplaced(self) -> None:
        """Moves aside every step directory whose integrity record names another step, before anything reads the
        step list: a copy at a later step would otherwise pass for the newest checkpoint (or a finished run), and
        retention would delete true steps in favour of it. Reads one small JSON per step."""
        if self._node:  # each process its own copies, without the others
            for step in self._node.all_steps():
                why = _misplaced_node(self._node, step, self.run_id)
                if why:
                    moved = self._node.move_aside(step)
                    self.log(f"checkpoint step {step} in {self._node.path} is not this run's: {why}; moved aside "
                             f"to {moved}")
        for d in self._dirs:
            if d is self._node:
                continue
            d.manager.reload()
            for step in sorted(d.manager.all_steps()):
                why = _misplaced(d.step_path(step), step, self.run_id) if jax.process_index() == 0 else None
                if distributed.from_process_0(why is not None):
                    moved = d.move_aside(step)
                    self.log(f"checkpoint step {step} in {d.path} is not this run's: {why or 'see process 0'}; "
                             f"moved aside to {moved}")

    def latest_step(self, reread: bool = False) -> int | None:
        """Newest committed step in either directory (not verified). `reread`: from the directories, not from
        what this process saved (after an interrupt a save may have committed without the caller knowing).
        A node-local tier counts the newest step of any process (a collective), or with `reread` this process's
        own (none: an interrupt need not reach every process)."""
        if reread:
            for d in self._dirs:
                d.reload()
        steps = [s for d in self._dirs if d is not self._node and (s := d.latest_step()) is not None]
        if self._node:
            newest = self._node.latest_step()
            if not reread and jax.process_count() > 1:  # another process's newest may reach this one from a peer
                newest = int(distributed.allgather([-1 if newest is None else newest]).max())
            steps += [newest] if newest is not None and newest >= 0 else []
        return max(steps, default=None)

    def restore(self, step: int, abstract_state) -> tuple[dict, dict]:
        """(state, data_state) of `step` from the first copy that loads and verifies (local first).

        `abstract_state` holds jax.ShapeDtypeStruct leaves with the target shardings. Bad copies are left in
        place (but a node-local copy whose shards fail their sha256: moved aside); raises CheckpointError naming
        each copy's problem."""
        problems = []
        node_steps = self._node_steps(abstract_state)
        for d in self._dirs:
            if step in self._steps(d, node_steps):
                try:
                    restored = self._in_own_order(*self._load(d, step, abstract_state, node_steps))
                    self._restored(d, step)
                    return restored
                except (_Corrupt, checkpoint_local.Damaged) as e:
                    problems.append(f"{d.path}: {e}")
                _drop_failed_reads()
        raise CheckpointError(f"cannot restore checkpoint step {step}: " + ("; ".join(problems) or "not found"))

    def _restored(self, d, step: int) -> None:
        if d is self._node:
            tier = "peer" if "peer" in self._node_sources else "local_dir"
            self.restored_from = {"tier": tier, "step": step, "path": d.root, "sources": list(self._node_sources)}
            return
        self.restored_from = {"tier": "local_dir" if d is self.local else "dir", "step": step, "path": d.path}

    def restore_latest(self, abstract_state) -> tuple[int, dict, dict] | None:
        """(step, state, data_state) of the newest step that loads and verifies, in either directory.

        Each bad copy is logged with its step, directory and reason, moved aside and skipped. Returns None when
        there is no checkpoint at all; raises CheckpointError when there were some but none was usable."""
        for d in self._dirs:
            d.reload()
        node_steps = self._node_steps(abstract_state)  # the one collective that agrees on the node-local steps
        candidates = sorted(((s, -i, d) for i, d in enumerate(self._dirs) for s in self._steps(d, node_steps)),
                            key=lambda c: c[:2], reverse=True)
        for step, _, d in candidates:
            try:
                restored = self._in_own_order(*self._load(d, step, abstract_state, node_steps))
                self._restored(d, step)
                return step, *restored
            except checkpoint_local.Damaged as e:  # its damaged copies are set aside already; good ones stay
                self.log(f"checkpoint step {step} in {d.root} (node-local) is unusable: {e}; trying an older one")
            except _Corrupt as e:
                self._set_aside(d, step, e)
            _drop_failed_reads()
        if candidates:
            raise CheckpointError(f"none of the {len(candidates)} checkpoints could be restored (see the log); "
                                  "they were moved aside, not deleted")
        return None


def _drop_failed_reads() -> None:
    """Collects the coroutines a failed load left suspended now, without their "Exception ignored in" reports."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def abstract_with_shardings(abstract_tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)
