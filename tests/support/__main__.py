"""``python -m tests.support ...``: the generators' command line (see :mod:`tests.support.cli`)."""

import sys

from tests.support.cli import main

sys.exit(main())
