"""`python -m jaxtrain <command> [args]`: the `jaxtrain` command without the console script on PATH."""

import sys

from jaxtrain.tools import cli

sys.exit(cli.main())
