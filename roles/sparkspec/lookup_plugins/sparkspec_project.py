"""lookup('sparkspec_project'): the sparkspec checkout on the controller (the folder holding roles/,
src/, .sim/).

Roles and the simulated inventory use it for controller-side paths (the source the tools wheel is
built from, the reports folder, the simulation's generated secrets) instead of climbing out of a
role with ``role_path | dirname | dirname``, which also breaks when a role is installed elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: sparkspec_project
short_description: the sparkspec checkout on the controller
description:
  - Returns the absolute path of the sparkspec checkout that holds this role
    (roles/sparkspec/lookup_plugins/..).
options: {}
"""

RETURN = r"""
_raw:
  description: one path, the checkout's root folder
  type: list
  elements: str
"""

PROJECT = Path(__file__).resolve().parents[3]


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None,
            **kwargs: Any) -> list[str]:
        return [str(PROJECT)]
