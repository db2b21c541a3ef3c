"""Ansible filters over sparkspec's registry of methods and profiles (sparkspec.registry), for the roles.

The contract role resolves each host once (``sparkspec_resolve``) into the fact ``sparkspec_resolved``; the deploy
role turns that into vLLM's command line (``sparkspec_vllm_command``), the fetch role into what to download
(``sparkspec_downloads``). Errors come back as one line in
``problems``, which the role asserts on, so the play stops with the line and not a traceback.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError  # type: ignore[import-untyped]

from sparkspec import registry
from sparkspec.errors import UserError


def _record(slurped: Any) -> Mapping[str, Any] | None:
    """The switch record from a slurp result (None when the file is absent)."""
    if not isinstance(slurped, Mapping) or "content" not in slurped:
        return None
    try:
        record = json.loads(base64.b64decode(slurped["content"]))
    except (binascii.Error, ValueError):
        record = None
    if not isinstance(record, Mapping) or not isinstance(record.get("method"), str):
        raise registry.RegistryError(f"{slurped.get('source', 'the switch record')}: not a switch record "
                                     "({method, inventory_method, time}); remove the file")
    return record


def resolve(contract: Mapping[str, Any], slurped: Any = None, now: str = "") -> dict[str, Any]:
    """registry.resolve for one host, with ``problems`` (empty, or the one line to stop the play with)."""
    try:
        return {**registry.resolve(contract, _record(slurped), now), "problems": []}
    except UserError as exc:
        return {"problems": [str(exc)]}


def vllm_command(resolved: Mapping[str, Any], knobs: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, Any]:
    if resolved.get("problems"):
        raise AnsibleFilterError(resolved["problems"][0])
    return registry.vllm_command(resolved, knobs, service)


def downloads(resolved: Mapping[str, Any], heads: str = "all") -> list[dict[str, Any]]:
    if resolved.get("problems"):
        raise AnsibleFilterError(resolved["problems"][0])
    return registry.downloads(resolved, heads)


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"sparkspec_resolve": resolve, "sparkspec_vllm_command": vllm_command,
                "sparkspec_downloads": downloads}
