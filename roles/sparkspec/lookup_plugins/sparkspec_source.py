"""lookup('sparkspec_source', 'module_utils/sparkspec_host.py'): the text of a file of the contract
role, found next to this plugin whatever the calling role.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: sparkspec_source
short_description: the text of a file of the sparkspec contract role
description:
  - Returns the text of each term, a path relative to the contract role's folder (roles/sparkspec),
    exactly as it is (no trailing newline stripped).
options:
  _terms:
    description: paths inside the contract role, e.g. module_utils/sparkspec_host.py
    required: true
"""

RETURN = r"""
_raw:
  description: the text of each file
  type: list
  elements: str
"""

ROLE = Path(__file__).resolve().parents[1]


def source(relative: str) -> str:
    path = (ROLE / relative).resolve()
    if not path.is_relative_to(ROLE) or not path.is_file():
        raise AnsibleLookupError(f"sparkspec_source: {relative!r} is not a file of {ROLE}; name "
                                 "one under it")
    return path.read_text(encoding="utf-8")


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: dict[str, Any] | None = None,
            **kwargs: Any) -> list[str]:
        return [source(str(term)) for term in terms]
