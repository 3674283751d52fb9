"""`python -m jaxtrain.main --config configs/default.py [--config.train.steps=50 ...]` (or `jaxtrain train ...`).

Exit codes (jaxtrain.errors): 0 done (or already finished); 2 bad config or input (one line on stderr
naming the field or path); 3 non-finite loss with faults.nan_policy=halt; 4 a checkpoint write failed;
75 preempted (SIGTERM: the step was saved, rerun to resume); 124 a step or peer hung (stacks dumped).
"""

import functools
import re
import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from jaxtrain import errors, files

CONFIG_FLAG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                              lock_config=True)


def parse_flags(argv, doc: str | None = None, modules: tuple[str, ...] = ()):
    """absl's flag parsing (a config file and its --config.* overrides) with one-line errors and exit 2. With `doc`,
    `--help` prints it and the flags `modules` define: absl's own help shows those of `__main__`, which for a
    `jaxtrain` subcommand is the dispatcher."""
    if doc is not None and any(arg in ("--help", "-help", "-h", "--helpshort") for arg in argv[1:]):
        print(doc.rstrip() + "\n\nflags:\n\n" + "\n\n".join(flags.FLAGS.module_help(m).strip("\n") for m in modules)
              + "\n\nTry --helpfull to get a list of all flags.")
        sys.exit(0)
    try:
        parsed = flags.FLAGS(argv)
    except (KeyError, AttributeError) as e:
        _die(_config_file_problem(argv) or _unknown_override(argv, e))
    except Exception as e:  # noqa: BLE001 - a bad flag, or the config file's own code failed as absl loaded it
        _die(_config_file_problem(argv) or str(e))
    value = flags.FLAGS["config"].value if "config" in flags.FLAGS else None
    if value is not None and not isinstance(value, ml_collections.ConfigDict):
        _die(_config_file_problem(argv) or f"--config: get_config() returned {type(value).__name__}, not a ConfigDict")
    return parsed


def _die(message: str):
    print(f"error: {message}".splitlines()[0], file=sys.stderr)
    sys.exit(errors.EXIT_BAD_INPUT)


def _config_file_problem(argv) -> str | None:
    """Why the --config file yields no ConfigDict, or None if it does. ml_collections reports a file that does not
    load as a traceback, or defers the error to the first use of the config; this loads it again to name the path
    and the reason in one line."""
    path = flag_value(argv, "config")
    if path is None:
        return None
    file, _, arg = path.partition(":")  # config_flags passes what follows a colon to get_config
    try:
        config = files.run_python_file(file, "get_config", *([arg] if arg else []), field="--config")
    except errors.ConfigError as e:
        return str(e)
    if not isinstance(config, ml_collections.ConfigDict):
        return f"--config: {file}: get_config() returned {type(config).__name__}, not a ConfigDict"
    return None


def flag_value(argv: list[str], name: str) -> str | None:
    """A flag's value in a raw command line (`argv[0]` the program), before or without absl parsing it."""
    for i, arg in enumerate(argv[1:], 1):
        if arg in (f"--{name}", f"-{name}"):
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith((f"--{name}=", f"-{name}=")):
            return arg.split("=", 1)[1]
    return None


def _unknown_override(argv, e) -> str:
    """config_flags reports `--config.model.foo=1` as a bare "'foo'" (plus a multi-line did-you-mean);
    name the field the way ConfigError does: '<field>: <reason>'."""
    text = str(e)
    key = next(iter(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)), None)
    for arg in argv[1:]:
        name = arg.lstrip("-").split("=", 1)[0]
        if key and name.startswith("config.") and key in name.split(".")[1:]:
            hint = re.search(r'Did you mean "([^"]+)"', text)
            suffix = f"; did you mean {hint.group(1)!r}?" if hint else ""
            return f"{name.removeprefix('config.')}: unknown key (not in jaxtrain.config.base_config){suffix}"
    return text.splitlines()[0]


def run(config) -> int:
    """train.run with the documented exit codes for known failures (one line on stderr); bugs propagate. Installs
    the persistent compilation cache first (train.compile_cache): it is process-wide, and read at the first
    compile."""
    from jaxtrain import compile_cache, train  # after the flags: --help and bad flags answer without importing jax

    try:
        compile_cache.install(config, warn=functools.partial(print, file=sys.stderr))
        train.run(config)
    except (*errors.KNOWN, KeyboardInterrupt) as e:
        print(errors.message(e), file=sys.stderr)
        return errors.exit_code(e)
    return 0


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every file operation at INFO
        logging.set_verbosity(logging.WARNING)
    if CONFIG_FLAG.value is None:
        print("error: --config: required (e.g. --config configs/default.py)", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(CONFIG_FLAG.value))


def cli(argv=None, prog: str = "jaxtrain train") -> None:
    """The command line: `argv` without the program name (default: sys.argv[1:]); exits."""
    app.run(main, argv=[prog, *(sys.argv[1:] if argv is None else argv)],
            flags_parser=functools.partial(parse_flags, doc=__doc__, modules=(__name__,)))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
