"""The persistent compilation cache (train.compile_cache): a restart loads its compiled step instead of compiling it.

"auto" (the default) is $JAX_COMPILATION_CACHE_DIR if set, else `.jax_cache` beside the workdir
(<workdir>/../.jax_cache): jax writes entries from process 0 only and every process reads them, so the cache
must be where all processes see it, as they see the workdir; runs under one parent share it. "off" (or "")
turns it off; any other value is the directory. Every program is cached, not only those that took 1 s to
compile (unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise). No size limit is set: with one,
jax rereads every entry's access time at each write. jax's cache is process-wide and opened at the first
compile, so `install` belongs to entry points (`jaxtrain train`), before anything compiles; the library never
calls it. It also counts the cache's hits, for the run's "phases" record (`counts`, `source`). On CPU, a
process other than 0 keeps entries of its own beside jax's (`compile`): there jax's key names the process.
"""

from __future__ import annotations

import hashlib
import logging
import os

from jaxtrain.errors import ConfigError

FIELD = "train.compile_cache"
OFF = ("", "off")
ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # jax's own default: 1 s
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_counts: dict[str, int] | None = None  # hits and misses since `install` registered its listener
_log = logging.getLogger(__name__)  # JAX_DEBUG_LOG_MODULES=jaxtrain.compile_cache shows its hits, as jax's own


def _count(event: str, *args, **kwargs) -> None:
    if _counts is not None and event in _EVENTS:
        _counts[_EVENTS[event]] += 1


def counts() -> dict[str, int] | None:
    """{"hits", "misses"} of jax's persistent cache in this process so far; None unless `install` ran."""
    return None if _counts is None else dict(_counts)


def source(before: dict | None, after: dict | None) -> str | None:
    """How a compile between two `counts()` got its executable: "cache", "compiled", or None (unknown)."""
    import jax

    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return "compiled"
    if before is None or after is None:
        return None
    if after["hits"] > before["hits"] and after["misses"] == before["misses"]:
        return "cache"
    return "compiled" if after["misses"] > before["misses"] else None


def check(value) -> None:
    if not isinstance(value, str):
        raise ConfigError(FIELD, f"must be a directory, 'auto' or 'off', got {value!r}")


def directory(value: str, workdir: str, environ=os.environ) -> str | None:
    """The cache directory `value` names for a run in `workdir` (None: off). Pure."""
    check(value)
    value = value.strip()
    if value.lower() in OFF:
        return None
    if value == "auto":
        if environ.get(ENV):
            return environ[ENV]
        return os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(workdir))), ".jax_cache")
    return value if "://" in value else os.path.abspath(os.path.expanduser(value))


def _unwritable(path: str) -> str | None:
    """Why `path` can't hold the cache (its nearest existing ancestor must be a writable directory), or None."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def install(config, environ=os.environ, warn=print) -> str | None:
    """Points jax's persistent cache at the run's directory (or turns it off) and returns the directory. Creates
    nothing: jax does at its first compile. A named directory that can't be written is a ConfigError; under
    "auto" the run warns and goes on without a cache. Also counts the cache's hits and misses (`counts`)."""
    global _counts
    import jax

    if _counts is None:  # a process-wide listener, registered once
        _counts = {"hits": 0, "misses": 0}
        jax.monitoring.register_event_listener(_count)

    path = directory(config.train.compile_cache, config.workdir, environ)
    if path is not None and "://" not in path and (why := _unwritable(path)):
        if config.train.compile_cache.strip() != "auto":
            raise ConfigError(FIELD, f"{path}: {why}")
        warn(f"warning: {FIELD}=auto: {why}; compiling without a persistent cache")
        path = None
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if MIN_TIME_ENV not in environ:  # every program: a restore's checksum program compiles in about 1 s, too
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


def _own_entry(lowered, args) -> tuple[str, list] | None:
    """(where this process keeps its own entry for `lowered`, the devices it runs on), or None where jax's cache
    serves it. On CPU jax's key hashes compile options and a topology that name the process, and jax writes
    entries from process 0 only, so a process other than 0 would compile at every restart. Only a program over
    one mesh (its arguments' NamedShardings) is kept: the mesh's device order is the executable's. The key
    hashes the program, that order, the process, jax's versions and XLA_FLAGS."""
    import jax
    import jaxlib

    cache_dir = jax.config.jax_compilation_cache_dir
    if (not jax.config.jax_enable_compilation_cache or not cache_dir or "://" in cache_dir
            or jax.process_index() == 0 or jax.devices()[0].platform != "cpu"):
        return None
    meshes = {getattr(a, "sharding", None).mesh for a in jax.tree.leaves(args)
              if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)}
    if len(meshes) != 1:
        return None
    devices = list(meshes.pop().devices.flat)
    key = hashlib.sha256()
    for part in (lowered.as_text(), str([d.id for d in devices]), jax.__version__, jaxlib.__version__,
                 os.environ.get("XLA_FLAGS", ""), f"{jax.process_index()}/{jax.process_count()}"):
        key.update(part.encode() + b"\0")
    return os.path.join(cache_dir, f"jaxtrain-cpu-process-{jax.process_index()}", key.hexdigest()), devices


def compile(jitted, *args):
    """`jitted.lower(*args).compile()` through the persistent cache: jax's, or on CPU in a process other than 0
    an entry of its own (`_own_entry`), counted as a hit like jax's. An entry that fails to load is compiled
    again and replaced."""
    import jax
    from jax.experimental import serialize_executable

    lowered = jitted.lower(*args)
    own = _own_entry(lowered, args)
    if own is None:
        return lowered.compile()
    path, devices = own
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                compiled = serialize_executable.deserialize_and_load(
                    f.read(), jax.tree.structure(lowered.args_info), lowered.out_tree, execution_devices=devices)
            _count("/jax/compilation_cache/cache_hits")
            _log.debug("own-entry cache hit for 'jit_%s' (process %d)", getattr(jitted, "__name__", "?"),
                       jax.process_index())
            return compiled
        except Exception:  # noqa: BLE001 - a damaged or stale entry: compile as if it were absent
            pass
    compiled = lowered.compile()  # jax counts its miss
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + f".tmp{os.getpid()}", "wb") as f:
            f.write(payload)
        os.replace(path + f".tmp{os.getpid()}", path)
    except Exception:  # noqa: BLE001 - not serializable (host callbacks), or no room: the next start compiles
        pass
    return compiled


def per_signature(compile_fn):
    """A function that runs `compile_fn(*args)`'s executable, compiled once for each argument signature (tree,
    shapes, dtypes, shardings)."""
    import jax

    executables = {}

    def call(*args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        if key not in executables:
            executables[key] = compile_fn(*args)
        return executables[key](*args)

    return call


def cached(jitted):
    """`jitted`, its executable for each new argument signature from `compile`: for a program that a restart
    runs before its first step (the restore's checksums), which would otherwise compile afresh in a CPU process
    other than 0."""
    return per_signature(lambda *args: compile(jitted, *args))
