"""`jaxtrain profile WORKDIR/profile [--steps N] [--top 30]`: where a profiled run's step time went.

The table `--config.log.profile_steps` prints at the end of the traced steps, again, with more rows
(`jaxtrain.observe.profiling`).
"""

from __future__ import annotations

from pathlib import Path

from jaxtrain.observe import profiling
from jaxtrain.tools import common


def _profile(argv) -> int:
    parser = common.Parser(prog="jaxtrain profile", description=__doc__.splitlines()[0])
    parser.add_argument("logdir", help="WORKDIR/profile of a run with --config.log.profile_steps")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps in the trace (default: as the run's summary.txt says, else 1)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    logdir = Path(args.logdir)
    steps = args.steps or profiling.traced_steps(logdir)
    summary = profiling.summarize(profiling.latest_trace(logdir), (logdir / profiling.HLO_FILE).read_text(), steps)
    print(profiling.format_summary(summary, args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    return common.run(_profile, argv, bad_input=(FileNotFoundError,))  # a dir with no trace, or no HLO beside it
