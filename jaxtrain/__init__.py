"""jaxtrain: LLM training on a named device mesh (README.md; the layers: docs/architecture.md)."""

import sys as _sys

if _sys.argv[:1] == ["-m"]:  # `python -m jaxtrain.<module>` is being located: an old path runs the new command
    from jaxtrain.compat import old_paths as _old_paths

    if _old_paths.old_command(_sys.orig_argv):
        _old_paths.install()


def __getattr__(name: str):
    """`from jaxtrain import mesh` and other modules that moved: an ImportError naming the new place."""
    from jaxtrain.compat import old_paths  # noqa: PLC0415

    raise old_paths.moved_to(f"jaxtrain.{name}") or AttributeError(f"module 'jaxtrain' has no attribute {name!r}")
