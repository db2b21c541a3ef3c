"""``sparkspec fetch repo|fp8-subset|plan`` and ``sparkspec hub serve|publish``.

Only argparse registration happens at import; each handler imports what it runs (huggingface_hub and the
HTTP client load only for ``fetch``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from sparkspec.cli import emit_json
from sparkspec.errors import UserError


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", help="hub repo id, e.g. Qwen/Qwen3.5-122B-A10B-FP8")
    p.add_argument("--revision", required=True,
                   help="commit id to pin (a branch name resolves to its current commit)")
    p.add_argument("--endpoint", help="hub or mirror URL (default: HF_ENDPOINT, else huggingface.co)")
    p.add_argument("--token-file", help="file holding the HF token (default: HF_TOKEN from the environment)")
    p.add_argument("--local-path", help="air-gapped: copy from this directory instead of the hub")
    p.add_argument("--json", action="store_true", help="print a final JSON line")


def register(sub: Any) -> None:
    fetch = sub.add_parser("fetch", help="download checkpoints with pinned revisions")
    fsub = fetch.add_subparsers(dest="fetch_command", metavar="SUBCOMMAND", required=True)

    p = fsub.add_parser("repo", help="snapshot a repo (or the files matching --include) into --dest")
    _source_args(p)
    p.add_argument("--dest", required=True)
    p.add_argument("--include", action="append", help="glob of files to fetch (repeatable; default all)")
    p.set_defaults(func=_fetch_repo)

    p = fsub.add_parser("fp8-subset", help="fetch only the FP8 tensors assemble takes, by HTTP range reads")
    _source_args(p)
    p.add_argument("--int4", required=True, help="the local INT4 AutoRound checkpoint assemble will use")
    p.add_argument("--dest", required=True)
    p.add_argument("--fp8-pattern", action="append", default=[], help="same as assemble's --fp8-pattern")
    p.add_argument("--mode", choices=("ranges", "full"), default="ranges",
                   help="ranges: tensor byte ranges only; full: whole shards (mirrors without Range)")
    p.add_argument("--retries", type=int, default=5, help="retries per HTTP request (default 5)")
    p.set_defaults(func=_fetch_subset)

    p = fsub.add_parser("plan", help="resolve the revision and sum the file sizes; --dest checks free space")
    _source_args(p)
    p.add_argument("--include", action="append")
    p.add_argument("--dest", help="refuse (exit 2) when this filesystem lacks the space")
    p.set_defaults(func=_plan)

    hubp = sub.add_parser("hub", help="local HF-compatible endpoint (tests, simulated Spark, mirrors)")
    hsub = hubp.add_subparsers(dest="hub_command", metavar="SUBCOMMAND", required=True)
    p = hsub.add_parser("serve", help="serve ROOT/<org>/<name> repos over HTTP")
    p.add_argument("--root", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8089)
    p.add_argument("--token", action="append", help="accepted bearer token (repeatable; prefer --token-file)")
    p.add_argument("--token-file", help="file with one accepted token per line")
    p.add_argument("--verbose", action="store_true", help="log requests to stderr")
    p.set_defaults(func=_serve)
    p = hsub.add_parser("publish", help="copy a local checkpoint in as ROOT/<org>/<name>, set its revision")
    p.add_argument("--root", required=True)
    p.add_argument("--repo", required=True, help="org/name")
    p.add_argument("--from", dest="source", required=True, help="directory to publish")
    p.add_argument("--revision", help="40-hex commit id (default: derived from the content)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_publish)


def _token(args: argparse.Namespace) -> str | None:
    from sparkspec.hub_source import read_token_file

    return read_token_file(args.token_file) if args.token_file else None


def _finish(args: argparse.Namespace, doc: dict[str, Any], line: str) -> int:
    print(line, file=sys.stderr)
    if args.json:
        emit_json(doc)
    return 0


def _fetch_repo(args: argparse.Namespace) -> int:
    from sparkspec import hub

    result = hub.fetch_repo(args.repo, args.revision, args.dest, args.include, token=_token(args),
                            endpoint=args.endpoint, local_path=args.local_path)
    return _finish(args, result.as_json(), f"fetch: {args.repo}@{result.commit[:12]} -> {args.dest}: "
                                           f"{len(result.files)} files, {result.bytes_fetched} bytes fetched")


def _fetch_subset(args: argparse.Namespace) -> int:
    if args.retries < 0:
        raise UserError(f"--retries {args.retries}: must be >= 0")
    from sparkspec import hub

    result = hub.fetch_fp8_subset(args.repo, args.revision, args.int4, args.dest, args.fp8_pattern,
                                  token=_token(args), endpoint=args.endpoint, local_path=args.local_path,
                                  mode=args.mode, retries=args.retries)
    ratio = result.tensor_bytes_fetched / result.tensor_bytes_used if result.tensor_bytes_used else 0.0
    return _finish(args, result.as_json(),
                   f"fetch: {result.tensors} FP8 tensors of {args.repo}@{result.commit[:12]} -> {args.dest}: "
                   f"tensor bytes fetched {result.tensor_bytes_fetched} / used {result.tensor_bytes_used} "
                   f"({ratio:.3f}x), headers {result.header_bytes}")


def _plan(args: argparse.Namespace) -> int:
    from sparkspec import hub
    from sparkspec.hub_source import Source

    source = Source(args.repo, args.revision, args.endpoint, _token(args), args.local_path)
    plan = hub.plan(source, args.include)
    if args.dest:
        hub.preflight(Path(args.dest), plan.total_bytes)
    doc = {"changed": False, "repo": args.repo, "commit": plan.commit, "files": plan.files,
           "bytes_needed": plan.total_bytes, "bytes_fetched": 0}
    return _finish(args, doc, f"plan: {args.repo}@{plan.commit[:12]}: {len(plan.files)} files, "
                              f"{plan.total_bytes} bytes")


def _serve(args: argparse.Namespace) -> int:
    from sparkspec.hubserver import HubServer

    tokens = list(args.token or [])
    if args.token_file:
        try:
            tokens += [t.strip() for t in Path(args.token_file).read_text().splitlines() if t.strip()]
        except OSError as exc:
            raise UserError(f"{args.token_file}: cannot read ({exc.strerror}); fix --token-file") from None
    if not Path(args.root).is_dir():
        raise UserError(f"{args.root}: not a directory; create it or publish a repo into it first")
    try:
        server = HubServer(args.root, args.host, args.port, tokens, verbose=args.verbose)
    except OSError as exc:
        raise UserError(f"{args.host}:{args.port}: cannot listen ({exc.strerror}); pick another "
                        "--port") from None
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"hub: serving {os.path.abspath(args.root)} at {server.url} (tokens: {'on' if tokens else 'off'})",
          file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _publish(args: argparse.Namespace) -> int:
    from sparkspec.hubserver import publish

    if not Path(args.source).is_dir():
        raise UserError(f"{args.source}: not a directory; point --from at a checkpoint directory")
    try:
        changed, revision, files = publish(args.root, args.repo, args.source, args.revision)
    except ValueError as exc:
        raise UserError(f"--repo/--revision: {exc}") from None
    except OSError as exc:
        raise UserError(f"{args.root}: cannot publish ({exc.strerror}); check space and "
                        "permissions") from None
    doc = {"changed": changed, "repo": args.repo, "revision": revision, "files": len(files),
           "bytes": sum(f.size for f in files.values())}
    return _finish(args, doc, f"hub: {args.repo}@{revision} {'published' if changed else 'unchanged'} "
                              f"({len(files)} files)")
