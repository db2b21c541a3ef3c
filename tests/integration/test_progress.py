"""Progress in the play: `sparkspec fetch repo` through the `sparkspec_progress` action plugin
against a throttled local hub (24 MiB at 2 MiB/s), and vllm_build's compile step, read back from
ansible-runner's events. No simulated Spark."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ansible_runner
import pytest

from sparkspec.hub.dest import HF_DOWNLOADS, REVISION_FILE, state
from sparkspec.hub.server import HubServer
from tests.support.hubpublish import publish
from tests.support.throttle import ThrottleProxy

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
REPO = "sparkspec/progress-test"
RATE = 2 << 20  # bytes/s through the proxy
# huggingface_hub counts a download in chunks of 10 MiB (DOWNLOAD_CHUNK_SIZE): one file of 24 MiB
# moves the count at about 5, 10 and 12 s, so lines one second apart must see it grow (at 4 MiB/s,
# 2.5 s to the first move, a loaded CI machine printed only two lines before it, both at 23 B)
SIZE = 24 << 20
TASK = "Fetch through the throttled hub"
PLAYBOOK = f"""\
- name: Fetch with progress
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: {TASK}
      sparkspec_progress:
        argv: "{{{{ fetch_argv }}}}"
        interval: 1
        timeout: 300
      register: fetched
      changed_when: {{changed_when}}
"""
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The throttled hub's URL and the published folder (a config and SIZE random bytes)."""
    base = tmp_path_factory.mktemp("hub")
    source = base / "source"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "none"}\n')
    (source / "weights.bin").write_bytes(os.urandom(SIZE))
    publish(base / "root", REPO, source)
    with HubServer(base / "root") as server, ThrottleProxy(_address(server.url), RATE) as proxy:
        yield proxy.url, source


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _run(tmp_path: Path, playbook: str,
         extravars: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """``playbook`` on localhost through ansible-runner with the sparkspec role's plugins; its
    events."""
    events: list[dict[str, Any]] = []
    (tmp_path / "play.yml").write_text(playbook)
    (tmp_path / "runner").mkdir()
    runner = ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"), playbook=str(tmp_path / "play.yml"),
        inventory="localhost,",
        extravars={"ansible_python_interpreter": sys.executable, **extravars},
        envvars={"ANSIBLE_ACTION_PLUGINS": str(ROOT / "roles/sparkspec/action_plugins"),
                 "ANSIBLE_LIBRARY": str(ROOT / "roles/sparkspec/library"), "ANSIBLE_NOCOLOR": "1",
                 "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
                 "HF_HOME": str(tmp_path / "hf"),
                 "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"},
        event_handler=lambda event: bool(events.append(event)), quiet=True, suppress_env_files=True,
        timeout=600)
    return runner, events


def play(tmp_path: Path, argv: list[str], changed_when: str = "(fetched.stdout_lines | last | "
                                                              "from_json).changed"
         ) -> tuple[Any, list[dict[str, Any]]]:
    return _run(tmp_path, PLAYBOOK.replace("{changed_when}", changed_when), {"fetch_argv": argv})


def fetch_argv(repo: str, url: str, dest: Path) -> list[str]:
    return [str(VENV_BIN / "sparkspec"), "fetch", "repo", repo, "--revision", "main",
            "--dest", str(dest), "--endpoint", url, "--json"]


def progress_lines(events: list[dict[str, Any]]) -> list[str]:
    """What the plugin printed during the task (the runner's verbose events carry the task they
    belong to)."""
    return [line for e in events if e.get("event") == "verbose" and (e.get("event_data")
                                                                     or {}).get("task") == TASK
            for line in str(e.get("stdout", "")).splitlines() if line.startswith("localhost: ")]


def test_throttled_fetch_prints_growing_progress_and_completes(tmp_path: Path,
                                                               hub: tuple[str, Path]) -> None:
    url, source = hub
    dest = tmp_path / "dest"
    runner, events = play(tmp_path, fetch_argv(REPO, url, dest))
    assert runner.rc == 0, [e.get("stdout") for e in events]
    lines = progress_lines(events)
    counted = [line for line in lines if " of 24.0 MiB, " in line]  # once the plan has the total
    assert len(counted) >= 2, lines
    done = []
    for line in counted:
        m = re.fullmatch(rf"localhost: fetch {REPO}: ([\d.]+) (\w+) of 24\.0 MiB, [\d.]+ \w+/s, "
                         r"((?:\d+ s|\d+ min|\d+ h \d\d min) left|time left unknown)", line)
        assert m, line
        done.append(float(m[1]) * UNITS[m[2]])
    assert done == sorted(done) and done[-1] > done[0], counted
    ok = next(e for e in events if e.get("event") == "runner_on_ok")["event_data"]["res"]
    assert ok["changed"] is True and ok["rc"] == 0 and "ansible_job_id" not in ok
    for f in source.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name


def test_failing_fetch_fails_the_task_with_the_commands_one_line(tmp_path: Path,
                                                                 hub: tuple[str, Path]) -> None:
    url, _ = hub
    runner, events = play(tmp_path, fetch_argv("sparkspec/no-such-repo", url, tmp_path / "dest"))
    assert runner.rc != 0
    failed = [e["event_data"]["res"] for e in events if e.get("event") == "runner_on_failed"]
    assert (len(failed) == 1 and failed[0]["rc"] == 2
            and failed[0]["msg"] == "non-zero return code"), failed
    stderr = failed[0]["stderr"].splitlines()
    assert (len(stderr) == 1 and stderr[0].startswith("sparkspec: error: ")
            and "no-such-repo" in stderr[0]), stderr


# A compile of 8 ninja steps, one a second, among the other lines pip and CMake print.
COMPILE = """\
import sys, time
print("Building wheel for vllm (pyproject.toml): started", flush=True)
for i in range(1, 9):
    print(f"[{i}/8] Building CUDA object CMakeFiles/_C.dir/csrc/k{i}.cu.o", flush=True)
    print("  nvcc warning : a line between the steps", flush=True)
    time.sleep(1.0)
print("Successfully built vllm", flush=True)
"""


def test_vllm_build_compile_prints_ninja_progress_in_the_play(tmp_path: Path) -> None:
    """The compile step as roles/vllm_build/tasks/build.yml runs it: the play prints ninja's
    [done/total] while the compile runs, growing; the whole output goes to the build log and the
    task's result ends with its tail."""
    helper = ROOT / "roles/vllm_build/files/vllm_build_helper.py"
    log = tmp_path / "build.log"
    argv = [sys.executable, str(helper), "run", str(log), "build vLLM 0123456789ab",
            sys.executable, "-c", COMPILE]
    runner, events = play(tmp_path, argv, changed_when="true")
    assert runner.rc == 0, [e.get("stdout") for e in events]
    lines = progress_lines(events)
    steps = []
    for line in lines:
        m = re.fullmatch(r"localhost: build vLLM 0123456789ab: \d+ s; ninja (\d)/8", line)
        if m:
            steps.append(int(m[1]))
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0], lines
    ok = next(e for e in events if e.get("event") == "runner_on_ok")["event_data"]["res"]
    assert ok["rc"] == 0 and ok["stdout_lines"][-1] == "Successfully built vllm", ok
    logged = log.read_text().splitlines()
    assert (logged[0].startswith(f"$ {sys.executable} -c ")
            and logged[-1] == "Successfully built vllm")
    assert sum(ln.startswith("[") for ln in logged) == 8


# The download started in one task and followed in a later one, with other work between
# (provision.yml's fetch beside vLLM's install): the start returns at once, the work runs while the
# fetch does, the follow prints progress and returns the command's result; a stop in between ends
# the command (its progress file's token).
SPLIT_PLAYBOOK = """\
- name: Fetch beside other work
  hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - name: Start the fetch
      sparkspec_progress:
        argv: "{{ fetch_argv }}"
        timeout: 300
        start: true
      register: started
    - name: Other work while the fetch runs
      ansible.builtin.command: sleep 2
      changed_when: false
      when: not stop | bool
    # the start returns once Ansible's async wrapper has forked, maybe before the fetch has
    # started: until pkill finds it
    - name: Stop it
      ansible.builtin.command:
        argv: [pkill, -TERM, -f, "{{ started.job.progress | basename | regex_escape }}"]
      register: stopped
      until: stopped.rc == 0
      retries: 50
      delay: 0.1
      changed_when: true
      when: stop | bool
    - name: FOLLOW
      sparkspec_progress:
        job: "{{ job | default(started.job) }}"
        interval: 1
        timeout: 300
      register: fetched
"""


def split_play(tmp_path: Path, argv: list[str], **extra: Any) -> tuple[Any, list[dict[str, Any]]]:
    return _run(tmp_path, SPLIT_PLAYBOOK, {"fetch_argv": argv, "stop": False, **extra})


def test_a_fetch_started_in_one_task_is_followed_in_a_later_one(tmp_path: Path,
                                                                hub: tuple[str, Path]) -> None:
    url, source = hub
    dest = tmp_path / "dest"
    runner, events = split_play(tmp_path, fetch_argv(REPO, url, dest))
    assert runner.rc == 0, [e.get("stdout") for e in events]
    by_task = {e["event_data"]["task"]: e["event_data"]
               for e in events if e.get("event") == "runner_on_ok"}
    started = by_task["Start the fetch"]["res"]
    assert started["changed"] is True and set(started["job"]) == {"jid", "progress"}
    # the start returned while the fetch (about 6 s through the proxy) still ran: the follow still
    # had to wait
    assert by_task["Start the fetch"]["duration"] < 5, by_task["Start the fetch"]["duration"]
    assert by_task["FOLLOW"]["duration"] > 1, by_task["FOLLOW"]["duration"]
    done = by_task["FOLLOW"]["res"]
    assert (done["rc"] == 0 and (done["stdout_lines"][-1]).startswith("{")
            and "ansible_job_id" not in done)
    lines = [line for e in events if e.get("event") == "verbose" and (e.get("event_data")
                                                                      or {}).get("task") == "FOLLOW"
             for line in str(e.get("stdout", "")).splitlines() if line.startswith("localhost: ")]
    assert any(" of 24.0 MiB, " in line for line in lines), lines
    for f in source.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_stopped_fetch_ends_and_the_follow_says_so(tmp_path: Path, hub: tuple[str, Path]) -> None:
    url, source = hub
    runner, events = split_play(tmp_path, fetch_argv(REPO, url, tmp_path / "dest"), stop=True)
    assert runner.rc != 0
    failed = [e["event_data"]["res"] for e in events if e.get("event") == "runner_on_failed"]
    # the fetch's own exit on SIGTERM (130), or the signal's (143) when it lands before Python set
    # its handler
    assert len(failed) == 1 and failed[0]["rc"] in (130, 143, -15), failed
    # stopped before its end: nothing looks complete. huggingface_hub renames a file into place only
    # once whole, so weights.bin is absent or exactly the source's (a loaded machine may finish it
    # before the signal lands); the fetch records no completion and leaves no partial download
    dest = tmp_path / "dest"
    weights = dest / "weights.bin"
    assert not weights.exists() or weights.read_bytes() == (source / "weights.bin").read_bytes()
    assert not state(dest).get("complete") and not (dest / REVISION_FILE).exists(), state(dest)
    assert not list(dest.joinpath(*HF_DOWNLOADS).rglob("*.incomplete"))


def test_a_job_that_was_not_started_here_is_refused(tmp_path: Path, hub: tuple[str, Path]) -> None:
    url, _ = hub
    runner, events = split_play(tmp_path, fetch_argv(REPO, url, tmp_path / "dest"),
                                job={"jid": "../../etc/passwd", "progress": "/tmp/x.json"})
    assert runner.rc != 0
    failed = [e["event_data"]["res"] for e in events if e.get("event") == "runner_on_failed"]
    assert "is not one that sparkspec_progress started (start: true)" in failed[0]["msg"], failed
