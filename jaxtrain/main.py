"""`python -m jaxtrain.main --config configs/default.py [--config.train.steps=50 ...]`

Exit codes: 0 done (or already finished), 2 bad config or input (one line on stderr naming the field or
path), 3 non-finite loss.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).", lock_config=True)


def _parse(argv):
    try:
        return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError, TypeError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(2)


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every file operation at INFO
        logging.set_verbosity(logging.WARNING)
    from jaxtrain import config as config_lib, hooks, train  # after flag parsing: keeps --help fast
    from jaxtrain.data.prepare import DataError

    if _CONFIG.value is None:
        print("error: --config: required (e.g. --config configs/default.py)", file=sys.stderr)
        sys.exit(2)
    try:
        train.run(_CONFIG.value)
    except (config_lib.ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except hooks.NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse)
