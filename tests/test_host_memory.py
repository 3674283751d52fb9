"""jaxtrain.host_memory: when the glibc malloc settings apply, and that they stop the per-step page faults."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from jaxtrain import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert host_memory.cpu_run(environ, installed) is expected


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
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(host_memory.platform, "system", lambda: "Linux")
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda name, value: libc.config_updates.append((name, value)))
    monkeypatch.setattr(host_memory, "status", host_memory.status)  # restored after the test
    return libc


SYNC = [("jax_cpu_enable_async_dispatch", False)]


def test_applies_on_cpu_runs_and_when_forced(fake_libc):
    assert host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"}).startswith("kept (glibc main arena")
    assert fake_libc.calls == list(host_memory.SETTINGS) and fake_libc.config_updates == SYNC
    fake_libc.calls.clear()
    forced = {"JAX_PLATFORMS": "cuda", host_memory.ENV: "1"}
    assert host_memory.keep_freed_memory(forced).startswith("kept")
    assert host_memory.status.startswith("kept") and fake_libc.calls == list(host_memory.SETTINGS)


@pytest.mark.parametrize("environ, status", [
    ({"JAX_PLATFORMS": "cpu", host_memory.ENV: "0"}, "defaults (JAXTRAIN_KEEP_FREED_MEMORY=0)"),
    ({"JAX_PLATFORMS": "cuda"}, "defaults (accelerator run)"),
])
def test_leaves_defaults(fake_libc, environ, status):
    assert host_memory.keep_freed_memory(environ) == status
    assert fake_libc.calls == [] and fake_libc.config_updates == []


def test_too_late_once_jax_has_started(fake_libc, monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert "jax had already started" in host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"})
    assert fake_libc.calls == [] and fake_libc.config_updates == []


def test_bad_setting_warns_and_leaves_defaults(fake_libc):
    with pytest.warns(UserWarning, match="JAXTRAIN_KEEP_FREED_MEMORY: must be 0 or 1, got 'yes'"):
        status = host_memory.keep_freed_memory({host_memory.ENV: "yes"})
    assert status.startswith("defaults") and fake_libc.calls == [] and fake_libc.config_updates == []


def test_not_glibc_or_refused(fake_libc, monkeypatch):
    fake_libc.result = 0
    assert host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"}).endswith("glibc malloc defaults (mallopt refused)")
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    fake_libc.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        status = host_memory.keep_freed_memory({"JAX_PLATFORMS": "cpu"})
    assert status.endswith("system malloc defaults (not glibc)") and fake_libc.calls == []


# A fresh process (the settings must come before jax starts): keep_freed_memory, then a jitted step shaped like the
# train step (donated 16 MiB state, a matmul's operands and result as temporaries), counting minor page faults per
# call once warm.
PROBE = textwrap.dedent("""
    import json, resource
    from jaxtrain import host_memory
    host_memory.keep_freed_memory()
    import jax, jax.numpy as jnp
    step = jax.jit(lambda x: (jnp.sin(x).reshape(2048, 2048) @ jnp.cos(x).reshape(2048, 2048)).reshape(-1) * 0.5,
                   donate_argnums=0)
    x = jnp.ones((4 << 20,), jnp.float32)
    for _ in range(8):
        x = step(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        x = step(x).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
    print(json.dumps({"status": host_memory.status, "faults_per_call": faults}))
""")


def probe(keep: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **{host_memory.ENV: keep})
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
    assert kept["faults_per_call"] < default["faults_per_call"] / 20, (kept, default)
