"""The package's layering: import-linter's contracts (pyproject.toml) hold, no import cycle exists among jaxtrain's
modules (function-local imports included), and the old module paths point to the new ones in one line."""

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

import jaxtrain

REPO = Path(__file__).resolve().parent.parent


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 6, proc.stdout


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each is an import cycle."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_among_modules():
    g = grimp.build_graph("jaxtrain", cache_dir=None)
    # A package's __init__ importing its own submodule is not an edge back up.
    graph = {m: {t for t in g.find_modules_directly_imported_by(m) if not m.startswith(t + ".")} for m in g.modules}
    # grimp reads function-local imports too (else this test could not fail on the cycles that they close).
    assert "jaxtrain.train" in graph["jaxtrain.main"]  # main imports train inside run()
    assert strongly_connected({**graph, "a": {"b"}, "b": {"a"}}) == [["a", "b"]]  # the finder finds cycles
    assert strongly_connected(graph) == []


@pytest.mark.parametrize("old,command,args", [("jaxtrain.plan", "plan", ["--help"]), ("jaxtrain.hf", "hf", ["--help"]),
                                              ("jaxtrain.data.prepare", "prepare", ["--help"]),
                                              ("jaxtrain.profiling", "profile", ["no-such-dir"])])
def test_old_commands_run_the_new_one(old, command, args):
    """`python -m jaxtrain.plan ARGS` is `jaxtrain plan ARGS`: the same output and exit code, plus one line on
    stderr naming the command (the model-family issue's commands are written the old way)."""
    run = lambda *cmd: subprocess.run([sys.executable, "-m", *cmd, *args], cwd=REPO, capture_output=True,  # noqa
                                      text=True, timeout=120)
    new, then = run("jaxtrain", command), run(old)
    assert then.returncode == new.returncode and then.stdout == new.stdout and new.stdout + new.stderr
    assert then.stderr == f"note: python -m {old} is now `jaxtrain {command}`; running that\n" + new.stderr


def test_old_modules_name_their_new_place():
    """`from jaxtrain import mesh` names the new place (jaxtrain.__getattr__). `import jaxtrain.mesh` does too
    where an old command runs (compat.old_paths' finder); elsewhere no finder is installed (test_compat)."""
    with pytest.raises(ImportError, match=r"jaxtrain\.mesh has moved to jaxtrain\.parallel\.mesh"):
        from jaxtrain import mesh  # noqa: F401
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        jaxtrain.nope  # noqa: B018
    from jaxtrain.compat import old_paths

    with pytest.raises(ImportError, match=r"jaxtrain\.metrics has moved to jaxtrain\.observe\.metrics"):
        old_paths._Moved().exec_module(type(sys)("jaxtrain.metrics"))


def test_the_jaxtrain_command_lists_and_dispatches():
    from jaxtrain.tools import cli

    listing = subprocess.run([sys.executable, "-m", "jaxtrain", "--help"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert listing.returncode == 0
    assert [line.split()[0] for line in listing.stdout.splitlines() if line.startswith("  ")] == list(cli.COMMANDS)
    unknown = subprocess.run([sys.executable, "-m", "jaxtrain", "trian"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: trian: unknown command")
    bad_flag = subprocess.run([sys.executable, "-m", "jaxtrain", "train", "--config", "configs/tiny.py",
                               "--config.model.nope=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad_flag.returncode == 2
    assert bad_flag.stderr.splitlines() == ["error: model.nope: unknown key (not in jaxtrain.config.base_config)"]
