"""``python -m shuttle``: the ``shuttle`` command line."""

import sys

from shuttle.cli import main

sys.exit(main())
