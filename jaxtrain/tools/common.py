"""What every command shares: an argparse parser whose errors are one line, and the error boundary.

Known failures (`jaxtrain.errors`) become `error: <field or path>: <reason>` on stderr and their documented
exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from absl import logging

from jaxtrain import errors


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line and exit 2 (argparse's default prints the usage too)."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(errors.EXIT_BAD_INPUT)


def run(main, argv=None, *, bad_input=()) -> int:
    """`main(argv)`'s exit code, with known failures reported in one line. `bad_input`: more exception types
    that this command treats as bad input (exit 2), e.g. a missing checkpoint for a tool that reads one."""
    try:
        return main(argv) or 0
    except tuple(bad_input) as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.EXIT_BAD_INPUT
    except (*errors.KNOWN, KeyboardInterrupt) as e:
        print(errors.message(e), file=sys.stderr)
        return errors.exit_code(e)


def quiet_orbax() -> None:
    """Orbax logs every file operation at INFO; commands show warnings only."""
    logging.set_verbosity(logging.WARNING)
