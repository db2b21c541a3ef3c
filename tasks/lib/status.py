"""`invoke status`: a quick look at each host over SSH (Fabric), no playbook: the unit's state and
memory from systemd's properties, what runs from the unit's record, the desired method a deploy
recorded, /health asked on the host, and the host's available memory."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError
from tasks.lib.remote import Host, connect

UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "MemoryCurrent", "NRestarts",
                   "ActiveEnterTimestamp", "ControlGroup")

# Runs on the host as root with its python3: the status probe of the contract role's host code (one
# source with the roles' probes: docs/design.md), sent as the command's text; it prints one JSON
# object.
HOST_CODE = Path(__file__).resolve().parents[2] / "roles/sparkspec/module_utils/sparkspec_host.py"


@dataclass
class HostStatus:
    host: str
    unit: str
    state: str = "unknown"             # systemd ActiveState (active, inactive, failed, ...)
    sub_state: str = ""
    loaded: str = ""                   # LoadState: not-found when nothing was ever deployed
    main_pid: int | None = None
    restarts: int | None = None
    since: str = ""
    method: str | None = None          # running: from the unit's record
    profile: str | None = None
    model: str | None = None
    url: str | None = None
    k: int | None = None               # num_speculative_tokens served, from the unit's record
    # where k came from: sparkspec_num_speculative_tokens, a method entry
    k_source: str | None = None
    levers: list[str] = field(default_factory=list)  # the levers served, from the unit's record
    vllm_release: str | None = None    # the vLLM release served, from the unit's record
    previous_release: str | None = None  # the one `invoke rollback` returns to (its record)
    release_record: dict[str, Any] | None = None  # that record, as the host has it
    desired_method: str | None = None  # recorded by a deploy that switched the method
    desired_time: str | None = None
    inventory_method: str | None = None
    health: int | None = None
    health_error: str = ""
    # bytes the unit uses: systemd's MemoryCurrent, else its processes' RSS
    memory_current: int | None = None
    memory_source: str = ""            # MemoryCurrent or rss
    mem_available: int | None = None   # bytes the host has available
    # the memory guard's record for what is served (docs/operate.md)
    memfit: dict[str, Any] | None = None
    watchdog: str | None = None        # the watchdog unit's ActiveState; None: no watchdog
    # the headless role's record (what it stopped, what that freed)
    headless: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def host_status(inventory: str | Path, name: str, *, ask_become_pass: bool = False) -> HostStatus:
    host = connect(inventory, name, ask_become_pass=ask_become_pass,
                   extra_vars=("sparkspec_unit_name", "sparkspec_method", "sparkspec_home"))
    try:
        return _probe(host)
    finally:
        host.close()


def _probe(host: Host) -> HostStatus:
    unit = str(host.vars["sparkspec_unit_name"])
    code = HOST_CODE.read_text(encoding="utf-8")
    state = f"{host.vars.get('sparkspec_home') or '/opt/sparkspec'}/state"
    argv = [host.python, "-c", code, "status", unit, ",".join(UNIT_PROPERTIES), state]
    result = host.as_root(" ".join(shlex.quote(a) for a in argv))
    if result.exited != 0:
        raise UserError(f"host {host.name}: the status probe failed ({_last(result.stderr)}); "
                        f"check that {host.python} runs there (ansible_python_interpreter)")
    try:
        data = json.loads(result.stdout)
    except ValueError:
        raise UserError(f"host {host.name}: the status probe printed no JSON "
                        f"({_last(result.stdout)})") from None
    status = _status(host.name, unit, data)
    status.inventory_method = str(host.vars.get("sparkspec_method") or "") or None
    status.notes += _method_notes(status, data.get("desired"))
    return status


def _status(name: str, unit: str, data: dict[str, Any]) -> HostStatus:
    show = data.get("show") or {}
    raw = data.get("record")
    record: dict[str, Any] = raw if isinstance(raw, dict) else {}
    status = HostStatus(host=name, unit=unit, state=show.get("ActiveState", "unknown"),
                        sub_state=show.get("SubState", ""), loaded=show.get("LoadState", ""),
                        main_pid=_int(show.get("MainPID")) or None,
                        restarts=_int(show.get("NRestarts")),
                        since=show.get("ActiveEnterTimestamp", ""),
                        memory_current=_int(show.get("MemoryCurrent")),
                        mem_available=data.get("mem_available"), health=data.get("health"),
                        health_error=data.get("health_error") or "",
                        memfit=(data.get("memfit") if isinstance(data.get("memfit"), dict)
                                else None),
                        watchdog=(data.get("watchdog") if isinstance(data.get("watchdog"), str)
                                  else None),
                        headless=(data.get("headless") if isinstance(data.get("headless"), dict)
                                  else None))
    if status.memory_current is not None:
        status.memory_source = "MemoryCurrent"
    elif data.get("rss") is not None:
        status.memory_current, status.memory_source = int(data["rss"]), "rss"
    if record.get("error"):
        status.notes.append(str(record["error"]))
    status.method, status.profile = record.get("method"), record.get("profile")
    status.model, status.url = record.get("served_model_name"), record.get("url")
    status.k = _int(record.get("num_speculative_tokens"))
    status.k_source = str(record["k_source"]) if isinstance(record.get("k_source"), str) else None
    levers = record.get("levers")
    status.levers = sorted(str(x) for x in levers)[:16] if isinstance(levers, dict) else []
    if isinstance(record.get("vllm_release"), str):
        status.vllm_release = record["vllm_release"]
    release = data.get("release")
    if isinstance(release, dict) and release.get("error"):
        status.notes.append(str(release["error"]))
    elif isinstance(release, dict) and isinstance(release.get("previous"), str):
        status.previous_release = release["previous"] or None
        status.release_record = release
    desired = data.get("desired")
    if isinstance(desired, dict) and not desired.get("error"):
        status.desired_method, status.desired_time = desired.get("method"), desired.get("time")
    elif isinstance(desired, dict):
        status.notes.append(str(desired["error"]))
    return status


def _method_notes(status: HostStatus, desired: Any) -> list[str]:
    """What wins between a deploy's switch and the inventory, said where they differ."""
    notes = []
    inv, want = status.inventory_method, status.desired_method
    if want and inv and want != inv:
        switched_from = desired.get("inventory_method") if isinstance(desired, dict) else None
        then = ("the next provision keeps it; `invoke deploy --method " + inv + "` goes back"
                if switched_from in (None, inv) else
                f"the inventory changed since (it said {switched_from}), so the next provision "
                f"deploys {inv}")
        notes.append(f"desired {want} (switched by deploy) ≠ inventory {inv}: {then}")
    if status.method and want and status.method != want:
        notes.append(f"running {status.method} ≠ desired {want} "
                     "(the last switch did not complete)")
    if status.method and inv and not want and status.method != inv:
        notes.append(f"running {status.method} ≠ inventory {inv}: "
                     f"the next provision deploys {inv}")
    return notes


def _int(value: Any) -> int | None:
    """A systemd number; None for [not set] and for the 2^64-1 that means 'no value'."""
    text = str(value or "")
    return int(text) if text.isdigit() and int(text) < 2**63 else None


def _last(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def as_json(statuses: list[HostStatus]) -> str:
    return json.dumps([asdict(s) for s in statuses], indent=2)


def table(statuses: list[HostStatus]) -> Any:
    """A rich table, one row per host, and the notes (what wins, files that do not read) under
    it."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    grid = Table(title=f"sparkspec status ({', '.join(sorted({s.unit for s in statuses}))})")
    columns = ("host", "unit", "vLLM (previous)", "method", "k (from)", "levers", "profile",
               "model", "/health",
               "memory", "available",
               "start needs", "watchdog", "headless")
    for column in columns:
        grid.add_column(column,
                        no_wrap=column in ("host", "unit", "/health", "memory", "available"))
    for s in statuses:
        state = s.state if s.sub_state in ("running", "dead", "") else f"{s.state}/{s.sub_state}"
        health = str(s.health) if s.health is not None else (s.health_error or "-")
        k = "-" if s.k is None else f"{s.k} ({s.k_source or 'unknown'})"
        release = (s.vllm_release or "-") + (f" ({s.previous_release})" if s.previous_release
                                              else "")
        grid.add_row(s.host, state, release, s.method or "none", k, ", ".join(s.levers) or "-",
                     s.profile or "-", s.model or "-", health,
                     _gib(s.memory_current), _gib(s.mem_available), _need(s.memfit),
                     s.watchdog or "off", _headless(s.headless))
    notes = [Text(f"{s.host}: {note}", style="yellow") for s in statuses for note in s.notes]
    return Group(grid, *notes)


def _need(memfit: dict[str, Any] | None) -> str:
    """What the memory guard's record says a start of what is served takes (the drop of the host's
    available memory during load and warm-up), or 'unmeasured'."""
    need = memfit.get("needed_bytes") if memfit else None
    return _gib(need) if isinstance(need, int) and not isinstance(need, bool) else "unmeasured"


def _headless(record: dict[str, Any] | None) -> str:
    """Headless mode from its record: off, or on with the memory the display manager's stop
    freed."""
    if record is None:
        return "off"
    freed = record.get("freed_bytes")
    if isinstance(freed, int) and not isinstance(freed, bool):
        return f"on (freed {freed / 2**30:+.1f} GiB)"
    return "on (nothing to stop)"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"
