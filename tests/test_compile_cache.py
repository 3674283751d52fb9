"""The persistent compilation cache (train.compile_cache): where each setting puts it, what `install` changes, the
bad values that exit 2, and that a restarted `jaxtrain train` loads its step from the cache instead of compiling."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def train_cli(config_json: Path, tmp_path: Path, stop_at: int, attempt: int | None = None) -> str:
    """`jaxtrain train` to `stop_at` with the cache in tmp_path/xla, as `jaxtrain supervise`'s attempt `attempt`
    if given; returns the compilers' log (stderr)."""
    config_py = tmp_path / "config.py"
    config_py.write_text(f"import json, ml_collections\n\ndef get_config():\n"
                         f"    return ml_collections.ConfigDict(json.loads(open({str(config_json)!r}).read()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.SUPERVISED_ENV)}
    env.update(PYTHONPATH=str(REPO), JAX_DEBUG_LOG_MODULES="jax._src.compiler,jaxtrain.compile_cache",
               JAX_LOG_COMPILES="1",  # "Finished tracing ..."
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # the tiny step compiles in well under jax's 1 s
               **({compile_cache.SUPERVISED_ENV: str(attempt)} if attempt else {}))
    out = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config", str(config_py),
                          f"--config.train.compile_cache={tmp_path / 'xla'}", f"--config.train.stop_at={stop_at}"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stderr


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(workdir, "metrics.jsonl")))
            if "loss" in r}


@pytest.mark.slow
def test_a_restart_loads_the_train_step_from_the_cache_and_under_supervise_skips_its_trace(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "eval.every_steps": 0, "checkpoint.every_steps": 2})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    first = train_cli(tmp_path / "config.json", tmp_path, stop_at=4, attempt=1)
    assert "PERSISTENT COMPILATION CACHE MISS for 'jit_train_step'" in first
    straight = losses(cfg.workdir)
    untraced = tmp_path / "xla" / "jaxtrain-untraced-process-0"
    assert sorted(p.split("-")[0] for p in os.listdir(untraced)) == ["_checksum_leaves", "train_step"]
    entries = sorted(os.listdir(tmp_path / "xla"))

    def resume_at_2(attempt):  # as after a crash that lost step 4: its checkpoint and its metrics go
        shutil.rmtree(os.path.join(cfg.workdir, "checkpoints", "4"))
        log = train_cli(tmp_path / "config.json", tmp_path, stop_at=4, attempt=attempt)
        assert {s: v for s, v in losses(cfg.workdir).items() if s > 2} == {3: straight[3], 4: straight[4]}
        return log

    plain = resume_at_2(None)  # not supervised: traced, then loaded from the process's own entry
    assert "own-entry cache hit for 'jit_train_step'" in plain
    assert "Finished tracing train_step" in plain
    assert "CACHE MISS for 'jit_train_step'" not in plain and "untraced cache hit" not in plain
    supervised = resume_at_2(2)  # neither traced nor lowered: nothing of jax's compiler log names the step
    assert "untraced cache hit for 'jit_train_step'" in supervised
    assert "untraced cache hit for 'jit__checksum_leaves'" in supervised
    assert "for 'jit_train_step'" not in supervised.replace("untraced cache hit for 'jit_train_step'", "")
    assert "Finished tracing train_step" not in supervised and "Finished tracing _checksum_leaves" not in supervised
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


class Spy:
    """A jitted function whose lowerings (its traces) are counted."""

    def __init__(self, jitted):
        self.jitted, self.__name__, self.lowered = jitted, jitted.__name__, 0

    def lower(self, *args):
        self.lowered += 1
        return self.jitted.lower(*args)


def arrays():
    import jax
    import jax.numpy as jnp

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2])[::-1], ("d",))  # devices 1, 0: the mesh's order is kept
    x = jax.device_put(jnp.arange(24.0).reshape(6, 4) / 24, jax.sharding.NamedSharding(mesh, P("d")))
    return x, jax.device_put(jnp.full((4, 5), 0.7), jax.sharding.NamedSharding(mesh, P()))


def test_each_process_keeps_and_loads_entries_of_the_programs_it_compiled(own_cache_dir, cache_counts, monkeypatch):
    import jax
    import jax.numpy as jnp

    monkeypatch.setattr(jax, "process_index", lambda: 1)  # on CPU jax's own cache key names the process

    def fresh():  # the same program, traced and lowered anew (jax keeps the executable of a lowering in memory)
        return Spy(jax.jit(lambda x, y: {"z": jnp.tanh(x @ y).sum(0)}))

    x, y = arrays()
    compiled = compile_cache.compile(fresh(), x, y)
    own = own_cache_dir / "jaxtrain-programs-process-1"
    (entry,) = os.listdir(own)
    assert compile_cache.counts()["hits"] == 0
    f = fresh()
    loaded = compile_cache.compile(f, x, y)
    assert compile_cache.counts()["hits"] == 1 and f.lowered == 1  # traced: it has no key
    np.testing.assert_array_equal(loaded(x, y)["z"], compiled(x, y)["z"])
    np.testing.assert_array_equal(loaded(x, y)["z"], f.jitted(x, y)["z"])
    compile_cache.compile(f, x, y[:, :3])  # another program: another entry
    assert len(os.listdir(own)) == 2
    compile_cache.compile(f, np.ones((6, 4)), np.ones((4, 5)))  # over no mesh: left to jax
    assert len(os.listdir(own)) == 2

    monkeypatch.setattr(jax, "process_index", lambda: 0)  # process 0 keeps its own too, beside jax's
    compile_cache.compile(fresh(), x, y[:, :2])
    own = own_cache_dir / "jaxtrain-programs-process-0"
    (entry,) = os.listdir(own)
    (own / entry).write_bytes(b"damaged")
    y2, hits = y[:, :2], compile_cache.counts()["hits"]
    again = compile_cache.compile(fresh(), x, y2)  # passed over: jax's cache serves it
    assert compile_cache.counts()["hits"] == hits + 1
    np.testing.assert_array_equal(again(x, y2)["z"], f.jitted(x, y2)["z"])
    # Not rewritten from an executable jax loaded: XLA:CPU re-serializes one without some of its functions.
    assert (own / entry).read_bytes() == b"damaged"


def test_untraced_entries_load_without_a_trace_under_the_supervisor(own_cache_dir, cache_counts, monkeypatch):
    import jax
    import jax.numpy as jnp

    x, y = arrays()
    x, y = x[:, :3], y[:3]

    def fresh():  # the same program, traced anew
        return Spy(jax.jit(lambda a, b: {"z": jnp.sinh(a @ b).cumsum(0)}))

    untraced = own_cache_dir / "jaxtrain-untraced-process-0"
    monkeypatch.setattr(compile_cache, "_untraced", False)  # not supervised: keys are ignored
    compile_cache.compile(fresh(), x, y, key=("run",))
    assert not untraced.exists()

    monkeypatch.setattr(compile_cache, "_untraced", True)
    f = fresh()
    compiled = compile_cache.compile(f, x, y, key=("run",))  # linked to the program's entry, compiled just now
    (entry,) = os.listdir(untraced)
    (program,) = os.listdir(own_cache_dir / "jaxtrain-programs-process-0")
    assert entry.startswith("<lambda>-") and f.lowered == 1
    assert (untraced / entry).read_bytes() == (own_cache_dir / "jaxtrain-programs-process-0" / program).read_bytes()
    g = fresh()
    loaded = compile_cache.compile(g, x, y, key=("run",))
    assert g.lowered == 0 and compile_cache.counts()["untraced"] == 1
    np.testing.assert_array_equal(loaded(x, y)["z"], compiled(x, y)["z"])
    compile_cache.compile(g, x, y, key=("another config",))  # another key: traced
    compile_cache.compile(g, x[:, :2], y[:2], key=("run",))  # other shapes: traced
    assert g.lowered == 2 and len(os.listdir(untraced)) == 3

    (untraced / entry).unlink()  # a hard link to the program's entry: damage this one alone
    (untraced / entry).write_bytes(b"damaged")
    h = fresh()
    again = compile_cache.compile(h, x, y, key=("run",))  # traced, and linked to the program's entry again
    assert h.lowered == 1
    np.testing.assert_array_equal(again(x, y)["z"], compiled(x, y)["z"])
    assert (untraced / entry).read_bytes() != b"damaged"
    assert compile_cache.compile(fresh(), x, y, key=("run",)) and compile_cache.counts()["untraced"] == 2


def test_the_untraced_key_follows_the_code_on_disk_and_the_compiler_flags(tmp_path, monkeypatch):
    import importlib.util

    module_file = tmp_path / "users_loss.py"
    module_file.write_text("SCALE = 1.0\n")
    spec = importlib.util.spec_from_file_location("users_loss", module_file)
    monkeypatch.setitem(sys.modules, "users_loss", importlib.util.module_from_spec(spec))

    def key(environ):
        monkeypatch.setattr(compile_cache, "_code", None)  # computed once per process
        return compile_cache._untraced_context(environ)

    base = key({})
    assert key({}) == base
    module_file.write_text("SCALE = 2.0\n")  # the user's module, loaded from outside the Python installation
    assert key({}) != base
    edited = key({})
    assert key({"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"}) != edited
    monkeypatch.setattr(compile_cache, "__file__", str(tmp_path / "jaxtrain" / "compile_cache.py"))
    (tmp_path / "jaxtrain").mkdir()
    (tmp_path / "jaxtrain" / "step.py").write_text("")  # another jaxtrain tree: its files are hashed instead
    assert key({}) != edited
