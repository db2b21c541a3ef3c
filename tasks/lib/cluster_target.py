"""What a task's --host names as one serving target: a host that serves alone, or a whole cluster
(sparkspec.registry.cluster: ``sparkspec_cluster`` on the group, ``sparkspec_cluster_node`` per
member). A cluster's plays run on every member at once (a method switch rolls back on every node
together), and it is measured through its head: its /health, completions and /metrics are the
cluster's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparkspec.errors import UserError
from sparkspec.registry.cluster import resolve_cluster
from tasks.lib.inventory import Inventory


@dataclass(frozen=True)
class Target:
    # the plays' --host: the host, or the cluster's group
    pattern: str
    # the host that answers: status, bench, lossless check, reports/<head>
    head: str
    # the hosts the plays change: the host alone, or the head, then workers
    members: tuple[str, ...]
    # registry.resolve's ``cluster`` for the head; None: alone
    placement: dict[str, Any] | None = None


def resolve_target(inv: Inventory, host: str) -> Target:
    """The target --host names: one host that serves alone, or every member of one cluster (its
    group, or a comma list of all its members). Part of a cluster, hosts of two clusters, or several
    hosts that serve alone are refused in one line naming the fix."""
    names = inv.hosts_of(host)
    found = {n: _vars(inv, n) for n in names}
    clustered = [n for n in names if found[n].get("sparkspec_cluster")]
    if not clustered:
        if len(names) > 1:
            raise UserError(f"--host {host}: {', '.join(names)} each serve alone; name one host "
                            "(or one cluster's group) at a time")
        return Target(names[0], names[0], (names[0],))
    me = clustered[0]
    own = found[me]
    spec = own["sparkspec_cluster"]
    group = spec.get("group") if isinstance(spec, Mapping) else None
    listed = inv.hosts_of(group) if isinstance(group, str) and group in inv.manager.groups else []
    members = {m: _vars(inv, m).get("sparkspec_cluster_node") for m in listed}
    accelerator = str(own.get("sparkspec_accelerator") or "gb10")
    # the registry's own checks (layout, one head, every member's node): its one line where they
    # fail
    placed = resolve_cluster(spec, members, me, speculative=None, accelerator=accelerator)
    assert placed is not None   # spec is set
    group = placed["group"]
    ordered = tuple(m["host"] for m in placed["members"])   # the head first, then the workers
    head = placed["head"]["host"]
    strangers = [n for n in names if n not in ordered]
    if strangers:
        raise UserError(f"--host {host}: {', '.join(strangers)} "
                        f"{'is' if len(strangers) == 1 else 'are'} not "
                        f"in cluster {group} ({', '.join(ordered)}); name one cluster's group "
                        "(or one host) at a time")
    missing = [m for m in ordered if m not in names]
    if missing:
        raise UserError(f"--host {host}: cluster {group} runs as one, and {', '.join(missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing; pass the group: "
                        f"--host {group}")
    return Target(group, head, ordered,
                  {"me": head, "members": members, "accelerator": accelerator})


def _vars(inv: Inventory, host: str) -> dict[str, Any]:
    return inv.host_vars(host, ("sparkspec_cluster", "sparkspec_cluster_node",
                                "sparkspec_accelerator"))
