"""`jaxtrain <command> [args]` (also `python -m jaxtrain <command>`): one entry point for every command.

Each command's module is imported only when it runs: `jaxtrain plan` must set XLA's flags before jax starts.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, its entry point taking the arguments after the command, what it does)
COMMANDS = {
    "train": ("jaxtrain.main", "cli", "train a model from a config file (the same as python -m jaxtrain.main)"),
    "prepare": ("jaxtrain.tools.prepare", "main", "tokenize text into a prepared data dir"),
    "generate": ("jaxtrain.tools.generate", "main", "sample text from a run's checkpoint or a Hugging Face directory"),
    "hf": ("jaxtrain.tools.hf", "main",
           "export a checkpoint as a Hugging Face directory, or print the flags to start from one"),
    "plan": ("jaxtrain.tools.plan.cli", "main",
             "compile the step ahead of time: memory, FLOPs and collectives per device, no training"),
    "sweep": ("jaxtrain.tools.sweep.cli", "main", "a hyperparameter sweep over a config (Optuna)"),
    "report": ("jaxtrain.tools.report", "main", "curves and a summary table across workdirs"),
    "supervise": ("jaxtrain.tools.supervise", "main",
                  "rerun a training command on preemption and crashes, within budgets"),
    "profile": ("jaxtrain.tools.profile", "main", "where a profiled run's step time went"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: jaxtrain <command> [args]   (jaxtrain <command> --help for its flags)\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {about}" for name, (_, _, about) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: {argv[0]}: unknown command; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, entry, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), entry)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
