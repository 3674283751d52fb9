"""jaxtrain.compat: what each workaround changes, that entry points alone install them, and that importing the
library changes no process-wide state. glibc_malloc: when the settings apply, and that they stop the per-step
page faults."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from jaxtrain.compat import glibc_malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What a library must leave as it found it, read in a fresh process. `jax_cpu_enable_async_dispatch` and absl's
# parsed flags are what glibc_malloc and tokamax change when installed.
STATE = textwrap.dedent("""
    import asyncio, logging, sys, warnings
    import jax
    from absl import flags

    def state():
        loggers = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters))
                   for name in ("", "absl", "asyncio")}
        return {"unraisablehook": sys.unraisablehook, "warnings.filters": list(warnings.filters),
                "loggers": loggers, "meta_path": list(sys.meta_path), "path_hooks": list(sys.path_hooks),
                "jaxtrain_finders": [type(f).__name__ for f in sys.meta_path if "jaxtrain" in type(f).__module__],
                "torch": sys.modules.get("torch", "absent"), "flags_parsed": flags.FLAGS.is_parsed(),
                "async_dispatch": jax.config.read("jax_cpu_enable_async_dispatch")}
""")

LIBRARY = STATE + textwrap.dedent("""
    import importlib, json, pkgutil, tempfile
    before = state()
    import jaxtrain
    # The entry points, and lm-eval's adapter (jaxtrain.evals): importing lm-eval (requests, ...) adds warning
    # filters of its own; the adapter itself installs nothing.
    skip = ("jaxtrain.tools", "jaxtrain.compat", "jaxtrain.main", "jaxtrain.__main__", "jaxtrain.evals")
    names = [m.name for m in pkgutil.walk_packages(jaxtrain.__path__, "jaxtrain.") if not m.name.startswith(skip)]
    for name in names:
        importlib.import_module(name)
    # An ordinary call too: a checkpoint saved, damaged and restored (what once installed log filters and hooks).
    import numpy as np
    from jaxtrain import checkpoint
    with tempfile.TemporaryDirectory() as d:
        ckpt = checkpoint.Checkpointer(d, keep=2, async_save=False)
        ckpt.save(1, {"w": jax.numpy.ones(4)}, {"position": 0})
        ckpt.close()
        ckpt = checkpoint.Checkpointer(d, keep=2, async_save=False)
        target = {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))}
        restored = ckpt.restore_latest(target)
        ckpt.close()
    after = state()
    changed = sorted(k for k in before if before[k] != after[k])
    print(json.dumps({"modules": len(names), "restored": restored[0], "changed": changed,
                      "diff": {k: [repr(before[k]), repr(after[k])] for k in changed}}))
""")


def run_python(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_and_using_the_library_changes_no_process_wide_state():
    """`import jaxtrain`, every library module, and a checkpoint save and restore leave the process's hooks,
    warning filters, loggers, import machinery, sys.modules['torch'], absl's flags and jax's dispatch as they
    were: only entry points install what jaxtrain.compat holds."""
    result = run_python(LIBRARY)
    assert result["modules"] > 60 and result["restored"] == 1
    assert result["changed"] == [], result["diff"]


def test_install_is_what_entry_points_add():
    """compat.install() changes exactly the state its modules document (the check above can fail), once."""
    result = run_python(STATE + textwrap.dedent("""
        import json
        before = state()
        from jaxtrain import checkpoint, compat
        compat.install()
        middle = state()
        compat.install()
        after = state()
        print(json.dumps({"changed": sorted(k for k in before if before[k] != middle[k]),
                          "again": sorted(k for k in middle if middle[k] != after[k]),
                          "hook": type(sys.unraisablehook).__name__, "s3_problem": checkpoint.s3_problem,
                          "filters": {n: [type(f).__name__ for f in logging.getLogger(n).filters]
                                      for n in ("absl", "asyncio")},
                          "tensorboardX": "tensorboardX" in sys.modules}))
    """))
    want = {"unraisablehook", "warnings.filters", "loggers", "async_dispatch"}
    want |= {"flags_parsed"} if importlib.util.find_spec("tokamax") else set()
    # The modules it imports (orbax, tensorboardX) add finders of their own to sys.meta_path; jaxtrain adds none.
    assert set(result["changed"]) - {"meta_path"} == want and result["again"] == []
    assert result["hook"] == "_LateCompletions" and result["s3_problem"] is None and result["tensorboardX"]
    assert result["filters"] == {"absl": ["_MetadataComplaints", "_FailedSaveReports"], "asyncio": ["_AbandonedReads"]}


def test_old_module_paths_are_found_only_where_an_old_command_runs():
    from jaxtrain.compat import old_paths

    assert old_paths.old_command(["python", "-m", "jaxtrain.plan", "--help"]) == "jaxtrain.plan"
    assert old_paths.old_command(["python", "-u", "-m", "jaxtrain.hf"]) == "jaxtrain.hf"
    assert old_paths.old_command(["python", "-um", "jaxtrain.sweep"]) == "jaxtrain.sweep"
    assert old_paths.old_command(["python", "-m", "jaxtrain", "plan"]) is None  # the new command
    assert old_paths.old_command(["python", "-m", "pytest", "-m", "jaxtrain.plan"]) is None  # pytest's -m
    assert old_paths.old_command(["python", "script.py", "-m", "jaxtrain.plan"]) is None
    assert old_paths.old_command(["python", "-c", "import jaxtrain"]) is None


@pytest.mark.parametrize("environ, installed, expected", [
    ({"JAX_PLATFORMS": "cpu"}, ["jax_cuda12_plugin"], True),  # the variable wins over what is installed
    ({"JAX_PLATFORMS": "cuda"}, [], False),
    ({"JAX_PLATFORMS": "cuda,cpu"}, [], False),  # the first platform listed is the default one
    ({"JAX_PLATFORMS": "cpu,cuda"}, [], True),
    ({"JAX_PLATFORM_NAME": "tpu"}, [], False),
    ({}, ["numpy", "jax", "jaxlib"], True),
    ({}, ["numpy", "jax_cuda12_plugin"], False),
    ({}, ["jax_cuda13_pjrt"], False),
    ({}, ["libtpu"], False),
    ({"JAX_PLATFORMS": " "}, ["jax_rocm7_plugin"], False),
])
def test_cpu_run(environ, installed, expected):
    assert glibc_malloc.cpu_run(environ, installed) is expected


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.fixture
def fake_libc(monkeypatch):
    """glibc and a jax that has not started, with mallopt and jax.config.update recorded instead of applied (this
    test process's jax has started and must keep its settings)."""
    import jax
    from jax._src import xla_bridge

    libc = FakeLibc()
    libc.config_updates = []
    monkeypatch.setattr(glibc_malloc.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(glibc_malloc.platform, "system", lambda: "Linux")
    monkeypatch.setattr(glibc_malloc.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda name, value: libc.config_updates.append((name, value)))
    monkeypatch.setattr(glibc_malloc, "status", glibc_malloc.status)  # restored after the test
    return libc


SYNC = [("jax_cpu_enable_async_dispatch", False)]


def apply(environ):
    """glibc_malloc.install in a process where it has not run yet (it runs once per process)."""
    glibc_malloc.status = glibc_malloc.NOT_APPLIED
    return glibc_malloc.install(environ)


def test_installs_once_per_process(fake_libc):
    first = apply({"JAX_PLATFORMS": "cpu"})
    assert glibc_malloc.install({"JAX_PLATFORMS": "cpu"}) == first == glibc_malloc.status
    assert fake_libc.calls == list(glibc_malloc.SETTINGS) and fake_libc.config_updates == SYNC  # applied once


def test_applies_on_cpu_runs_and_when_forced(fake_libc):
    assert apply({"JAX_PLATFORMS": "cpu"}).startswith("kept (glibc main arena")
    assert fake_libc.calls == list(glibc_malloc.SETTINGS) and fake_libc.config_updates == SYNC
    fake_libc.calls.clear()
    forced = {"JAX_PLATFORMS": "cuda", glibc_malloc.ENV: "1"}
    assert apply(forced).startswith("kept")
    assert glibc_malloc.status.startswith("kept") and fake_libc.calls == list(glibc_malloc.SETTINGS)


@pytest.mark.parametrize("environ, status", [
    ({"JAX_PLATFORMS": "cpu", glibc_malloc.ENV: "0"}, "defaults (JAXTRAIN_KEEP_FREED_MEMORY=0)"),
    ({"JAX_PLATFORMS": "cuda"}, "defaults (accelerator run)"),
])
def test_leaves_defaults(fake_libc, environ, status):
    assert apply(environ) == status
    assert fake_libc.calls == [] and fake_libc.config_updates == []


def test_too_late_once_jax_has_started(fake_libc, monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert "jax had already started" in apply({"JAX_PLATFORMS": "cpu"})
    assert fake_libc.calls == [] and fake_libc.config_updates == []


def test_bad_setting_warns_and_leaves_defaults(fake_libc):
    with pytest.warns(UserWarning, match="JAXTRAIN_KEEP_FREED_MEMORY: must be 0 or 1, got 'yes'"):
        status = apply({glibc_malloc.ENV: "yes"})
    assert status.startswith("defaults") and fake_libc.calls == [] and fake_libc.config_updates == []


def test_not_glibc_or_refused(fake_libc, monkeypatch):
    fake_libc.result = 0
    assert apply({"JAX_PLATFORMS": "cpu"}).endswith("glibc malloc defaults (mallopt refused)")
    monkeypatch.setattr(glibc_malloc.platform, "libc_ver", lambda: ("", ""))
    fake_libc.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = apply({"JAX_PLATFORMS": "cpu"})
    assert status.endswith("system malloc defaults (not glibc)") and fake_libc.calls == []


# A fresh process (the settings must come before jax starts): glibc_malloc.install, then a jitted step shaped like the
# train step (donated 16 MiB state, a matmul's operands and result as temporaries), counting minor page faults per
# call once warm, in the quietest of four windows (a loaded machine adds faults of its own to any one window).
PROBE = textwrap.dedent("""
    import json, resource
    from jaxtrain.compat import glibc_malloc
    glibc_malloc.install()
    import jax, jax.numpy as jnp
    step = jax.jit(lambda x: (jnp.sin(x).reshape(2048, 2048) @ jnp.cos(x).reshape(2048, 2048)).reshape(-1) * 0.5,
                   donate_argnums=0)
    x = jnp.ones((4 << 20,), jnp.float32)
    for _ in range(4):
        x = step(x).block_until_ready()
    windows = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            x = step(x).block_until_ready()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    print(json.dumps({"status": glibc_malloc.status, "faults_per_call": min(windows)}))
""")


def probe(keep: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **{glibc_malloc.ENV: keep})
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="glibc Linux only")
def test_freed_buffers_stay_mapped():
    kept, default = probe("1"), probe("0")
    assert kept["status"].startswith("kept") and default["status"] == "defaults (JAXTRAIN_KEEP_FREED_MEMORY=0)"
    # 16 MiB of fresh pages is 4,096 faults; with glibc's defaults the temporaries fault in on every call.
    assert default["faults_per_call"] > 4096, default
    assert kept["faults_per_call"] < default["faults_per_call"] / 10, (kept, default)
