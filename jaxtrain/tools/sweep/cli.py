"""`jaxtrain sweep --config CONFIG --sweep SWEEP [--workers N] [--sweep_dir DIR] [--storage URL] [--trials N]
[--config.a.b=v ...]`: the command over `runner.run`.

Exit codes: 0 done (whatever the trials' states: see the results); 2 bad input, before any trial runs, with
one `error: ...` line on stderr; 75 SIGTERM (the running trials saved a checkpoint; rerun to resume).
"""

from __future__ import annotations

import functools
import sys

from jaxtrain import errors
from jaxtrain.tools import common
from jaxtrain.tools.sweep.runner import run, worker_main


def sweep(config, FLAGS) -> int:  # noqa: N803 - absl's flag values
    try:
        run(config, FLAGS.sweep, FLAGS.sweep_dir, workers=FLAGS.workers, storage=FLAGS.storage, trials=FLAGS.trials,
            print_fn=lambda *a: print(*a, flush=True))
    except errors.Preempted:
        print("preempted: running trials saved a checkpoint; rerun the same command to resume", file=sys.stderr)
        return errors.EXIT_PREEMPTED
    return errors.EXIT_OK


def main(argv: list[str] | None = None):
    """`jaxtrain sweep ...`: `argv` without the program name (default: sys.argv[1:]); exits."""
    from absl import app, flags, logging

    from jaxtrain import main as main_cli  # main defines --config (a config file + overrides)

    flags.DEFINE_string("sweep", None, "Path to a sweep file (configs/sweeps/*.py) with get_sweep().")
    flags.DEFINE_integer("workers", 1, "Worker processes on this machine (this one plus N-1 more).")
    flags.DEFINE_string("sweep_dir", None, "Where the study, trial dirs and results go "
                        "(default: <parent of config.workdir>/sweeps/<workdir name>_<sweep name>).")
    flags.DEFINE_string("storage", None, "An RDB URL (workers on many machines) or a journal file path; "
                        "default SWEEP_DIR/study.journal.")
    flags.DEFINE_integer("trials", None, "Override the sweep file's trial budget.")
    flags.DEFINE_boolean("worker", False, "Internal: an extra worker started by --workers (job on stdin).")
    FLAGS = flags.FLAGS

    def run_sweep(argv):
        del argv
        if not FLAGS["verbosity"].present:  # Orbax logs every file operation at INFO
            logging.set_verbosity(logging.WARNING)
        if FLAGS.worker:
            sys.exit(worker_main())
        if main_cli.CONFIG_FLAG.value is None:
            print("error: --config: required (e.g. --config configs/tiny.py)", file=sys.stderr)
            sys.exit(errors.EXIT_BAD_INPUT)
        if not FLAGS.sweep:
            print("error: --sweep: required (e.g. --sweep configs/sweeps/lr_grid.py)", file=sys.stderr)
            sys.exit(errors.EXIT_BAD_INPUT)
        sys.exit(common.run(lambda _: sweep(main_cli.CONFIG_FLAG.value, FLAGS)))

    app.run(run_sweep, argv=["jaxtrain sweep", *(sys.argv[1:] if argv is None else argv)],
            flags_parser=functools.partial(main_cli.parse_flags, doc=__doc__, modules=(__name__, main_cli.__name__)))
