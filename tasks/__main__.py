"""`python -m tasks report ...`: the report's own command line (tasks.report.main), which the
verify role runs on the controller to write the Results Summary table; every other command is an
invoke task."""

from __future__ import annotations

import sys

from tasks import report

if sys.argv[1:2] != ["report"]:
    print("sparkspec: error: python -m tasks takes `report ...` only; "
          "run `invoke --list` for the tasks", file=sys.stderr)
    raise SystemExit(2)
raise SystemExit(report.main(sys.argv[2:]))
