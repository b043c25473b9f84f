"""`python -m preload_cli ...` is the `preload` console script."""

import sys

from preload_cli.main import main

sys.exit(main())
