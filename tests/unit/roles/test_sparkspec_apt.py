"""The monitoring role's webhook preflight (roles/sparkspec/filter_plugins/sparkspec_apt.py): a
webhook URL (its token) is refused where the Alertmanager apt keeps or would install shows it
through its API (before 0.26.0), read from ``apt-cache policy``'s real text; and a bad URL is
refused without being echoed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "roles" / "sparkspec" / "filter_plugins"))
from sparkspec_apt import alertmanager_version, webhook_problem  # noqa: E402

from tests.unit.roles.test_monitoring_files import ROLE, preflight_line  # noqa: E402

# apt-cache policy prometheus-alertmanager on Debian 12 (this machine, before an install)
BOOKWORM = """prometheus-alertmanager:
  Installed: (none)
  Candidate: 0.25.0-1+b4
  Version table:
     0.25.0-1+b4 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
"""
# Ubuntu 24.04's (packages.ubuntu.com: 0.26.0+ds-1 in noble, 0.26.0+ds-1ubuntu0.3 in noble-updates)
NOBLE = """prometheus-alertmanager:
  Installed: (none)
  Candidate: 0.26.0+ds-1ubuntu0.3
  Version table:
     0.26.0+ds-1ubuntu0.3 500
        500 http://ports.ubuntu.com/ubuntu-ports noble-updates/universe arm64 Packages
     0.26.0+ds-1 500
        500 http://ports.ubuntu.com/ubuntu-ports noble/universe arm64 Packages
"""


@pytest.mark.parametrize(("policy", "version"), [
    (BOOKWORM, (0, 25)), (NOBLE, (0, 26)),
    # apt keeps what is installed (state: present), whatever the candidate
    (NOBLE.replace("Installed: (none)", "Installed: 0.25.0-1+b4"), (0, 25)),
    (BOOKWORM.replace("Candidate: 0.25.0-1+b4", "Candidate: 1:0.27.0-1"), (0, 27)),   # an epoch
    ("", None), ("prometheus-alertmanager:\n  Installed: (none)\n  Candidate: (none)\n", None),
])
def test_the_version_apt_keeps_or_would_install(policy: str,
                                                version: tuple[int, int] | None) -> None:
    assert alertmanager_version(policy) == version


def test_a_webhook_is_refused_before_alertmanager_0_26_and_kept_from_it() -> None:
    assert webhook_problem(BOOKWORM, "spark") == (
        "spark: monitoring_webhook_url is set, but this host's prometheus-alertmanager is "
        "0.25, which shows a webhook's URL (and its token) to every local user through its API "
        "before 0.26; leave monitoring_webhook_url empty here (alerts stay in Alertmanager's UI), "
        "or use a host whose Alertmanager is 0.26 or later (Ubuntu 24.04's)")
    assert webhook_problem(NOBLE, "spark") == ""
    assert "apt knows no prometheus-alertmanager here" in webhook_problem("", "spark")


def test_a_bad_webhook_url_is_refused_without_showing_it() -> None:
    secret = "https://hooks.example/T0KEN-123 x"
    line = preflight_line(ROLE, "preflight.yml", monitoring_webhook_url=secret)
    assert line.startswith("spark: monitoring_webhook_url is not an http(s) URL") and \
        "T0KEN" not in line
