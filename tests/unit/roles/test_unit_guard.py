"""The memory guard's ExecStartPre and the watchdog's unit, rendered by the real templates and read
back by systemd's own rules: every value reaches its command as exactly one word, the guard comes
after the page cache is dropped, and a cluster's worker gets no --measure."""

from __future__ import annotations

from typing import Any

import pytest

from sparkspec import registry
from tests.support import systemd_rules as rules

GUARD = {"deploy_memory_guard": True, "deploy_memory_margin_gib": 4,
         "deploy_memory_floor_gib": None, "_deploy_memfit_dir": "/opt/sparkspec/state/memfit",
         "_deploy_record_file": "/etc/sparkspec/u.json",
         "_deploy_clustered": False, "_deploy_cluster": None,
         "_deploy_record": {"url": "http://127.0.0.1:8000"}}


def _pre(extra: dict[str, Any], venv: str = "/opt/venvs/vllm",
         leads: bool = True) -> list[rules.ExecCommand]:
    resolved = registry.resolve(rules.small_contract())
    resolved["venv"], resolved["leads"] = venv, leads
    unit, _ = rules.render_resolved(resolved, extra={**GUARD, **extra})
    return [rules.exec_command(value) for section, key, value in rules.unit_entries(unit)
            if section == "Service" and key == "ExecStartPre"]


def test_the_guard_runs_after_the_page_cache_is_dropped_with_full_privileges() -> None:
    drop, guard = _pre({})
    assert "drop_caches" in " ".join(drop.argv) and guard.prefixes == "+" == drop.prefixes
    assert guard.argv == ["/opt/venvs/tools/bin/python", "-I", "-m", "sparkspec.cli", "memfit",
                          "guard", "--unit", "sparkspec-vllm",
                          "--unit-record", "/etc/sparkspec/u.json", "--venv", "/opt/venvs/vllm",
                          "--record-dir", "/opt/sparkspec/state/memfit", "--margin-gib", "4.0",
                          "--measure", "http://127.0.0.1:8000"]


def test_a_floor_is_passed_as_a_number_and_replaces_nothing_else() -> None:
    guard = _pre({"deploy_memory_floor_gib": "96.5", "deploy_memory_margin_gib": "0"})[-1]
    assert guard.argv[guard.argv.index("--floor-gib") + 1] == "96.5"
    assert guard.argv[guard.argv.index("--margin-gib") + 1] == "0.0"


def test_a_venv_path_with_a_space_reaches_the_guard_as_one_word() -> None:
    guard = _pre({}, venv="/opt/a b/v")[-1]
    assert guard.argv[guard.argv.index("--venv") + 1] == "/opt/a b/v"


@pytest.mark.parametrize("folder",
                         ["/opt/a b/memfit", "/opt/%i/$HOME/x", "/opt/q'\"\\;/m", "/opt/;/m"])
def test_hostile_record_folders_reach_the_guard_as_one_word(folder: str) -> None:
    guard = _pre({"_deploy_memfit_dir": folder})[-1]
    assert rules.env_expand(guard.argv[guard.argv.index("--record-dir") + 1]) == folder


def test_a_cluster_worker_is_guarded_without_measuring() -> None:
    guard = _pre({"_deploy_clustered": True, "_deploy_cluster": {"rank": 1}}, leads=False)[-1]
    assert "--measure" not in guard.argv and guard.argv[4:6] == ["memfit", "guard"]


def test_off_means_no_guard() -> None:
    assert len(_pre({"deploy_memory_guard": False})) == 1


def _validate() -> Any:
    """The contract role's filter module (roles/sparkspec/filter_plugins/sparkspec_validate.py)."""
    import sys
    folder = str(rules.ROOT / "roles/sparkspec/filter_plugins")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import sparkspec_validate
    return sparkspec_validate


def _number_problems() -> Any:
    return _validate().number_problems


def test_the_deploy_checks_every_guard_and_watchdog_number_with_the_commands_bounds() -> None:
    """validate.yml checks each numeric deploy_memory_*/deploy_watchdog_* default, and a value the
    deploy lets through is one `sparkspec memfit` and `sparkspec watchdog` accept: their own limits,
    not a copy."""
    import yaml

    from sparkspec.operate import memfit, watchdog
    validate = (rules.ROOT / "roles/deploy/tasks/validate.yml").read_text()
    defaults = yaml.safe_load((rules.ROOT / "roles/deploy/defaults/main.yml").read_text())
    numeric = [k for k, v in defaults.items()
               if k.startswith(("deploy_memory_", "deploy_watchdog_"))
               and not isinstance(v, bool | str)]
    assert len(numeric) == 15 and all(f"- [{k}, " in validate for k in numeric)
    problems = _number_problems()
    assert problems([["s", watchdog.MAX_SECONDS, "seconds", False],
                     ["g", memfit.MAX_MARGIN_GIB, "gib", False],
                     ["c", 1, "count", False], ["f", None, "gib", True]]) == []
    refused = problems([["s", watchdog.MAX_SECONDS * 1.01, "seconds", False],
                        ["s0", 0, "seconds", False], ["g", memfit.MAX_MARGIN_GIB + 1, "gib", False],
                        ["c", 0, "count", False], ["b", True, "count", False],
                        ["n", "nan", "gib", False]])
    assert [line.split(":")[0] for line in refused] == ["s", "s0", "g", "c", "b", "n"]


@pytest.mark.parametrize("key", ["", "k3y"])
def test_the_watchdog_unit_runs_the_watchdog_with_exactly_its_arguments(key: str) -> None:
    """The watchdog's unit, rendered by the real template: one ExecStart of isolated Python, the
    key's file (never the key) only when a key is set, no environment file (vLLM's environment is
    not root's)."""
    resolved = registry.resolve(rules.small_contract())
    unit, _ = rules.render_resolved(resolved, template="watchdog.service.j2", extra={
        **GUARD, "sparkspec_api_key": key, "sparkspec_home": "/opt/sparkspec",
        "_deploy_lock": "/run/sparkspec/sparkspec-vllm.lock",
        "_deploy_watchdog_unit": "sparkspec-vllm-watchdog",
        "_deploy_watchdog_config": "/etc/sparkspec/u-watchdog.json",
        "_deploy_watchdog_key": "/etc/sparkspec/u-watchdog.key",
        "deploy_watchdog_textfile_dir": "/var/lib/sparkspec-monitoring/textfile"})
    service = [(k, v) for section, k, v in rules.unit_entries(unit) if section == "Service"]
    starts = [rules.exec_command(v) for k, v in service if k == "ExecStart"]
    assert len(starts) == 1 and not [k for k, _ in service if k == "EnvironmentFile"]
    # the canary's figures go to the node exporter's textfile folder, its one other writable place
    assert [v for k, v in service if k == "ReadWritePaths"] == [
        "-/opt/sparkspec/state", "-/var/lib/sparkspec-monitoring/textfile"]
    assert starts[0].argv == ["/opt/venvs/tools/bin/python", "-I", "-m", "sparkspec.cli",
                              "watchdog", "--unit", "sparkspec-vllm", "--url",
                              "http://127.0.0.1:8000", "--config", "/etc/sparkspec/u-watchdog.json",
                              *(["--api-key-file", "/etc/sparkspec/u-watchdog.key"] if key else [])]


@pytest.mark.parametrize(("name", "line"), [
    ("vllm.service",
     "sparkspec_unit_name 'vllm.service' ends in a unit type; "
     "give the name without it, e.g. 'vllm'"),
    ("vllm.timer",
     "sparkspec_unit_name 'vllm.timer' ends in a unit type; give the name without it, e.g. 'vllm'"),
    ("a/b", "sparkspec_unit_name 'a/b' is not a unit name (letters, digits, '_.@-'); fix it"),
])
def test_a_unit_name_the_guard_and_the_watchdog_would_read_as_another_unit_is_refused(
        name: str, line: str) -> None:
    """The role appends .service, while `sparkspec memfit` and `sparkspec watchdog` take a name as
    systemctl does (vllm.service is vllm): a name with a unit type would have them act on another
    unit."""
    name_problems = _validate().name_problems
    assert name_problems(name, "vllm") == [line]
    assert name_problems("sparkspec-vllm", "vllm") == [] and name_problems("vllm.v2", "vllm") == []
