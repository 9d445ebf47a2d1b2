"""`python -m flows.cli`: the `evalpipe` command."""

import sys

from flows.cli import main

sys.exit(main())
