"""The persistent compilation cache (train.compile_cache): where each setting puts it, what `install` changes, the
bad values that exit 2, and that a restarted `jaxtrain train` loads its step from the cache instead of compiling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import compile_cache
from jaxtrain import config as config_lib
from jaxtrain import main as main_lib
from jaxtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_where_each_setting_puts_the_cache(tmp_path):
    workdir = str(tmp_path / "runs" / "a")
    assert compile_cache.directory("auto", workdir, {}) == str(tmp_path / "runs" / ".jax_cache")  # beside it
    assert compile_cache.directory("auto", workdir, {"JAX_COMPILATION_CACHE_DIR": "/c"}) == "/c"  # the user's
    assert compile_cache.directory("off", workdir, {"JAX_COMPILATION_CACHE_DIR": "/c"}) is None
    assert compile_cache.directory("", workdir, {}) is None
    assert compile_cache.directory("~/xla", workdir, {}) == os.path.expanduser("~/xla")
    assert compile_cache.directory("gs://b/xla", workdir, {}) == "gs://b/xla"


@pytest.fixture
def jax_updates(monkeypatch):
    """jax.config.update recorded, not applied: this test process's cache must stay as conftest set it."""
    import jax

    updates = []
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    return updates


def test_install_points_jax_at_the_directory_or_turns_the_cache_off(tiny_config, tmp_path, jax_updates):
    cfg = tiny_config(**{"train.compile_cache": str(tmp_path / "new" / "xla")})
    assert compile_cache.install(cfg) == str(tmp_path / "new" / "xla")
    assert not (tmp_path / "new").exists()  # jax creates it at its first compile, after the checks
    assert jax_updates == [("jax_enable_compilation_cache", True),
                           ("jax_compilation_cache_dir", str(tmp_path / "new" / "xla"))]
    jax_updates.clear()
    cfg.train.compile_cache = "off"
    assert compile_cache.install(cfg) is None and jax_updates == [("jax_enable_compilation_cache", False)]


def test_an_unwritable_directory_is_a_config_error_unless_auto(tiny_config, tmp_path, jax_updates):
    (tmp_path / "file").write_text("")
    cfg = tiny_config(workdir=tmp_path / "file" / "run", **{"train.compile_cache": str(tmp_path / "file" / "xla")})
    with pytest.raises(ConfigError, match="train.compile_cache: .*file is not a directory"):
        compile_cache.install(cfg)
    assert jax_updates == []
    cfg.train.compile_cache = "auto"  # beside that workdir: a warning, and no cache
    warnings = []
    assert compile_cache.install(cfg, environ={}, warn=warnings.append) is None
    assert "compiling without a persistent cache" in warnings[0]
    assert jax_updates == [("jax_enable_compilation_cache", False)]


def test_a_bad_value_exits_2_naming_the_field_before_the_workdir_exists(tiny_config, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cfg = tiny_config(workdir=tmp_path / "run", **{"train.compile_cache": str(tmp_path / "file" / "xla")})
    assert main_lib.run(cfg) == 2
    assert capsys.readouterr().err.startswith("error: train.compile_cache: ")
    assert not (tmp_path / "run").exists()
    cfg = config_lib.base_config()
    with cfg.unlocked():
        cfg.train.compile_cache = None
    with pytest.raises(ConfigError, match="train.compile_cache"):
        config_lib.validate(cfg, 1)


def train_cli(config_json: Path, tmp_path: Path, stop_at: int) -> str:
    """`jaxtrain train` to `stop_at` with the cache in tmp_path/xla; returns jax's compiler log (stderr)."""
    config_py = tmp_path / "config.py"
    config_py.write_text(f"import json, ml_collections\n\ndef get_config():\n"
                         f"    return ml_collections.ConfigDict(json.loads(open({str(config_json)!r}).read()))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(PYTHONPATH=str(REPO), JAX_DEBUG_LOG_MODULES="jax._src.compiler",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")  # the tiny step compiles in well under jax's 1 s
    out = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", str(config_py),
                          f"--config.train.compile_cache={tmp_path / 'xla'}", f"--config.train.stop_at={stop_at}"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stderr


@pytest.mark.slow
def test_a_restart_loads_the_train_step_from_the_cache(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "eval.every_steps": 0, "checkpoint.every_steps": 2})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    first = train_cli(tmp_path / "config.json", tmp_path, stop_at=2)
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_train_step'" in first
    entries = sorted(os.listdir(tmp_path / "xla"))
    assert entries
    second = train_cli(tmp_path / "config.json", tmp_path, stop_at=4)  # resumes at step 2
    assert "Persistent compilation cache hit for 'jit_train_step'" in second
    assert "CACHE MISS for 'jit_train_step'" not in second
    assert sorted(os.listdir(tmp_path / "xla")) == entries  # nothing new to write



@pytest.fixture
def own_cache_dir(tmp_path):
    """jax's cache on and pointed at tmp_path/xla for the test, as `install` leaves it; restored after."""
    import jax

    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    previous = [getattr(jax.config, n) for n in names]
    jax.config.update(names[0], True)
    jax.config.update(names[1], str(tmp_path / "xla"))
    yield tmp_path / "xla"
    for n, v in zip(names, previous):
        jax.config.update(n, v)


def test_a_cpu_process_other_than_0_keeps_and_loads_entries_of_its_own(own_cache_dir, monkeypatch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    monkeypatch.setattr(jax, "process_index", lambda: 1)  # jax's own cache key names the process here
    f = jax.jit(lambda x, y: {"z": jnp.tanh(x @ y).sum(0)})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2])[::-1], ("d",))  # devices 1, 0: the mesh's order is kept
    x = jax.device_put(jnp.arange(24.0).reshape(6, 4) / 24, jax.sharding.NamedSharding(mesh, P("d")))
    y = jax.device_put(jnp.ones((4, 5)), jax.sharding.NamedSharding(mesh, P()))
    monkeypatch.setattr(compile_cache, "_counts", {"hits": 0, "misses": 0})
    compiled = compile_cache.compile(f, x, y)
    own = own_cache_dir / "jaxtrain-cpu-process-1"
    (entry,) = os.listdir(own)
    assert compile_cache.counts()["hits"] == 0
    loaded = compile_cache.compile(f, x, y)
    assert compile_cache.counts()["hits"] == 1
    np.testing.assert_array_equal(loaded(x, y)["z"], compiled(x, y)["z"])
    np.testing.assert_array_equal(loaded(x, y)["z"], f(x, y)["z"])
    compile_cache.compile(f, x, y[:, :3])  # another program: another entry
    assert len(os.listdir(own)) == 2
    compile_cache.compile(f, np.ones((6, 4)), np.ones((4, 5)))  # over no mesh: left to jax
    assert len(os.listdir(own)) == 2
    (own / entry).write_bytes(b"damaged")
    again = compile_cache.compile(f, x, y)  # compiled again and rewritten
    np.testing.assert_array_equal(again(x, y)["z"], f(x, y)["z"])
    assert (own / entry).read_bytes() != b"damaged" and compile_cache.counts()["hits"] == 1
    monkeypatch.setattr(jax, "process_index", lambda: 0)  # process 0: jax's cache, nothing of ours
    compile_cache.compile(f, x, y[:, :2])
    assert not (own_cache_dir / "jaxtrain-cpu-process-0").exists()
