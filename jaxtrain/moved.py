"""Old module paths, from before the package was split into layers: each fails with one line saying where
it went. `python -m jaxtrain.<tool>` exits 2 naming the `jaxtrain <command>` that replaced it; an import
of an old module raises ImportError naming the new one. Installed by `jaxtrain/__init__.py`."""

from __future__ import annotations

import importlib.abc
import importlib.util
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
    new = COMMANDS[old]
    return f"error: python -m {old} has moved: run `jaxtrain {new} ...` (or python -m jaxtrain {new})"


def point(old: str) -> int:
    """Says where the command `python -m old` went; the exit code for it."""
    print(message(old), file=sys.stderr)
    return 2


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MODULES else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(f"{module.__name__} has moved to {MODULES[module.__name__]}", name=module.__name__)

    def get_code(self, name):  # what `python -m <old path>` runs
        return compile(f"import sys\nfrom jaxtrain import moved\nsys.exit(moved.point({name!r}))", name, "exec")


def install() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())  # last: consulted only for names nothing else finds
