"""`invoke compare`'s plan: which (method, profile) rows to deploy on one target (a host, or a whole
cluster: tasks.lib.cluster_target), in which order, each checked by the play's own resolver before
anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.registry.levers import exact_block
from tasks.lib.cluster_target import Target

CONTRACT = registry.CONTRACT_KEYS   # the registry's list of the contract's keys (sparkspec_<key>)


@dataclass(frozen=True)
class Row:
    method: str
    profile: str
    # exactly the levers the row serves (sorted); every other lever off
    levers: tuple[str, ...] = ()
    added: bool = False  # a baseline the plan added for a profile's lossless reference

    @property
    def name(self) -> str:
        """The row's report name: METHOD[+LEVER...]@PROFILE (also the file name of its results)."""
        return f"{self.method}{''.join('+' + lever for lever in self.levers)}@{self.profile}"

    @property
    def group(self) -> tuple[str, tuple[str, ...]]:
        """What a lossless check compares within: the profile and the levers."""
        return self.profile, self.levers

    def serves(self, other: Row | None) -> bool:
        """Whether ``other`` serves what this row does (``added`` aside)."""
        return other is not None and (self.method, self.profile, self.levers) == (
            other.method, other.profile, other.levers)


USAGE = "METHOD[+LEVER...][@PROFILE]; e.g. baseline,mtp,mtp+int8_lm_head,mtp@sim-mtp"


def parse(methods: str, default_profile: str) -> list[Row]:
    """The rows of ``--methods`` (comma-separated METHOD[+LEVER...][@PROFILE]), each once; one line
    on bad input (an unknown lever among them)."""
    rows: list[Row] = []
    for item in (part.strip() for part in methods.split(",")):
        if not item:
            continue
        variant, _, profile = item.partition("@")
        method, *levers = variant.split("+")
        if not method or (_ and not profile) or "@" in profile or "" in levers:
            raise UserError(f"--methods: {item!r} is not {USAGE}")
        try:
            registry.check_levers(levers, f"--methods {item}")
        except UserError as exc:
            raise UserError(str(exc)) from None
        if len(set(levers)) != len(levers):
            raise UserError(f"--methods: {item!r} names a lever twice; name each once")
        row = Row(method, profile or default_profile, tuple(sorted(levers)))
        if any(row.serves(r) for r in rows):
            raise UserError(f"--methods: {row.name} is listed twice; give each row once")
        rows.append(row)
    if not rows:
        raise UserError("--methods: no method given; e.g. --methods baseline,ngram,mtp")
    return rows


def plan(rows: list[Row]) -> list[Row]:
    """Rows grouped by profile and levers (in the order first named), baseline first in each group;
    a baseline row added (with the group's levers) for a group that has none."""
    groups = list(dict.fromkeys(r.group for r in rows))
    ordered: list[Row] = []
    for profile, levers in groups:
        group = [r for r in rows if r.group == (profile, levers)]
        if not any(r.method == "baseline" for r in group):
            group.insert(0, Row("baseline", profile, levers, added=True))
        ordered += sorted(group, key=lambda r: r.method != "baseline")
    return ordered


def lever_vars(row: Row, host: Any = None) -> dict[str, Any]:
    """The row's levers as the host's own block (the last of the merge): each lever on or off, with
    the options the host's own ``sparkspec_levers`` (``host``) gives it."""
    return {"sparkspec_levers": exact_block(row.levers, host)}


def check(rows: list[Row], host_vars: dict[str, Any],
          cluster: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Resolve every row as the play will (the same registry, a switch to the row's method on the
    row's profile): an unknown method or profile, a method whose head the profile lacks, a profile
    the host does not stage, each refused in the resolver's own words before any play runs. Returns
    each row's resolved host, in order: its profile's serve settings, not the inventory profile's,
    are what the row's play serves.
    ``cluster``: the head's place (Target.placement), as the play resolves each node; None: a host
    alone."""
    contract = {key: host_vars.get(f"sparkspec_{key}") for key in CONTRACT}
    staged = contract["stage_profiles"] or [contract["profile"]]
    out = []
    for row in rows:
        try:
            out.append(registry.resolve({**contract, "method_switch": row.method,
                                         "profile": row.profile,
                                         "levers": exact_block(row.levers, contract.get("levers"))},
                                        None, "", cluster=cluster))
        except UserError as exc:
            raise UserError(f"--methods {row.name}: {exc}") from None
        if row.profile not in staged:
            raise UserError(f"--methods {row.name}: profile {row.profile} is not staged on this "
                            f"host (staged: {', '.join(staged)}); add it to "
                            "sparkspec_stage_profiles and provision once")
    return out


@dataclass(frozen=True)
class Play:
    row: Row
    hosts: str                # the play's --host: the target's pattern (a cluster: its whole group)
    verify_only: bool         # the row serves already, healthy: verify only, no switch
    extra: dict[str, Any]     # the row's vars on top of its method's playbook


def plays(target: Target, rows: list[Row], serving: Row | None, reports: Path,
          host_levers: Any = None) -> list[Play]:
    """Each row's play, in order: on the target's pattern, verify only for a row that already serves
    healthy (``serving``), its results under ``reports`` (the verify role writes them under the
    head's name: a cluster's workers end the role), its levers with the options of the host's own
    block (``host_levers``)."""
    out: list[Play] = []
    last = serving
    for row in rows:
        out.append(Play(row, target.pattern, row.serves(last),
                        {"sparkspec_profile": row.profile, "verify_report_name": row.name,
                         "verify_reports_dir": str(reports),
                         "verify_rerecord_reference": row.method == "baseline",
                         **lever_vars(row, host_levers)}))
        last = row
    return out


def results(target: Target, reports: Path, row: Row) -> tuple[Path, Path]:
    """A row's bench result and lossless report: the head's (the host's, alone)."""
    return (reports / target.head / f"{row.name}.json",
            reports / target.head / "lossless" / f"{row.name}.json")
