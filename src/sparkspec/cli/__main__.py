"""``python -m sparkspec.cli``: the same as the ``sparkspec`` command."""

import sys

from sparkspec.cli import main

sys.exit(main())
