"""Old module paths, from before the package was split into layers (a workaround for our own users' scripts).

`python -m jaxtrain.<tool> ARGS` still runs: it is `jaxtrain <command> ARGS`, with one line on stderr naming that
command. For that, `jaxtrain/__init__.py` installs a finder on sys.meta_path, but only in a process started as
`python -m <an old path>` (`old_command`), so an ordinary `import jaxtrain` changes nothing. `from jaxtrain
import <old module>` raises ImportError naming the new place (`jaxtrain.__getattr__` uses `moved_to`).
It can go once the old paths have been documented as gone for a release.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import runpy
import sys

# Old `python -m` paths -> the `jaxtrain` subcommand that replaced them.
COMMANDS = {"jaxtrain.plan": "plan", "jaxtrain.sweep": "sweep", "jaxtrain.report": "report",
            "jaxtrain.supervise": "supervise", "jaxtrain.generate": "generate", "jaxtrain.hf": "hf",
            "jaxtrain.profiling": "profile", "jaxtrain.data.prepare": "prepare"}
# Old modules -> where their code lives now.
MODULES = {"jaxtrain.mesh": "jaxtrain.parallel.mesh", "jaxtrain.pipeline_parallel": "jaxtrain.parallel.pipeline",
           "jaxtrain.distributed": "jaxtrain.parallel.distributed", "jaxtrain.metrics": "jaxtrain.observe.metrics",
           "jaxtrain.tracking": "jaxtrain.observe.tracking", "jaxtrain.goodput": "jaxtrain.observe.goodput",
           "jaxtrain.profiling": "jaxtrain.observe.profiling", "jaxtrain.gpu_topology": "jaxtrain.tools.plan.topology",
           "jaxtrain.plan": "jaxtrain.tools.plan", "jaxtrain.sweep": "jaxtrain.tools.sweep",
           "jaxtrain.report": "jaxtrain.tools.report", "jaxtrain.supervise": "jaxtrain.tools.supervise",
           "jaxtrain.generate": "jaxtrain.models.sampling", "jaxtrain.hf": "jaxtrain.models.hf"}


def message(old: str) -> str:
    return f"note: python -m {old} is now `jaxtrain {COMMANDS[old]}`; running that"


def run(old: str) -> None:
    """`python -m old ARGS` as `python -m jaxtrain <its command> ARGS` (exits with that command's code)."""
    print(message(old), file=sys.stderr)
    sys.argv = ["jaxtrain", COMMANDS[old], *sys.argv[1:]]
    runpy.run_module("jaxtrain", run_name="__main__", alter_sys=True)  # by name: the library imports no CLI


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MODULES else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise moved_to(module.__name__)

    def get_code(self, name):  # what `python -m <old path>` runs
        return compile(f"from jaxtrain.compat import old_paths\nold_paths.run({name!r})", name, "exec")


def old_command(orig_argv: list[str]) -> str | None:
    """The old path `python -m` runs in a process started with `orig_argv` (sys.orig_argv), or None."""
    for i, arg in enumerate(orig_argv[1:-1], 1):
        if arg == "-m" or (arg.startswith("-") and not arg.startswith("--") and arg.endswith("m")):  # -m, -um
            return orig_argv[i + 1] if orig_argv[i + 1] in COMMANDS else None
        if not arg.startswith("-"):  # a script or `-c`'s code: no module run
            return None
    return None


def moved_to(name: str) -> ImportError | None:
    """The ImportError for importing `name` (a module path), if that module has moved."""
    return ImportError(f"{name} has moved to {MODULES[name]}", name=name) if name in MODULES else None


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())  # last: consulted only for names nothing else finds
