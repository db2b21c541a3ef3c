"""`invoke molecule --role R`: one role's molecule scenario, run as `molecule test` in its folder.

The scenario prepares its own inputs in its dependency step (tests/support/molecule_inputs.py,
cached in .cache/molecule/); this task only finds the role and puts the project's venv on PATH
(molecule runs ansible-config and ansible-playbook from PATH). Nothing here imports tests/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from invoke import Exit, task

from tasks.lib.common import ROOT

COMMANDS = ("test", "create", "converge", "idempotence", "verify", "destroy", "list")


def scenario_roles() -> list[str]:
    """The roles that have a molecule scenario (roles/ROLE/molecule/default)."""
    return sorted(p.parts[-4] for p in ROOT.glob("roles/*/molecule/default/molecule.yml"))


@task(positional=[], auto_shortflags=False,
      help={"role": "a role with a molecule scenario: " + ", ".join(scenario_roles()),
            "command": "molecule's command: " + ", ".join(COMMANDS)})
def molecule(c, role="", command="test"):
    """One role's molecule scenario in a container of the simulated Spark's image.

    The default command is molecule test."""
    roles = scenario_roles()
    if role not in roles:
        raise Exit(f"sparkspec: error: --role {role!r} has no molecule scenario; give one of "
                   f"{', '.join(roles)}", code=2)
    if command not in COMMANDS:
        raise Exit(f"sparkspec: error: --command {command!r} is not one of "
                   f"{', '.join(COMMANDS)}", code=2)
    bindir = Path(sys.executable).parent
    with c.cd(str(ROOT / "roles" / role)):
        c.run(f"{bindir}/molecule {command}", pty=False,
              env={"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"})
