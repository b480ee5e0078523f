"""`python -m rigforge.cli`: the `rigforge` command (rigforge/cli/main.py) without its console script."""

import sys

from rigforge.cli.main import main

sys.exit(main())
