"""The deploy's module sparkspec_unit (roles/sparkspec/library), run as Ansible runs a module (a
JSON args file), on real files under a temporary root, with `systemctl` and `systemd-analyze`
stand-ins on PATH that record their calls: staging writes only the staged copy, the live step keeps
the previous version with its owner and mode, installs atomically and restarts only on a change,
check mode writes nothing, and a secret never leaves."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[3] / "roles/sparkspec/library/sparkspec_unit.py"
MODULE_UTILS = MODULE.parents[1] / "module_utils"
SECRET = "sk-unit-test-8c1f0d"


@pytest.fixture()
def host(tmp_path: Path) -> dict[str, Path]:
    """A fake host: live/staged/previous roots and a bin folder whose systemctl logs each call and
    answers is-active/is-enabled from files the test writes."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"
    (bindir / "systemctl").write_text(
        "#!/bin/sh\n"
        f'echo "systemctl $*" >> {calls}\n'
        'case "$1" in\n'
        f'  is-active) cat {tmp_path}/active 2>/dev/null || echo inactive ;;\n'
        f'  is-enabled) cat {tmp_path}/enabled 2>/dev/null || echo disabled ;;\n'
        "esac\n")
    (bindir / "systemd-analyze").write_text(
        "#!/bin/sh\n"
        f'echo "systemd-analyze $*" >> {calls}\n'
        'case "$1" in security) echo "Overall exposure level for x.service: 1.4 OK" ;; esac\n')
    for tool in ("systemctl", "systemd-analyze"):
        (bindir / tool).chmod(0o755)
    return {"root": tmp_path, "bin": bindir, "calls": calls, "live": tmp_path / "live",
            "staged": tmp_path / "staged", "previous": tmp_path / "previous"}


def params(host: dict[str, Path], state: str, unit_text: str = "[Service]\nExecStart=/bin/true\n",
           **extra: object) -> dict[str, object]:
    live = host["live"]
    return {"state": state, "unit": "svc", "staged_root": str(host["staged"]),
            "previous_root": str(host["previous"]),
            "files": [{"path": f"{live}/etc/systemd/system/svc.service", "content": unit_text,
                       "mode": "0644"},
                      {"path": f"{live}/etc/sparkspec/svc.json",
                       "content": '{"method": "ngram"}\n'}],
            "secret_files": [{"path": f"{live}/etc/sparkspec/svc.env", "mode": "0640"}],
            "secret_contents": ["# two lines, as the env template writes\n"
                                f"VLLM_API_KEY={SECRET}\n"],
            **extra}


# Runs the module file as Ansible does, with AnsibleModule.log (the journal or syslog line "Invoked
# with <the arguments>" that every module run writes on the host) printing to stderr instead, so the
# test sees that line; the role's module_utils join ansible.module_utils, as Ansible's payload of
# the module carries them.
LOGGING_RUNNER = """
import runpy, sys
import ansible.module_utils
from ansible.module_utils import basic
ansible.module_utils.__path__.append(sys.argv.pop(1))
basic.AnsibleModule.log = lambda self, msg, log_args=None: print("LOGGED: " + msg, file=sys.stderr)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(host: dict[str, Path], args: dict[str, object], check: bool = False,
        diff: bool = False) -> tuple[dict, str]:
    argfile = host["root"] / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {**args, "_ansible_check_mode": check,
                                                           "_ansible_diff": diff}}))
    argv = [sys.executable, "-c", LOGGING_RUNNER, str(MODULE_UTILS), str(MODULE), str(argfile)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{host['bin']}:{os.environ['PATH']}"})
    assert "LOGGED: Invoked with" in proc.stderr, proc.stderr   # the line the host's journal gets
    return json.loads(proc.stdout), proc.stdout + proc.stderr


def calls(host: dict[str, Path]) -> list[str]:
    return host["calls"].read_text().splitlines() if host["calls"].exists() else []


def test_staged_writes_the_staged_copy_only(host: dict[str, Path]) -> None:
    result, out = run(host, params(host, "staged", analyze=True))
    assert not result.get("failed"), out
    assert result["changed"] and result["differs"] and not result["has_live"]
    unit = host["staged"] / str(host["live"]).lstrip("/") / "etc/systemd/system/svc.service"
    assert unit.read_text().startswith("[Service]")
    assert not host["live"].exists(), \
        "the live unit must be untouched until the staged one passed its checks"
    env = unit.parents[2] / "sparkspec/svc.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o640
    # rated, and verified because it differs
    assert any(c.startswith("systemd-analyze security --offline=true") for c in calls(host))
    assert any(c.startswith("systemd-analyze verify") for c in calls(host))
    assert "1.4" in result["security"]["stdout"]
    assert SECRET not in out, ("the env file's content must never be in the module's result "
                               "or its journal line")
    assert (unit.parents[2] / "sparkspec/svc.env").read_text().endswith(f"VLLM_API_KEY={SECRET}\n")
    # the same again: nothing to write
    again, _ = run(host, params(host, "staged"))
    assert again["changed"] is False and again["differs"] is True


def test_live_installs_keeps_previous_and_restarts_only_on_change(host: dict[str, Path]) -> None:
    first, out = run(host, params(host, "live"))
    assert not first.get("failed"), out
    assert first["restarted"] and first["differs"] and not first["has_live"]
    unit = host["live"] / "etc/systemd/system/svc.service"
    assert unit.read_text() == "[Service]\nExecStart=/bin/true\n"
    assert stat.S_IMODE((host["live"] / "etc/sparkspec/svc.env").stat().st_mode) == 0o640
    assert not host["previous"].exists(), "a first install has no previous version to keep"
    assert calls(host) == ["systemctl daemon-reload", "systemctl is-enabled svc",
                           "systemctl enable svc", "systemctl restart svc"]
    assert SECRET not in out

    host["calls"].unlink()
    (host["root"] / "active").write_text("active\n")
    (host["root"] / "enabled").write_text("enabled\n")
    same, _ = run(host, params(host, "live"))
    assert same["changed"] is False and same["restarted"] is False
    assert calls(host) == ["systemctl is-enabled svc", "systemctl is-active svc"], \
        "no reload, no restart"

    host["calls"].unlink()
    changed, out = run(host, params(host, "live", unit_text="[Service]\nExecStart=/bin/false\n"),
                       diff=True)
    assert changed["changed"] and changed["restarted"]
    assert changed["differed"] == [str(unit)]
    previous = host["previous"] / str(unit).lstrip("/")
    assert previous.read_text() == "[Service]\nExecStart=/bin/true\n", \
        "the live version is kept for rollback"
    kept_env = host["previous"] / str(host["live"]).lstrip("/") / "etc/sparkspec/svc.env"
    assert stat.S_IMODE(kept_env.stat().st_mode) == 0o640, "the kept env file keeps its mode"
    assert "systemctl restart svc" in calls(host)
    assert [d["before_header"] for d in changed["diff"]] == [str(unit)], \
        "diff shows the changed unit"
    assert SECRET not in out, "diff mode must not show the env file"


def test_live_fixes_drifted_mode_without_restart(host: dict[str, Path]) -> None:
    run(host, params(host, "live"))
    (host["root"] / "active").write_text("active\n")
    (host["root"] / "enabled").write_text("enabled\n")
    env = host["live"] / "etc/sparkspec/svc.env"
    env.chmod(0o644)   # made world-readable by hand
    host["calls"].unlink()
    result, _ = run(host, params(host, "live"))
    assert result["changed"] and not result["restarted"]
    assert stat.S_IMODE(env.stat().st_mode) == 0o640
    assert "systemctl restart svc" not in calls(host)


def test_check_mode_writes_nothing(host: dict[str, Path]) -> None:
    staged, _ = run(host, params(host, "staged", analyze=True), check=True)
    live, _ = run(host, params(host, "live"), check=True)
    assert staged["changed"] and live["changed"] and live["restarted"]
    assert not host["staged"].exists() and not host["live"].exists()
    assert not any(c.split()[1] in ("daemon-reload", "enable", "restart", "start")
                   for c in calls(host) if c.startswith("systemctl")), calls(host)
    assert not any(c.startswith("systemd-analyze") for c in calls(host)), "check mode rates nothing"


def test_files_writes_assets_and_removes_absent(host: dict[str, Path]) -> None:
    record = host["live"] / "etc/sparkspec/svc.desired.json"
    args = {"state": "files", "assets": [{"path": str(record), "content": '{"method": "ngram"}\n'}]}
    first, out = run(host, args)
    assert first["changed"] and record.read_text() == '{"method": "ngram"}\n', out
    assert run(host, args)[0]["changed"] is False
    removed, _ = run(host, {"state": "files", "absent": [str(record)]})
    assert removed["changed"] and not record.exists()
    assert run(host, {"state": "files", "absent": [str(record)]})[0]["changed"] is False


def test_secret_files_and_contents_must_pair(host: dict[str, Path]) -> None:
    args = params(host, "staged")
    args["secret_contents"] = []
    result, out = run(host, args)
    assert result["failed"] and \
        result["msg"] == "sparkspec_unit: 1 secret_files but 0 secret_contents", out
    assert not host["staged"].exists()


def test_unknown_group_fails_in_one_line(host: dict[str, Path]) -> None:
    args = params(host, "staged")
    args["secret_files"][0]["group"] = "no-such-group-xyz"  # type: ignore[index]
    result, out = run(host, args)
    assert result["failed"] and result["msg"].startswith("sparkspec_unit staged svc:"), out
    assert "\n" not in result["msg"] and SECRET not in out


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="running a command as another user needs root, as on the host")
def test_staged_checks_the_command_line_as_the_user_and_keeps_an_accepted_one(
        host: dict[str, Path]) -> None:
    """check_argv runs only when the staged unit differs, as check_user (not root); its "checked
    KEY" answer is recorded in check_cache_dir by the module, as root; a refusal comes back with its
    rc and stderr."""
    # pytest's own folders are root-only
    shared = Path(tempfile.mkdtemp(prefix="sparkspec-unit-check-"))
    shared.chmod(0o755)
    checker = shared / "checker.sh"
    key = "a" * 64
    checker.write_text('#!/bin/sh\nid -un > "$1"\n'
                       '[ "$2" = ok ] && { echo "checked ' + key + '"; exit 0; }\n'
                       'echo "vllm: error: unrecognized arguments: --bad" >&2; exit 2\n')
    checker.chmod(0o755)
    who = shared / "who"
    who.touch()
    who.chmod(0o666)
    cache = host["root"] / "accepted"
    check = {"check_user": "nobody", "check_cache_dir": str(cache)}
    result, out = run(host,
                      params(host, "staged", analyze=True,
                             check_argv=[str(checker), str(who), "bad"], **check))
    assert result["args_check"]["rc"] == 2 and \
        "unrecognized arguments" in result["args_check"]["stderr"], out
    assert who.read_text().strip() == "nobody" and not cache.exists()
    result, out = run(host,
                      params(host, "staged", analyze=True,
                             check_argv=[str(checker), str(who), "ok"], **check))
    assert result["args_check"]["rc"] == 0 and (cache / key).is_file(), out
    assert ((cache / key).stat().st_uid, stat.S_IMODE((cache / key).stat().st_mode)) == (0, 0o644)
    live = host["live"]   # the same unit installed: nothing differs, so nothing is checked
    for f in params(host, "staged")["files"]:
        Path(f["path"]).parent.mkdir(parents=True, exist_ok=True)
        Path(f["path"]).write_text(f["content"])
    (live / "etc/sparkspec/svc.env").write_text(params(host, "staged")["secret_contents"][0])
    result, out = run(host,
                      params(host, "staged", analyze=True,
                             check_argv=[str(checker), str(who), "bad"], **check))
    assert not result["differs"] and "args_check" not in result, out
    shutil.rmtree(shared)
