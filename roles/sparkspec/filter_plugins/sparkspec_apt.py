"""Ansible filter for the monitoring role's webhook preflight: which Alertmanager apt would leave on
the host, and whether that one keeps a webhook's URL secret (0.26.0 and later).
"""

from __future__ import annotations

import re
from typing import Any

PACKAGE = "prometheus-alertmanager"
SECRET_URL_SINCE = (0, 26)   # Alertmanager 0.26.0: the webhook URL is a secret, masked in the API
_FIELD = re.compile(r"^\s*(Installed|Candidate):\s*(\S+)\s*$", re.MULTILINE)
_UPSTREAM = re.compile(r"(?:\d+:)?(\d+)\.(\d+)")


def alertmanager_version(policy: Any) -> tuple[int, int] | None:
    """(major, minor) of the Alertmanager apt keeps or would install, from ``apt-cache policy``'s
    text; None where there is neither (the package is unknown to apt)."""
    fields = dict(_FIELD.findall(str(policy)))
    for name in ("Installed", "Candidate"):
        match = _UPSTREAM.match(fields.get(name, "(none)"))
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def webhook_problem(policy: Any, host: str) -> str:
    """One line when a webhook cannot be kept secret on this host's Alertmanager, else ""."""
    version = alertmanager_version(policy)
    if version is None:
        return (f"{host}: monitoring_webhook_url is set but apt knows no {PACKAGE} here (apt-cache "
                f"policy {PACKAGE}); add the distribution's archive, or leave "
                "monitoring_webhook_url empty")
    if version < SECRET_URL_SINCE:
        shown = ".".join(map(str, version))
        return (f"{host}: monitoring_webhook_url is set, but this host's {PACKAGE} is {shown}, "
                "which shows a webhook's URL (and its token) to every local user through its API "
                "before 0.26; leave monitoring_webhook_url empty here (alerts stay in "
                "Alertmanager's UI), or use a host whose Alertmanager is 0.26 or later (Ubuntu "
                "24.04's)")
    return ""


class FilterModule:
    """The webhook preflight's filter."""

    def filters(self) -> dict[str, Any]:
        return {"sparkspec_webhook_problem": webhook_problem}
