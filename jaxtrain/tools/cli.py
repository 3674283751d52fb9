"""`jaxtrain <command> [args]` (also `python -m jaxtrain <command>`): one entry point for every command.

Each command's module is imported only when it runs: `jaxtrain plan` must set XLA's flags before jax starts.
"""

from __future__ import annotations

import sys


def _train(argv):
    from jaxtrain import main

    return main.cli(argv)


def _prepare(argv):
    from jaxtrain.tools import prepare

    return prepare.main(argv)


def _generate(argv):
    from jaxtrain.tools import generate

    return generate.main(argv)


def _hf(argv):
    from jaxtrain.tools import hf

    return hf.main(argv)


def _plan(argv):
    from jaxtrain.tools.plan import cli as plan_cli

    return plan_cli.main(["jaxtrain plan", *argv])


def _sweep(argv):
    from jaxtrain.tools.sweep import cli as sweep_cli

    return sweep_cli.main(argv)


def _report(argv):
    from jaxtrain.tools import report

    return report.main(argv)


def _supervise(argv):
    from jaxtrain.tools import supervise

    return supervise.main(argv)


def _profile(argv):
    from jaxtrain.tools import profile

    return profile.main(argv)


COMMANDS = {
    "train": (_train, "train a model from a config file (the same as python -m jaxtrain.main)"),
    "prepare": (_prepare, "tokenize text into a prepared data dir"),
    "generate": (_generate, "sample text from a run's checkpoint"),
    "hf": (_hf, "export a checkpoint as a Hugging Face Llama directory, or print the flags to start from one"),
    "plan": (_plan, "compile the step ahead of time: memory, FLOPs and collectives per device, no training"),
    "sweep": (_sweep, "a hyperparameter sweep over a config (Optuna)"),
    "report": (_report, "curves and a summary table across workdirs"),
    "supervise": (_supervise, "rerun a training command on preemption and crashes, within budgets"),
    "profile": (_profile, "where a profiled run's step time went"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "usage: jaxtrain <command> [args]   (jaxtrain <command> --help for its flags)\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: {argv[0]}: unknown command; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
