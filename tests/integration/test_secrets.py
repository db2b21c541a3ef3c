"""Secrets on the simulated Spark: the vLLM API key, the hub token and pip's index credentials never
reach a command line, a log, the journal, a report or a file other than the few 0600/0640 files
meant to hold them; teardown removes the key and token files. In file order, on the one provision.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, PROVISION_OUTPUT, ROOT, run_cli

pytestmark = [pytest.mark.sim, pytest.mark.slow]

PROBE = "/root/secret-probe"
HOME = "/opt/sparkspec"
ENV_FILE = "/etc/sparkspec/sparkspec-vllm.env"
NEEDLE_FIGURES = ("/var/lib/sparkspec-monitoring/textfile/"     # verify's, for Prometheus
                  "sparkspec-needle.sparkspec-vllm+baseline.prom")
# Where each secret may be, and how that file must be protected: (mode, owner, group).
ALLOWED = {
    ENV_FILE: ({"api_key"}, ("0o640", "root", "sparkspec")),
    f"{HOME}/staged{ENV_FILE}": ({"api_key"}, ("0o640", "root", "sparkspec")),
    f"{HOME}/previous{ENV_FILE}": ({"api_key"}, ("0o640", "root", "sparkspec")),
    f"{HOME}/api-key": ({"api_key"}, ("0o600", "sparkspec", "sparkspec")),
    f"{HOME}/hf-token": ({"hub_token"}, ("0o600", "sparkspec", "sparkspec")),
    f"{HOME}/pip.conf": ({"pip_secret"}, ("0o600", "root", "root")),
    # the watchdog's probe (deploy_watchdog) and Prometheus's scrape of vLLM (the monitoring role)
    "/etc/sparkspec/sparkspec-vllm-watchdog.key": ({"api_key"}, ("0o600", "root", "root")),
    "/etc/prometheus/sparkspec-vllm.key": ({"api_key"}, ("0o400", "prometheus", "prometheus")),
}
# Folders the scan skips: installed software and model weights (no secret is written there by
# anything that runs with one) and the probe's own folder.
SKIP = [f"{HOME}/venvs", f"{HOME}/models", "/var/cache/apt", "/var/lib/apt", "/var/lib/dpkg"]
# Commands run while the process lists are sampled; their output is checked afterwards too.
RUNS: list[str] = []


def _ssh(sim, command: str, data: bytes = b"", timeout: float = 600) -> str:
    proc = subprocess.run(sim.ssh_argv(command), input=data, capture_output=True, timeout=timeout,
                          check=False)
    assert proc.returncode == 0, f"{command}: {proc.stderr.decode()}"
    return proc.stdout.decode()


@pytest.fixture(scope="module")
def known(provisioned, api_key):
    """The secrets to look for: the simulated Spark's API key and hub token, a pip option made up
    here, and a probe string that a control process carries in its command line (proof that the
    sampler sees argv)."""
    token_file = provisioned.state / "hub-token"
    assert token_file.is_file(), (f"{token_file}: the simulated hub's token is missing; "
                                  "run `invoke sim.up`")
    values = {"api_key": api_key, "hub_token": token_file.read_text().strip(),
              "pip_secret": "pipsecret" + secrets.token_hex(12),
              "probe": "probe" + secrets.token_hex(12)}
    assert all(values.values())
    lines = "".join(f"{label} {value}\n" for label, value in values.items())
    _ssh(provisioned, f"umask 077 && rm -rf {PROBE} && mkdir -p {PROBE} && cat > {PROBE}/needles",
         lines.encode())
    probe = Path(__file__).with_name("secret_probe.py").read_bytes()
    _ssh(provisioned, f"cat > {PROBE}/secret_probe.py", probe)
    yield values
    _ssh(provisioned, f"rm -rf {PROBE}")


def _play(playbook: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01",
                     f"playbooks/{playbook}", *args, timeout=1500)
    RUNS.append(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    return result


def test_no_secret_in_any_command_line(provisioned, known, tmp_path):
    """Every /proc/*/cmdline of the Spark, sampled every 0.2 s while the tools are installed with an
    index credential (a --check --diff run first), the checkpoints are fetched with the hub token
    and verify benchmarks with the API key."""
    pip_env = yaml.safe_load(
        (ROOT / "inventories/sim/group_vars/all.yml").read_text())["_sim_pip_env"]
    # a file: the secret stays off the controller's command line too
    extra = tmp_path / "secret-vars.json"
    extra.touch(mode=0o600)
    extra.write_text(json.dumps({"sparkspec_pip_env": {**pip_env,
                                                       "PIP_TRUSTED_HOST": known["pip_secret"]}}))
    sampler = subprocess.Popen(provisioned.ssh_argv(
        f"python3 {PROBE}/secret_probe.py sample {PROBE}/needles {PROBE}/stop 3000"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2)
        # control: a process whose command line holds the probe string for two seconds
        _ssh(provisioned, f"sh -c 'sleep 2' control {known['probe']}")
        # a dry run with --diff first: pip.conf would change, and its diff must not show the secret
        _play("provision.yml", "--check", "--diff", "--tags", "tools,fetch", "-e", f"@{extra}")
        _play("provision.yml", "--tags", "tools,fetch", "-e", f"@{extra}")
        _play("verify.yml")
    finally:
        _ssh(provisioned, f"touch {PROBE}/stop")
        out, err = sampler.communicate(timeout=120)
    assert sampler.returncode == 0, err
    sample = json.loads(out)
    assert sample["passes"] >= 50 and sample["processes"] >= 20, sample
    assert sample["hits"].get("probe"), f"the sampler did not see the control process: {sample}"
    leaks = {label: cmdlines[:3] for label, cmdlines in sample["hits"].items() if label != "probe"}
    assert leaks == {}, f"secrets in command lines: {leaks}"


def test_no_secret_in_logs_reports_or_other_files(provisioned, known):
    """After the shared provision and the runs above: the controller's output and reports, and
    every file of the Spark outside the software and the weights, hold no secret except the
    protected files meant to."""
    assert PROVISION_OUTPUT and RUNS, "the provision and the sampled runs must have run first"
    secret_values = {label: value for label, value in known.items() if label != "probe"}
    texts = {"provision output": "\n".join(PROVISION_OUTPUT),
             "sampled runs' output": "\n".join(RUNS)}
    for path in (ROOT / "reports").rglob("*"):
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode(errors="replace")
    leaked = {(where, label) for where, text in texts.items()
              for label, value in secret_values.items() if value in text}
    assert leaked == set(), f"secrets on the controller: {sorted(leaked)}"

    skips = " ".join(f"--skip {d}" for d in SKIP)
    found = json.loads(_ssh(provisioned, f"python3 {PROBE}/secret_probe.py scan {PROBE}/needles "
                                         f"/etc /var /root /tmp /home /run {HOME} {skips}",
                            timeout=900))
    assert found["journal_bytes"] > 10_000, "the journal is empty: nothing was checked"
    assert found["journal"] == {}, f"secrets in the journal: {found['journal']}"
    files = {f["path"]: f for f in found["files"]}
    unexpected = {p: f["labels"] for p, f in files.items() if p not in ALLOWED
                  or not set(f["labels"]) <= ALLOWED[p][0]}
    assert unexpected == {}, f"secrets in files not meant to hold them: {unexpected}"
    for path, f in files.items():
        assert (f["mode"], f["owner"], f["group"]) == ALLOWED[path][1], f
    # The scan finds what is there: each secret is in the file meant to hold it.
    for path, label in [(ENV_FILE, "api_key"), (f"{HOME}/api-key", "api_key"),
                        (f"{HOME}/hf-token", "hub_token"), (f"{HOME}/pip.conf", "pip_secret")]:
        assert label in files.get(path, {}).get("labels", []), \
            f"{path} lacks the {label}: {found['files']}"


def _exists(sim, path: str) -> bool:
    return _ssh(sim, f"test -e {path} && echo yes || echo no").strip() == "yes"


def test_teardown_removes_the_key_and_token_files(provisioned, known):
    assert _exists(provisioned, f"{HOME}/api-key") and _exists(provisioned, f"{HOME}/hf-token")
    # baseline's needle figures from the last verify (provision's, at the latest)
    assert _exists(provisioned, NEEDLE_FIGURES)
    kept = run_cli(f"{BIN}/invoke", "teardown", "--host", "sim01", "--keep-token", timeout=600)
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr
    assert not _exists(provisioned, f"{HOME}/api-key") and not _exists(provisioned, ENV_FILE)
    assert not _exists(provisioned, NEEDLE_FIGURES)
    assert _exists(provisioned, f"{HOME}/hf-token"), "--keep-token removed the token"
    gone = run_cli(f"{BIN}/invoke", "teardown", "--host", "sim01", timeout=600)
    assert gone.returncode == 0, gone.stdout[-3000:] + gone.stderr
    assert not _exists(provisioned, f"{HOME}/hf-token")
    assert not _exists(provisioned, f"{HOME}/pip.conf")
    for output in (kept.stdout, gone.stdout):
        assert not any(value in output for label, value in known.items() if label != "probe")
    # leave the Spark serving for whatever runs next
    back = run_cli(f"{BIN}/invoke", "deploy", "--host", "sim01", "--method", "baseline",
                   timeout=1500)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr
    assert _exists(provisioned, f"{HOME}/api-key")
