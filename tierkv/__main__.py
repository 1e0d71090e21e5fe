"""``python -m tierkv``: the ``tierkv`` console script (``cli.py``), for environments without it on PATH."""

import sys

from .cli import main

sys.exit(main())
