"""The monitoring role's shipped files (issue 26), checked without a host: every rule file passes
`promtool check rules` and the shipped `promtool test rules` file passes (and fails when any alert
is taken out), every PromQL query of the dashboards and rules parses, the dashboards carry what
Grafana needs and name the provisioned datasource, the provisioning files have Grafana's shape, the
textfile script writes what the node exporter reads, the port preflight tells the meant service from
another process, and the docs list the same unfed panels as the sim test's helper."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import monitoring

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "monitoring"
GRAFANA = REPO / "roles" / "grafana_dashboards"
FILES = ROLE / "files"
TEST_FILE = FILES / "sparkspec-rules.test.yml"
SCRIPT = FILES / "sparkspec-monitoring-textfile"
sys.path.insert(0, str(REPO / "roles" / "sparkspec" / "filter_plugins"))
from sparkspec_ports import port_conflicts  # noqa: E402


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is missing: install it with `apt-get install -y prometheus` "
                    "(Debian's package ships it; scripts/bootstrap installs it)")
    return found


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def render(template: Path, context: dict[str, Any]) -> str:
    """A role template rendered with jinja2 and Ansible's two filters it uses (comment, to_json)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["comment"] = lambda text: "\n".join(f"# {line}" for line in str(text).splitlines())
    env.filters["to_json"] = json.dumps
    return env.from_string(template.read_text()).render({"ansible_managed": "Ansible managed",
                                                         **context})


def defaults(role: Path) -> dict[str, Any]:
    return {**yaml.safe_load((role / "defaults" / "main.yml").read_text()),
            **{k: v for k, v in yaml.safe_load((role / "vars" / "main.yml").read_text()).items()
               if "{{" not in str(v)}}


def thresholds_file(tmp_path: Path, floor_percent: float = 10) -> Path:
    out = tmp_path / "sparkspec-thresholds.rules.yml"
    out.write_text(render(ROLE / "templates" / "sparkspec-thresholds.rules.yml.j2",
                          {**defaults(ROLE), "_monitoring_floor_percent": floor_percent}))
    return out


# --- rules ----------------------------------------------------------------------------------------

def test_rule_files_pass_promtool_check_rules(tmp_path: Path) -> None:
    files = [*map(str, monitoring.RULE_FILES), str(thresholds_file(tmp_path))]
    result = run_promtool("check", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == 3


def test_thresholds_follow_the_variables(tmp_path: Path) -> None:
    rules = {r["record"]: r["expr"]
             for r in yaml.safe_load(thresholds_file(tmp_path, 12.5).read_text())
             ["groups"][0]["rules"]}
    assert rules["sparkspec:acceptance_floor:ratio"] == "vector(0.125)"
    assert rules["sparkspec:memory_available_floor:bytes"] == f"vector({8 * 2**30})"
    assert rules["sparkspec:disk_used_ceiling:ratio"] == "vector(0.9)"
    assert rules["sparkspec:journal_ceiling:bytes"] == f"vector({int(3.5 * 2**30)})"


def test_shipped_rule_tests_pass() -> None:
    result = run_promtool("test", "rules", TEST_FILE.name, cwd=FILES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def alert_names() -> list[str]:
    return [r["alert"] for g in monitoring.rule_groups() for r in g["rules"] if "alert" in r]


def test_every_alert_is_tested() -> None:
    tested = {t["alertname"] for case in yaml.safe_load(TEST_FILE.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert set(alert_names()) == tested
    assert {"SparkspecEngineStalled", "SparkspecAcceptanceCollapsed", "SparkspecMemoryLow",
            "SparkspecDiskNearlyFull", "SparkspecJournalNearlyFull"} <= tested


@pytest.mark.parametrize("alert", alert_names())
def test_rule_tests_fail_without_the_alert(tmp_path: Path, alert: str) -> None:
    """The shipped tests catch a missing alert: the same tests on the rules without it fail."""
    shutil.copy(FILES / "sparkspec-recording.rules.yml", tmp_path)
    shutil.copy(TEST_FILE, tmp_path)
    rules = yaml.safe_load((FILES / "sparkspec-alerts.rules.yml").read_text())
    for group in rules["groups"]:
        group["rules"] = [r for r in group["rules"] if r.get("alert") != alert]
    (tmp_path / "sparkspec-alerts.rules.yml").write_text(yaml.safe_dump(rules))
    result = run_promtool("test", "rules", TEST_FILE.name, cwd=tmp_path)
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr


def check_exprs(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess[str]:
    """promtool's parser on each expression, written as a recording rule (promtool 2.42 parses no
    bare query)."""
    rules = {"groups": [{"name": "parse", "rules": [{"record": f"parse:expr{i}", "expr": e}
                                                    for i, e in enumerate(exprs)]}]}
    path = tmp_path / "parse.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return run_promtool("check", "rules", str(path))


def test_every_promql_expr_parses(tmp_path: Path) -> None:
    exprs = [e for _, e in monitoring.panel_exprs()] + list(monitoring.recording_rules().values()) \
        + [r["expr"] for g in monitoring.rule_groups() for r in g["rules"] if "alert" in r]
    assert len(exprs) > 40
    result = check_exprs(tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_expr_is_caught(tmp_path: Path) -> None:
    result = check_exprs(tmp_path, ["sum by (model_name) (rate(vllm:generation_tokens_total[1m])"])
    assert result.returncode != 0


def test_recording_rules_cover_the_issue() -> None:
    records = monitoring.recording_rules()
    for name in ("sparkspec:generation_tokens:rate1m", "sparkspec:prompt_tokens:rate1m",
                 "sparkspec:ttft_seconds:p50_5m", "sparkspec:ttft_seconds:p95_5m",
                 "sparkspec:spec_decode_acceptance_rate:rate5m",
                 "sparkspec:spec_decode_acceptance_length:rate5m",
                 "sparkspec:spec_decode_acceptance_by_position:rate5m",
                 "sparkspec:kv_cache_usage:ratio", "sparkspec:memory_available:bytes"):
        assert name in records
    per_position = records["sparkspec:spec_decode_acceptance_by_position:rate5m"]
    assert "by (instance, model_name, position)" in per_position


# --- dashboards and provisioning ------------------------------------------------------------------

def datasource(tmp_path: Path) -> dict[str, Any]:
    text = render(GRAFANA / "templates" / "datasource.yaml.j2", defaults(GRAFANA))
    return dict(yaml.safe_load(text))


def test_dashboards_have_what_grafana_needs(tmp_path: Path) -> None:
    uid = datasource(tmp_path)["datasources"][0]["uid"]
    boards = monitoring.dashboards()
    shipped = yaml.safe_load((GRAFANA / "vars" / "main.yml")
                             .read_text())["_grafana_dashboards_files"]
    assert sorted(boards) == sorted(shipped)
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36, name
        assert board["title"] and board["uid"] and board["panels"], name
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for panel in board["panels"]:
            where = f"{name}: {panel['title']}"
            assert panel["type"] in ("timeseries", "stat", "gauge", "bargauge", "table"), where
            assert set(panel["gridPos"]) == {"h", "w", "x", "y"}, where
            assert panel["datasource"] == {"type": "prometheus", "uid": uid}, where
            assert panel["targets"], where
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), where
            for target in panel["targets"]:
                assert target["expr"].strip(), where
                assert target["datasource"]["uid"] == uid, where
                assert "$" not in target["expr"], \
                    f"{where}: a Grafana variable Prometheus cannot evaluate"


def test_panel_titles_are_unique() -> None:
    titles = [p["title"] for b in monitoring.dashboards().values() for p in b["panels"]]
    assert len(titles) == len(set(titles))


def test_panels_read_recorded_series() -> None:
    """Every sparkspec:* series a panel reads is recorded by a shipped rule or by the thresholds
    template."""
    recorded = set(monitoring.recording_rules())
    recorded |= set(re.findall(r"record: (\S+)",
                               (ROLE / "templates" / "sparkspec-thresholds.rules.yml.j2")
                               .read_text()))
    used = {name for _, e in monitoring.panel_exprs()
            for name in re.findall(r"sparkspec:[a-z0-9_:]+", e)}
    assert used and used <= recorded, used - recorded


def test_spec_decode_and_node_panels_are_there() -> None:
    titles = {t for t, _ in monitoring.panel_exprs()}
    for title in ("Draft acceptance rate", "Mean acceptance length", "Acceptance by draft position",
                  "Drafts/s", "Memory available", "GPU temperature", "GPU power",
                  "GPU utilization"):
        assert title in titles


def test_provisioning_files_have_grafanas_shape(tmp_path: Path) -> None:
    ds = datasource(tmp_path)
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"] == "http://127.0.0.1:9090"
    context = defaults(GRAFANA)
    boards = yaml.safe_load(render(GRAFANA / "templates" / "dashboards.yaml.j2", context))
    assert boards["apiVersion"] == 1
    (provider,) = boards["providers"]
    assert provider["type"] == "file"
    assert provider["folder"] == context["grafana_dashboards_folder"]
    assert provider["options"]["path"] == context["grafana_dashboards_dir"]


def test_unfed_panels_are_the_documented_list() -> None:
    text = (REPO / "docs" / "monitoring.md").read_text()
    block = re.search(r"<!-- unfed panels.*?-->\n(.*?)<!-- end unfed panels -->", text, re.S)
    assert block is not None
    documented = re.findall(r"^- (.+)$", block.group(1), re.M)
    assert documented == list(monitoring.UNFED_PANELS)
    assert set(documented) <= {t for t, _ in monitoring.panel_exprs()}


# --- the textfile script --------------------------------------------------------------------------

def run_script(tmp_path: Path, smi_output: str | None) -> dict[str, float]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "awk", "mktemp", "du", "cut", "chmod", "mv", "rm", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
    if smi_output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'OUT'\n{smi_output}OUT\n")
        smi.chmod(0o755)
    out = tmp_path / "textfile"
    out.mkdir()
    subprocess.run([str(SCRIPT), str(out)], env={**os.environ, "PATH": str(bin_dir)},
                   check=True, timeout=60)
    assert [p.name for p in out.iterdir()] == ["sparkspec.prom"]   # no temporary file left behind
    assert (out / "sparkspec.prom").stat().st_mode & 0o777 == 0o644
    return {f"{s.name}{s.labels}": s.value
            for fam in text_string_to_metric_families((out / "sparkspec.prom").read_text())
            for s in fam.samples}


def test_textfile_script_skips_what_the_gpu_does_not_report(tmp_path: Path) -> None:
    # GB10: memory N/A
    smi = "0, 47, 31.25, 12, [N/A], [N/A]\n1, [N/A], Not Supported, 88, 1024, 2048\n"
    samples = run_script(tmp_path, smi)
    gpu = {k: v for k, v in samples.items() if k.startswith("sparkspec_gpu")}
    assert gpu == {
        "sparkspec_gpu_temperature_celsius{'gpu': '0'}": 47.0,
        "sparkspec_gpu_power_watts{'gpu': '0'}": 31.25,
        "sparkspec_gpu_utilization_ratio{'gpu': '0'}": 0.12,
        "sparkspec_gpu_utilization_ratio{'gpu': '1'}": 0.88,
        "sparkspec_gpu_memory_used_bytes{'gpu': '1'}": 1024 * 2**20,
        "sparkspec_gpu_memory_total_bytes{'gpu': '1'}": 2048 * 2**20,
    }
    assert "sparkspec_journal_disk_bytes{}" in samples


def test_textfile_script_without_nvidia_smi_writes_no_gpu_line(tmp_path: Path) -> None:
    samples = run_script(tmp_path, None)
    assert list(samples) == ["sparkspec_journal_disk_bytes{}"]
    assert samples["sparkspec_journal_disk_bytes{}"] >= 0


def test_textfile_script_refuses_a_folder_that_is_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    proc = subprocess.run([str(SCRIPT), str(tmp_path / "link")], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 1 and "is not a folder (a link is refused" in proc.stderr
    assert list(real.iterdir()) == []


# --- the port preflight ---------------------------------------------------------------------------

PORTS: list[dict[str, Any]] = [
    {"port": 9090, "var": "monitoring_prometheus_port", "unit": "prometheus.service"},
    {"port": "9100", "var": "monitoring_node_exporter_port",
     "unit": "prometheus-node-exporter.service"},
]
# seen in the simulated Spark (ss -Hltnpe): ss names no process for the node exporter, its
# cgroup does
SS_OURS = [
    'LISTEN 0 4096 127.0.0.1:9100 0.0.0.0:* uid:102 ino:2201585 sk:35 '
    'cgroup:/libpod_parent/libpod-17d1/system.slice/prometheus-node-exporter.service <->',
    'LISTEN 0 4096 127.0.0.1:9090 0.0.0.0:* users:(("prometheus",pid=1690,fd=7)) '
    'uid:102 ino:2203054 sk:37 '
    'cgroup:/libpod_parent/libpod-17d1/system.slice/prometheus.service <->',
]
PS = ["   1690 prometheus.service", "   4242 ssh.service"]


def test_the_meant_service_may_hold_its_port() -> None:
    assert port_conflicts(SS_OURS, PS, PORTS) == []
    assert port_conflicts([], PS, PORTS) == []


def test_another_process_on_a_port_is_one_line_naming_port_and_variable() -> None:
    ss = ['LISTEN 0 5 127.0.0.1:9090 0.0.0.0:* users:(("python3",pid=4242,fd=3))']
    (line,) = port_conflicts(ss, PS, PORTS)
    assert line.startswith("port 9090 (monitoring_prometheus_port) is already in use by "
                           "python3 (pid 4242, unit ssh.service), not prometheus.service")
    assert "set monitoring_prometheus_port to a free port" in line and "\n" not in line


def test_a_socket_of_another_namespace_is_refused() -> None:
    ss = ["LISTEN 0 5 [::]:9100 [::]:*",
          "LISTEN 0 5 0.0.0.0:9100 0.0.0.0:* cgroup:/user.slice/x.scope"]
    (line,) = port_conflicts(ss, [], PORTS)
    assert "port 9100 (monitoring_node_exporter_port)" in line
    assert "outside this host's view" in line and "unit x.scope" in line


@pytest.mark.parametrize("cgroup", [
    # a user's own unit of the same name: `systemd-run --user --unit=prometheus`
    "/user.slice/user-1000.slice/user@1000.service/app.slice/prometheus.service",
    # a slice named system.slice under the user's manager, or under another service's
    # delegated subtree
    "/user.slice/user-1000.slice/user@1000.service/system.slice/prometheus.service",
    "/system.slice/podman.service/system.slice/prometheus.service",
    "/user.slice/system.slice/prometheus.service",
])
def test_a_user_unit_named_like_the_service_is_refused(cgroup: str) -> None:
    ss = ['LISTEN 0 5 127.0.0.1:9090 0.0.0.0:* users:(("prometheus",pid=5150,fd=3)) '
          f'cgroup:{cgroup}']
    (line,) = port_conflicts(ss, [], PORTS)
    assert line.startswith("port 9090 (monitoring_prometheus_port) is already in use by "
                           f"prometheus (pid 5150, unit prometheus.service (cgroup {cgroup})), "
                           "not prometheus.service")
    assert "\n" not in line


def test_only_the_system_slice_unit_is_the_service() -> None:
    for cgroup in ("/system.slice/prometheus.service",
                   "/machine.slice/libpod-9f.scope/system.slice/prometheus.service"):
        ss = [f'LISTEN 0 5 127.0.0.1:9090 0.0.0.0:* cgroup:{cgroup}']
        assert port_conflicts(ss, [], PORTS) == []
    ss = ["LISTEN 0 5 127.0.0.1:9090 0.0.0.0:* cgroup:/system.slice/prometheus.service/extra"]
    # not a unit's own cgroup, and no process to ask ps about
    (line,) = port_conflicts(ss, [], PORTS)
    assert "outside this host's view" in line


# --- the variable preflights (rendered with Ansible's Templar, as the assert tasks do) ------------

_PLUGINS: list[bool] = []


def _trusted(value: Any) -> Any:
    from ansible.template import trust_as_template

    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: _trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_trusted(v) for v in value]
    return value


def preflight_line(role: Path, tasks: str, **values: Any) -> str:
    """The role's variable-check assert rendered for its defaults and ``values`` (as an inventory
    gives them): '' when it passes, else its one-line fail_msg."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import init_plugin_loader
    from ansible.template import Templar, trust_as_template

    if not _PLUGINS:
        from ansible.plugins.loader import filter_loader
        init_plugin_loader()
        # the contract's filters
        filter_loader.add_directory(str(REPO / "roles" / "sparkspec" / "filter_plugins"))
        _PLUGINS.append(True)
    loader = DataLoader()
    task = next(t for t in _trusted(loader.load_from_file(str(role / "tasks" / tasks)))
                if "ansible.builtin.assert" in t and "_problems" in t.get("vars", {}))
    variables = {**_trusted(loader.load_from_file(str(role / "defaults" / "main.yml"))),
                 **_trusted(loader.load_from_file(str(role / "vars" / "main.yml"))), **task["vars"],
                 "sparkspec_port": 8000, "sparkspec_bind_address": "127.0.0.1",
                 "sparkspec_resolved": {}, "inventory_hostname": "spark", **values}
    templar = Templar(loader=loader, variables=variables)
    check = task["ansible.builtin.assert"]
    if templar.template(trust_as_template("{{ " + check["that"] + " }}")):
        return ""
    line = str(templar.template(check["fail_msg"]))
    assert "\n" not in line
    return line


MONITORING_BAD = [
    ("monitoring_listen_address", "127.0.0.1\n"), ("monitoring_listen_address", "127.0.0.1 --x"),
    ("monitoring_listen_address", "127.0.0.1:9090"), ("monitoring_listen_address", "1.2.3"),
    ("monitoring_listen_address", "fe80::1%eth0"), ("monitoring_listen_address", "-host"),
    ("monitoring_listen_address", ""), ("monitoring_listen_address", 127),
    ("monitoring_textfile_dir", "/x\n"), ("monitoring_textfile_dir", "/x y"),
    ("monitoring_textfile_dir", "/x'y"), ("monitoring_textfile_dir", "/x%i"),
    ("monitoring_textfile_dir", "/$x"),
    ("monitoring_retention", "15d\n"), ("monitoring_retention", "0d"),
    ("monitoring_retention", "15"), ("monitoring_retention", "1m1h"),
    ("monitoring_retention", "99999999999999999999y"), ("monitoring_retention", "100y"),
    ("monitoring_scrape_interval", "15s\n"), ("monitoring_textfile_interval", "30s\n"),
    ("monitoring_memory_low_gib", "8\n"), ("monitoring_disk_used_percent", "90\n"),
    ("monitoring_journal_gib", "3.5\n"), ("monitoring_acceptance_floor_percent", "10\n"),
    ("monitoring_webhook_url", "http://x\n"), ("monitoring_prometheus_port", "9091\n"),
    ("monitoring_prometheus_port", 65536), ("monitoring_prometheus_port", "09091"),
]


@pytest.mark.parametrize(("var", "value"), MONITORING_BAD)
def test_monitoring_preflight_refuses_a_newline_or_a_stray_character(var: str, value: str) -> None:
    line = preflight_line(ROLE, "preflight.yml", **{var: value})
    assert line.startswith(f"spark: {var} "), line


@pytest.mark.parametrize(("var", "value"), [
    ("monitoring_listen_address", "::1"), ("monitoring_listen_address", "0.0.0.0"),
    ("monitoring_listen_address", "spark01.lan"), ("monitoring_listen_address", "localhost"),
    ("monitoring_textfile_dir", "/var/lib/node_exporter/text-file.d"),
    ("monitoring_retention", "1y2w"), ("monitoring_retention", "1h30m"),
    ("monitoring_scrape_interval", "500ms"), ("monitoring_memory_low_gib", 8),
    ("monitoring_prometheus_port", 65535), ("monitoring_prometheus_port", "1"),
    ("monitoring_webhook_url", "https://hooks.example/x?y=1"),
])
def test_monitoring_preflight_takes_good_values(var: str, value: Any) -> None:
    assert preflight_line(ROLE, "preflight.yml") == ""
    assert preflight_line(ROLE, "preflight.yml", **{var: value}) == ""


@pytest.mark.parametrize(("var", "value"), [
    ("grafana_dashboards_dir", "/var/lib/grafana/x\n"), ("grafana_dashboards_dir", "/x y"),
    ("grafana_dashboards_dir", "relative/x"), ("grafana_dashboards_dir", "/x'%$"),
    ("grafana_dashboards_config_dir", "/etc/grafana\n"),
    ("grafana_dashboards_provisioning_dir", "/p\n"), ("grafana_dashboards_folder", "sparkspec\n"),
    ("grafana_dashboards_folder", "a\n# b: c"),
    ("grafana_dashboards_folder", 'x"y'), ("grafana_dashboards_folder", " x"),
    ("grafana_dashboards_prometheus_url", "http://127.0.0.1:9090\n"),
    ("grafana_dashboards_prometheus_url", "http://x/'y"),
    ("grafana_dashboards_service", "grafana-server\n"),
])
def test_grafana_preflight_refuses_bad_values_naming_the_variable(var: str, value: str) -> None:
    assert preflight_line(GRAFANA, "main.yml") == ""
    assert preflight_line(GRAFANA, "main.yml", **{var: value}).startswith(f"spark: {var} ")


def test_yaml_templates_put_no_value_in_a_comment() -> None:
    """A value in a comment line ends the comment at its first newline; values go in YAML as
    to_json."""
    for template in [*ROLE.glob("templates/*.y*ml.j2"), *GRAFANA.glob("templates/*.y*ml.j2")]:
        for line in template.read_text().splitlines():
            if line.lstrip().startswith("#"):
                assert "{{" not in line and "{%" not in line, f"{template.name}: {line}"


def test_provisioning_files_quote_hostile_values(tmp_path: Path) -> None:
    context = {**defaults(GRAFANA), "grafana_dashboards_folder": "a\n# b: c",
               "grafana_dashboards_dir": "/x\nfoo: bar"}
    boards = yaml.safe_load(render(GRAFANA / "templates" / "dashboards.yaml.j2", context))
    (provider,) = boards["providers"]
    assert provider["folder"] == "a\n# b: c" and provider["options"]["path"] == "/x\nfoo: bar"
    assert set(boards) == {"apiVersion", "providers"}
