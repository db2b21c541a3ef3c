"""Ansible filters over sparkspec's registry of methods and profiles (sparkspec.registry), for the
roles; an error comes back as one line in ``problems``, which the role asserts on.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ansible.errors import AnsibleFilterError

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.operate import startup
from sparkspec.registry import levers
from sparkspec.registry.cluster import check_layout
from sparkspec.registry.resolve import handoff_folder as _handoff_folder
from sparkspec.registry.resolve import handoff_items
from sparkspec.registry.resolve import handoffs as _handoffs


def _record(slurped: Any, field: str = "method",
            shape: str = "{method, inventory_method, time}") -> Mapping[str, Any] | None:
    """A switch record from a slurp result (None when the file is absent)."""
    if not isinstance(slurped, Mapping) or "content" not in slurped:
        return None
    try:
        record = json.loads(base64.b64decode(slurped["content"]))
    except (binascii.Error, ValueError):
        record = None
    if not isinstance(record, Mapping) or not isinstance(record.get(field), str):
        raise registry.RegistryError(f"{slurped.get('source', 'the switch record')}: not a switch "
                                     f"record ({shape}); remove the file")
    return record


def resolve(contract: Mapping[str, Any], slurped: Any = None, now: str = "",
            set_names: Sequence[str] = (),
            cluster: Mapping[str, Any] | None = None,
            release_slurped: Any = None) -> dict[str, Any]:
    """registry.resolve for one host, with ``problems`` (empty, or the one line to stop the play
    with). ``cluster``: {me, members, accelerator} where sparkspec_cluster is set;
    ``release_slurped``: the release switch's record."""
    try:
        release = _record(release_slurped, "release",
                          "{release, previous, inventory_release, time}")
        return {**registry.resolve(contract, _record(slurped), now, set_names, cluster, release),
                "problems": []}
    except UserError as exc:
        return {"problems": [str(exc)]}


def registry_names(kind: str) -> list[str] | str:
    """Names the registry owns, for the roles: ``contract`` (the contract's keys, without the
    sparkspec_ prefix) or ``renamed_pattern`` (a regular expression matching a variable this version
    renamed)."""
    if kind == "contract":
        return list(registry.CONTRACT_KEYS)
    if kind == "renamed_pattern":
        return "^(" + "|".join(re.escape(name) for name in registry.RENAMED) + ")$"
    raise AnsibleFilterError(f"sparkspec_registry_names: {kind!r} is not contract or "
                             "renamed_pattern")


def vllm_command(resolved: Mapping[str, Any], service: Mapping[str, Any],
                 overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if resolved.get("problems"):
        raise AnsibleFilterError(resolved["problems"][0])
    return registry.vllm_command(resolved, service, overrides)


def downloads(resolved: Mapping[str, Any], heads: str = "all") -> list[dict[str, Any]]:
    if resolved.get("problems"):
        raise AnsibleFilterError(resolved["problems"][0])
    return registry.downloads(resolved, heads)


def handoffs(resolved: Mapping[str, Any], heads: str = "all",
             root: str = "") -> list[dict[str, Any]]:
    if resolved.get("problems"):
        raise AnsibleFilterError(resolved["problems"][0])
    try:
        return _handoffs(resolved, heads, root)
    except UserError as exc:
        raise AnsibleFilterError(str(exc)) from None


def handoff_folder(folder: str, root: str, where: str, setting: str,
                   dest: str = "") -> dict[str, Any]:
    try:
        return _handoff_folder(folder, root, where, setting, dest)
    except UserError as exc:
        raise AnsibleFilterError(str(exc)) from None


def cluster_layout_problems(cluster: Mapping[str, Any], config_text: str, model: str) -> list[str]:
    """[] when the cluster's layout fits the model's config.json (text), else the one line."""
    try:
        config = json.loads(config_text)
        if not isinstance(config, Mapping):
            raise registry.RegistryError(f"{model}: config.json is not a JSON object; check the "
                                         "checkpoint")
        check_layout(cluster, config, model)
    except ValueError:
        return [f"{model}: config.json is not JSON; check the checkpoint"]
    except UserError as exc:
        return [str(exc)]
    return []


def lever_head_problems(resolved: Mapping[str, Any], config_text: str, model: str) -> list[str]:
    """A line for each lever on that the model's head (its config.json, text) cannot take."""
    try:
        config = json.loads(config_text)
    except ValueError:
        return [f"{model}: config.json is not JSON; check the checkpoint"]
    return levers.head_problems(resolved.get("levers") or {}, config, model)


def lever_release_problems(resolved: Mapping[str, Any], release: str) -> list[str]:
    """A line for each lever on that the vLLM ``release`` does not fit."""
    return levers.release_problems(resolved.get("levers") or {}, str(release or ""))


def drafting(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What of a speculative_config every node of a cluster must agree on: all but the draft model's
    local folder (a node's own path)."""
    return None if spec is None else {k: v for k, v in spec.items() if k != "model"}


def lever_markers(resolved: Mapping[str, Any]) -> list[str]:
    """The journal line each lever on logs once it applied to the target model, as a regular
    expression (a drafter's own head logs the same words with " in the draft model (...)" after
    them: not matched)."""
    return [re.escape(registry.LEVERS[lever]["marker"]) + r" \(\[\d+, \d+\], saved \d+ MB\)\s*$"
            for lever in resolved.get("levers") or {} if "marker" in registry.LEVERS[lever]]


def startup_patterns(_: Any = None) -> list[str]:
    """The journal lines a start's report reads (sparkspec.operate.startup), for wait_healthy.py."""
    return startup.patterns()


def startup_report(stdout_lines: Sequence[str], unit: str) -> dict[str, Any]:
    """The report of the start wait_healthy.py saw (its ``startup: JSON`` line), with its one-line
    summary; None values where vLLM's journal did not say."""
    found = [line.removeprefix("startup: ") for line in stdout_lines
             if line.startswith("startup: ")]
    try:
        doc = json.loads(found[-1]) if found else {}
        out = startup.report(int(doc.get("start_us") or 0), doc.get("lines") or [],
                             int(doc.get("healthy_us") or 0))
    except (ValueError, TypeError, AttributeError):
        out = startup.report(0, [])
    return {**out, "summary": startup.summary(unit, out)}


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"sparkspec_resolve": resolve, "sparkspec_vllm_command": vllm_command,
                "sparkspec_downloads": downloads, "sparkspec_handoffs": handoffs,
                "sparkspec_handoff_items": handoff_items,
                "sparkspec_handoff_folder": handoff_folder,
                "sparkspec_registry_names": registry_names,
                "sparkspec_cluster_layout_problems": cluster_layout_problems,
                "sparkspec_lever_head_problems": lever_head_problems,
                "sparkspec_startup_patterns": startup_patterns,
                "sparkspec_startup_report": startup_report,
                "sparkspec_lever_release_problems": lever_release_problems,
                "sparkspec_lever_markers": lever_markers,
                "sparkspec_drafting": drafting}
