"""The persistent compilation cache (train.compile_cache): a restart loads its compiled step instead of compiling it.

"auto" (the default) is $JAX_COMPILATION_CACHE_DIR if set, else `.jax_cache` beside the workdir
(<workdir>/../.jax_cache): jax writes entries from process 0 only and every process reads them, so the cache
must be where all processes see it, as they see the workdir; runs under one parent share it. "off" (or "")
turns it off; any other value is the directory. Every program is cached, not only those that took 1 s to
compile (unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise). No size limit is set: with one,
jax rereads every entry's access time at each write. jax's cache is process-wide and opened at the first
compile, so `install` belongs to entry points (`jaxtrain train`), before anything compiles; the library never
calls it. It also counts the cache's hits, for the run's "phases" record (`counts`, `source`). Beside jax's
entries, each CPU process (or a lone GPU or TPU process) keeps its own of the programs it compiled (`compile`):
on CPU jax's key names the process, and under `jaxtrain supervise` they are also found by keys computed without
tracing, so that a restart skips the trace as well as the compile.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import shutil

from jaxtrain.errors import ConfigError

FIELD = "train.compile_cache"
OFF = ("", "off")
ENV = "JAX_COMPILATION_CACHE_DIR"
MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"  # jax's own default: 1 s
SUPERVISED_ENV = "JAXTRAIN_ATTEMPT"  # set by `jaxtrain supervise` for each attempt
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses",
           "/jax/core/compile/backend_compile_duration": "compiles"}  # a compile or a load from jax's cache
_counts: dict[str, int] | None = None  # hits, misses, compiles since `install` registered its listeners
_listening = False
_untraced = False  # `install` turns untraced entries on for a supervised attempt
_code: str | None = None  # `_untraced_context`, once per process
_log = logging.getLogger(__name__)  # JAX_DEBUG_LOG_MODULES=jaxtrain.compile_cache shows its hits, as jax's own


def _count(event: str, *args, **kwargs) -> None:
    if _counts is not None and event in _EVENTS:
        _counts[_EVENTS[event]] = _counts.get(_EVENTS[event], 0) + 1


def listen() -> None:
    """Registers the listeners behind `counts`, once (`install` does)."""
    global _listening
    import jax

    if not _listening:
        jax.monitoring.register_event_listener(_count)
        jax.monitoring.register_event_duration_secs_listener(_count)
        _listening = True


def unlisten() -> None:
    global _listening
    import jax

    if _listening:
        jax.monitoring.unregister_event_listener(_count)
        jax.monitoring.unregister_event_duration_listener(_count)
        _listening = False


def counts() -> dict[str, int] | None:
    """{"hits", "misses"} of jax's persistent cache in this process so far (and "untraced", the hits that
    skipped the trace too); None unless `install` ran."""
    return None if _counts is None else dict(_counts)


def source(before: dict | None, after: dict | None) -> str | None:
    """How a compile between two `counts()` got its executable: "cache", "untraced" (an untraced entry: no trace
    either, see `compile`), "compiled", or None (unknown)."""
    import jax

    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return "compiled"
    if before is None or after is None:
        return None
    if after["hits"] > before["hits"] and after["misses"] == before["misses"]:
        return "untraced" if after.get("untraced", 0) > before.get("untraced", 0) else "cache"
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
    "auto" the run warns and goes on without a cache. Also counts the cache's hits and misses (`counts`).

    Under `jaxtrain supervise` (SUPERVISED_ENV set) it also turns on untraced entries (`compile`): a restart
    loads the step it ran before without tracing it, keyed by the config, the arguments and the code on disk
    (`_untraced_context`). Only there: in a notebook or a test, code redefined in memory would not change the key."""
    global _counts, _untraced
    import jax

    if _counts is None:
        _counts = {"hits": 0, "misses": 0}
    listen()

    path = directory(config.train.compile_cache, config.workdir, environ)
    if path is not None and "://" not in path and (why := _unwritable(path)):
        if config.train.compile_cache.strip() != "auto":
            raise ConfigError(FIELD, f"{path}: {why}")
        warn(f"warning: {FIELD}=auto: {why}; compiling without a persistent cache")
        path = None
    _untraced = path is not None and SUPERVISED_ENV in environ
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if MIN_TIME_ENV not in environ:  # every program: a restore's checksum program compiles in about 1 s, too
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    return path


def _mesh_devices(args) -> list | None:
    """The devices of the one mesh `args` are laid out on (their NamedShardings), in the mesh's order, which is the
    executable's; None for any other layout, which only jax's cache serves."""
    import jax

    meshes = {getattr(a, "sharding", None).mesh for a in jax.tree.leaves(args)
              if isinstance(getattr(a, "sharding", None), jax.sharding.NamedSharding)}
    return list(meshes.pop().devices.flat) if len(meshes) == 1 else None


def _entry_dir() -> str | None:
    import jax

    cache_dir = jax.config.jax_compilation_cache_dir
    if not jax.config.jax_enable_compilation_cache or not cache_dir or "://" in cache_dir:
        return None
    return cache_dir


def _hash(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def _program_entry(cache_dir: str, lowered, devices) -> str:
    """Where this process keeps its own entry for `lowered`, keyed by the program, the mesh's device order, the
    process, jax's versions, XLA_FLAGS and LIBTPU_INIT_ARGS. On CPU jax's key names the process and jax writes
    from process 0 only, so another process would compile at every restart; and an untraced entry
    (`_untraced_entry`) can be linked to one of these, never made from an executable jax loaded (`compile`)."""
    import jax
    import jaxlib

    key = _hash(lowered.as_text(), str([d.id for d in devices]), jax.__version__, jaxlib.__version__,
                os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                f"{jax.process_index()}/{jax.process_count()}")
    return os.path.join(cache_dir, f"jaxtrain-programs-process-{jax.process_index()}", key)


def _untraced_context(environ) -> str:
    """What decides a traced program besides the caller's key and the arguments, hashed once per process: the
    content of jaxtrain's files and of every loaded module from outside the Python installation (the user's), the
    installed distributions and their versions, jax's config, XLA_FLAGS and LIBTPU_INIT_ARGS, the devices."""
    global _code
    if _code is None:
        import sys

        import jax

        installed = (sys.prefix, sys.base_prefix, sys.exec_prefix)
        installed = tuple({os.path.join(f(p), "") for p in installed for f in (os.path.abspath, os.path.realpath)})
        package = os.path.dirname(os.path.realpath(__file__))
        paths = {os.path.join(root, f) for root, _, names in os.walk(package) for f in names if f.endswith(".py")}
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None) or ""
            if path.endswith(".py") and not path.startswith(installed):
                if not (path := os.path.realpath(path)).startswith(installed):
                    paths.add(path)
        sites = [d for d in sys.path if d.startswith(installed) and os.path.isdir(d)]
        h = hashlib.sha256()
        for path in sorted(paths):
            with contextlib.suppress(OSError):
                with open(path, "rb") as f:
                    h.update(path.encode() + b"\0" + hashlib.sha256(f.read()).digest())
        dists = sorted(name for d in sites for name in os.listdir(d) if name.endswith((".dist-info", ".egg-info")))
        devices = [(d.id, d.process_index, d.platform, d.device_kind) for d in jax.devices()]
        _code = _hash(h.hexdigest(), str(dists), repr(sorted(jax.config.values.items())),
                      environ.get("XLA_FLAGS", ""), environ.get("LIBTPU_INIT_ARGS", ""), str(devices),
                      f"{jax.process_index()}/{jax.process_count()}")
    return _code


def _untraced_entry(cache_dir: str, jitted, args, devices, key: tuple[str, ...]) -> str | None:
    """Where this process keeps `jitted`'s executable for `args` under a key computed without tracing it (see
    `install`), or None where that is off."""
    import jax

    if not _untraced:
        return None
    leaves, tree = jax.tree.flatten(args)
    signature = [str(tree), str([d.id for d in devices])]
    signature += [f"{x.shape} {x.dtype} {getattr(x, 'weak_type', False)} {getattr(x, 'sharding', None)!r}"
                  for x in leaves]
    name = getattr(jitted, "__name__", "program")
    digest = _hash(_untraced_context(os.environ), name, *key, *signature)
    return os.path.join(cache_dir, f"jaxtrain-untraced-process-{jax.process_index()}", f"{name}-{digest}")


def _load(path: str, devices, jitted, how: str):
    """The executable kept at `path`, counted as a hit of the cache (of an untraced entry if `how` says so), or
    None if there is none or it fails to load (damaged, or stale)."""
    import jax
    from jax.experimental import serialize_executable

    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
    except Exception:  # noqa: BLE001 - a damaged or stale entry: compile as if it were absent
        return None
    _count("/jax/compilation_cache/cache_hits")
    if how == "untraced" and _counts is not None:
        _counts["untraced"] = _counts.get("untraced", 0) + 1
    _log.debug("%s cache hit for 'jit_%s' (process %d)", how, getattr(jitted, "__name__", "?"), jax.process_index())
    return compiled


def _write(path: str, write) -> None:
    """`write(temporary path)`, then the result renamed to `path`; nothing if that fails (not serializable: host
    callbacks; or no room): the next start compiles."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _store(path: str, compiled) -> None:
    from jax.experimental import serialize_executable

    def write(tmp):
        payload = pickle.dumps(serialize_executable.serialize(compiled))
        with open(tmp, "wb") as f:
            f.write(payload)

    _write(path, write)


def _link(source: str, path: str) -> None:
    def write(tmp):
        try:
            os.link(source, tmp)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(source, tmp)

    _write(path, write)


def compile(jitted, *args, key: tuple[str, ...] | None = None):
    """`jitted.lower(*args).compile()` through the persistent cache, counted as jax counts its hits.

    With `key` (what decides the traced program besides the code and the arguments) and untraced entries on
    (`install`), an executable kept under a key computed without tracing is loaded: no trace, lowering or
    compile. Otherwise this process's own entry for the lowered program (`_program_entry`), else jax's cache
    (alone for several GPU or TPU processes).
    Entries are made only from an executable compiled here: XLA:CPU re-serializes one that jax loaded from its
    cache (or from process 0, jax_share_binary_between_hosts) without some of its functions, and it then fails
    when run. An untraced entry is linked to the program's entry where that exists. An entry that fails to load
    is passed over, and replaced once the program is compiled."""
    import jax

    devices, cache_dir = _mesh_devices(args), _entry_dir()
    # Several GPU or TPU processes share jax's entries (its key does not name the process there); entries of
    # their own would put a copy of each executable on disk per process.
    if devices is None or cache_dir is None or (devices[0].platform != "cpu" and jax.process_count() > 1):
        return jitted.lower(*args).compile()
    untraced = _untraced_entry(cache_dir, jitted, args, devices, key) if key is not None else None
    if untraced and (compiled := _load(untraced, devices, jitted, "untraced")) is not None:
        return compiled
    lowered = jitted.lower(*args)
    program = _program_entry(cache_dir, lowered, devices)
    if (compiled := _load(program, devices, jitted, "own-entry")) is not None:
        if untraced:
            _link(program, untraced)
        return compiled
    before = counts()
    compiled = lowered.compile()
    after = counts()
    if (before is not None and after.get("compiles", 0) > before.get("compiles", 0)
            and after["hits"] == before["hits"] and not jax.config.jax_share_binary_between_hosts):
        _store(program, compiled)
        if untraced:
            _link(program, untraced)
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
    runs before its first step (the restore's checksums), which would otherwise be traced, and compiled afresh
    in a CPU process other than 0."""
    return per_signature(lambda *args: compile(jitted, *args, key=()))
