"""``sparkspec cluster supervise``: the peer supervisor each node's unit runs in two-node serving.

Only argparse registration happens at import; the handler imports
:mod:`sparkspec.cluster.supervise`, which checks every option (one line, exit 2) before it binds the
beacon or starts the child.
"""

from __future__ import annotations

import argparse
from typing import Any

from sparkspec import argtypes

rank = argtypes.number(int, 0, 1023)
seconds = argtypes.positive_float


def register(sub: Any) -> None:
    cluster = sub.add_parser("cluster",
                             help="two-node serving: the peer supervisor of each node's unit")
    csub = cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)
    # no abbreviations: an option of the child must never be taken for one of the supervisor
    p: argparse.ArgumentParser = csub.add_parser(
        "supervise", allow_abbrev=False,
        help="run COMMAND (vLLM) as a child, serve GET /peer, and stop the child when a peer is "
             "lost",
        description="Exit 3: a peer was lost (the unit restarts and rejoins). Exit 4: a peer did "
                    "not join within --join-timeout (a person must act). A signal stops the "
                    "child's group, exit 0. Otherwise the child's own exit code (a signal death: "
                    "128 + its number).")
    p.add_argument("--rank", required=True, type=rank,
                   help="this node's rank, 0-1023 (0 is the head)")
    p.add_argument("--listen", required=True, metavar="ADDR:PORT",
                   help="where this node's beacon answers GET /peer, e.g. 10.0.0.2:29502")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=ADDR:PORT",
                   help="a peer's beacon (repeatable): on the head every worker, on a worker the "
                        "head")
    p.add_argument("--join-timeout", type=seconds, default=600.0,
                   help="seconds every peer has to answer with a running child (default 600; "
                        "exit 4)")
    p.add_argument("--lost-after", type=seconds, default=30.0,
                   help="seconds a joined peer may be silent or have no child (default 30; "
                        "exit 3); at least twice --interval")
    p.add_argument("--interval", type=seconds, default=5.0,
                   help="seconds between polls (default 5)")
    p.add_argument("--stop-timeout", type=seconds, default=20.0,
                   help="seconds the child's group has after SIGTERM before SIGKILL (default 20)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the child: an absolute path and its arguments, after --")
    p.set_defaults(func=_supervise)


def _supervise(args: argparse.Namespace) -> int:
    from sparkspec.cluster import supervise

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    opts = supervise.options(args.rank, args.listen, args.peer, command,
                             join_timeout=args.join_timeout, lost_after=args.lost_after,
                             interval=args.interval, stop_timeout=args.stop_timeout)
    return supervise.supervise(opts)
