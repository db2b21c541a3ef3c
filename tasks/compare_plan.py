"""`invoke compare`'s plan: which (method, profile) rows to deploy on one target (a host, or a whole cluster:
tasks.cluster_target), in which order, each checked by the play's own resolver before anything changes.

A row is ``METHOD`` (the host's inventory profile) or ``METHOD@PROFILE`` (another profile the host stages,
e.g. the MTP row on a profile that has MTP tensors). Each speculative row's lossless check compares it with
baseline on the same profile at temperature 0, so every profile a row uses gets a baseline row: the one the
user listed, else one added to the plan (it records that profile's reference and is a row of the table, the
speed to compare with). Rows run profile by profile, baseline first within each. On a cluster every row's
play runs on the whole group (a switch rolls back on every node together) and the head answers for the
cluster: its status decides what serves, its results are the table's (reports/compare/<head>/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import registry
from sparkspec.errors import UserError
from tasks.cluster_target import Target

CONTRACT = registry.CONTRACT_KEYS   # the registry's list of the contract's keys (sparkspec_<key>)


@dataclass(frozen=True)
class Row:
    method: str
    profile: str
    added: bool = False  # a baseline the plan added for a profile's lossless reference

    @property
    def name(self) -> str:
        """The row's report name: METHOD@PROFILE (also the file name of its results)."""
        return f"{self.method}@{self.profile}"


def parse(methods: str, default_profile: str) -> list[Row]:
    """The rows of ``--methods`` (comma-separated METHOD or METHOD@PROFILE), each once; one line on bad
    input."""
    rows: list[Row] = []
    for item in (part.strip() for part in methods.split(",")):
        if not item:
            continue
        method, _, profile = item.partition("@")
        if not method or (_ and not profile) or "@" in profile:
            raise UserError(f"--methods: {item!r} is not METHOD or METHOD@PROFILE; e.g. "
                            "baseline,ngram,mtp@sim-mtp")
        row = Row(method, profile or default_profile)
        if row in rows:
            raise UserError(f"--methods: {row.name} is listed twice; give each row once")
        rows.append(row)
    if not rows:
        raise UserError("--methods: no method given; e.g. --methods baseline,ngram,mtp")
    return rows


def plan(rows: list[Row]) -> list[Row]:
    """Rows grouped by profile (in the order first named), baseline first in each group; a baseline row added
    for a profile that has none."""
    profiles = list(dict.fromkeys(r.profile for r in rows))
    ordered: list[Row] = []
    for profile in profiles:
        group = [r for r in rows if r.profile == profile]
        if not any(r.method == "baseline" for r in group):
            group.insert(0, Row("baseline", profile, added=True))
        ordered += sorted(group, key=lambda r: r.method != "baseline")
    return ordered


def check(rows: list[Row], host_vars: dict[str, Any],
          cluster: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Resolve every row as the play will (the same registry, a switch to the row's method on the row's
    profile): an unknown method or profile, a method whose head the profile lacks, a profile the host does not
    stage, each refused in the resolver's own words before any play runs. Returns each row's resolved host, in
    order: its profile's serve settings, not the inventory profile's, are what the row's play serves.
    ``cluster``: the head's place (Target.placement), as the play resolves each node; None: a host alone."""
    contract = {key: host_vars.get(f"sparkspec_{key}") for key in CONTRACT}
    staged = contract["stage_profiles"] or [contract["profile"]]
    out = []
    for row in rows:
        try:
            out.append(registry.resolve({**contract, "method_switch": row.method, "profile": row.profile},
                                        None, "", cluster=cluster))
        except UserError as exc:
            raise UserError(f"--methods {row.name}: {exc}") from None
        if row.profile not in staged:
            raise UserError(f"--methods {row.name}: profile {row.profile} is not staged on this host "
                            f"(staged: {', '.join(staged)}); add it to sparkspec_stage_profiles and "
                            "provision once")
    return out


@dataclass(frozen=True)
class Play:
    row: Row
    hosts: str                 # the play's --host: the target's pattern (a cluster: its whole group)
    verify_only: bool          # the row serves already, healthy: verify only, no switch
    extra: dict[str, Any]      # the row's vars on top of its method's playbook


def plays(target: Target, rows: list[Row], serving: Row | None, reports: Path) -> list[Play]:
    """Each row's play, in order: on the target's pattern, verify only for a row that already serves healthy
    (``serving``), its results under ``reports`` (the verify role writes them under the head's name: a
    cluster's workers end the role)."""
    out: list[Play] = []
    last = serving
    for row in rows:
        now = Row(row.method, row.profile)
        out.append(Play(row, target.pattern, now == last,
                        {"sparkspec_profile": row.profile, "verify_report_name": row.name,
                         "verify_reports_dir": str(reports),
                         "verify_rerecord_reference": row.method == "baseline"}))
        last = now
    return out


def results(target: Target, reports: Path, row: Row) -> tuple[Path, Path]:
    """A row's bench result and lossless report: the head's (the host's, alone)."""
    return reports / target.head / f"{row.name}.json", reports / target.head / "lossless" / f"{row.name}.json"
