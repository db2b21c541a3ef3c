"""``sparkspec fetch repo|fp8-subset|batch|plan`` and ``sparkspec hub serve``."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkspec import argtypes, progress, validate
from sparkspec.cli.common import emit_json
from sparkspec.errors import UserError
from sparkspec.hub.repo import PUBLISHED_FILE as MARKER

if TYPE_CHECKING:
    from sparkspec.hub.server import HubServer

TOKENS_ENV = "SPARKSPEC_HUB_TOKENS"
retries = argtypes.number(int, 1, 100)


def _checked(check: Callable[[str], str], name: str) -> Callable[[str], str]:
    """An argparse ``type=`` from a :mod:`sparkspec.validate` check; argparse shows its message."""

    def parse(text: str) -> str:
        try:
            return check(text)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = name
    return parse


def _url(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    if (parts.scheme not in ("http", "https") or not parts.hostname
            or re.search(r"[\x00-\x20\x7f]", text)):
        raise UserError(f"{text!r} is not an http(s) URL; give the hub or mirror, e.g. "
                        "https://huggingface.co")
    if parts.username or parts.password:
        raise UserError("the URL holds credentials, which every process list shows; put the token "
                        "in --token-file instead")
    return text.rstrip("/")


def _text(text: str) -> str:
    if not text or re.search(r"[\x00-\x1f\x7f]", text):
        raise UserError(f"{text!r} is empty or holds a control character")
    return text


repo_id = _checked(validate.repo_id, "repo id")
revision = _checked(validate.revision, "revision")
url = _checked(_url, "URL")
text = _checked(_text, "text")


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("repo", type=repo_id, help="hub repo id, e.g. Qwen/Qwen3.5-122B-A10B-FP8")
    p.add_argument("--revision", required=True, type=revision,
                   help="commit id to pin (a branch name resolves to its current commit)")
    p.add_argument("--endpoint", type=url,
                   help="hub or mirror URL (default: HF_ENDPOINT, else huggingface.co)")
    p.add_argument("--token-file", type=text,
                   help="file holding the HF token (default: HF_TOKEN from the environment)")
    p.add_argument("--local-path", type=text,
                   help="air-gapped: copy from this directory instead of the hub")
    p.add_argument("--json", action="store_true", help="print a final JSON line")


def _command(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    # no abbreviations: "--token X" must not be taken for "--token-file X" (X echoed as a file name)
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, allow_abbrev=False)
    return parser


def _fetch_commands(fsub: Any) -> None:
    """``fetch repo`` and ``fetch fp8-subset``: under ``fetch``, and again for each batch item."""
    p = _command(fsub, "repo", "snapshot a repo (or the files matching --include) into --dest")
    _source_args(p)
    p.add_argument("--dest", required=True, type=text)
    p.add_argument("--include", action="append", type=text,
                   help="glob of files to fetch (repeatable; default all)")
    p.add_argument("--progress-file", type=text, metavar="PATH", help=progress.HELP)
    p.set_defaults(func=_fetch_repo)

    p = _command(fsub, "fp8-subset",
                 "fetch only the FP8 tensors assemble takes, by HTTP range reads")
    _source_args(p)
    p.add_argument("--int4", required=True, type=text,
                   help="the local INT4 AutoRound checkpoint assemble will use")
    p.add_argument("--dest", required=True, type=text)
    p.add_argument("--fp8-pattern", action="append", default=[], type=text,
                   help="same as assemble's --fp8-pattern")
    p.add_argument("--mode", choices=("ranges", "full"), default="ranges", help="ranges: tensor "
                   "byte ranges only; full: whole shards (mirrors without Range)")
    p.add_argument("--retries", type=retries, default=5,
                   help="retries per HTTP request, 1-100 (default 5)")
    p.add_argument("--progress-file", type=text, metavar="PATH", help=progress.HELP)
    p.set_defaults(func=_fetch_subset)


def register(sub: Any) -> None:
    fetch = sub.add_parser("fetch", help="download checkpoints with pinned revisions")
    fsub = fetch.add_subparsers(dest="fetch_command", metavar="SUBCOMMAND", required=True)
    _fetch_commands(fsub)

    p = _command(fsub, "batch", "run several repo / fp8-subset fetches in order, in one process")
    p.add_argument("--items", required=True, type=_items, metavar="JSON", help="a JSON list of "
                   "argument lists, each what follows `sparkspec fetch` for one repo or fp8-subset "
                   "fetch, without --json and --progress-file (the batch's own)")
    p.add_argument("--progress-file", type=text, metavar="PATH", help=progress.HELP)
    p.add_argument("--json", action="store_true", help='print a final JSON line: {"changed": '
                   'any item changed, "results": [each item\'s line]}')
    p.set_defaults(func=_fetch_batch)

    p = _command(fsub, "plan",
                 "resolve the revision and sum the file sizes; --dest checks free space")
    _source_args(p)
    p.add_argument("--include", action="append", type=text)
    p.add_argument("--dest", type=text, help="refuse (exit 2) when this filesystem lacks the space")
    p.set_defaults(func=_plan)

    hubp = sub.add_parser("hub", help="local HF-compatible endpoint: a site's model mirror, a "
                                      "cluster head's checkpoint for its workers (docs/hub.md)")
    hsub = hubp.add_subparsers(dest="hub_command", metavar="SUBCOMMAND", required=True)
    p = _command(hsub, "serve", "serve ROOT/<org>/<name> repos over HTTP; a folder is served when "
                                f"it holds {MARKER} (touch it)")
    p.add_argument("--root", required=True, type=text, help="folder of <org>/<name> repo folders")
    p.add_argument("--host", default="127.0.0.1", type=text, help="address to bind (default "
                   "loopback; anything else warns when no token is set)")
    p.add_argument("--port", type=argtypes.port, default=8089, help="0-65535; 0 picks a free port")
    p.add_argument("--token-file", type=text,
                   help="file with the accepted bearer tokens, one per line (default: "
                        f"{TOKENS_ENV}, comma or newline separated; neither: no token needed)")
    p.add_argument("--verbose", action="store_true", help="log requests to stderr")
    p.set_defaults(func=_serve)


def _token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, else a checked ``HF_TOKEN`` (None: no token); also settles the
    endpoint: ``HF_ENDPOINT`` is checked exactly like --endpoint where it would be used."""
    from sparkspec.hub.source import env_token, read_token_file

    if args.endpoint is None and not args.local_path and os.environ.get("HF_ENDPOINT"):
        try:
            args.endpoint = _url(os.environ["HF_ENDPOINT"])
        except UserError as exc:
            raise UserError(f"HF_ENDPOINT: {exc}") from None
    return read_token_file(args.token_file) if args.token_file else env_token()


def _finish(args: argparse.Namespace, doc: dict[str, Any], line: str) -> int:
    print(line, file=sys.stderr)
    if args.json:
        emit_json(doc)
    return 0


def _repo(args: argparse.Namespace, note: str = "") -> tuple[dict[str, Any], str]:
    from sparkspec.hub import fetch as hub

    token = _token(args)
    with progress.optional(args.progress_file, f"fetch {args.repo}{note}") as counter:
        result = hub.fetch_repo(args.repo, args.revision, args.dest, args.include,
                                token=token, endpoint=args.endpoint,
                                local_path=args.local_path, progress=counter)
    return result.as_json(), (f"fetch: {args.repo}@{result.commit[:12]} -> {args.dest}: "
                              f"{len(result.files)} files, {result.bytes_fetched} bytes fetched")


def _subset(args: argparse.Namespace, note: str = "") -> tuple[dict[str, Any], str]:
    from sparkspec.hub import fetch as hub

    token = _token(args)
    with progress.optional(args.progress_file,
                           f"fetch FP8 tensors of {args.repo}{note}") as counter:
        result = hub.fetch_fp8_subset(args.repo, args.revision, args.int4, args.dest,
                                      args.fp8_pattern, token=token, endpoint=args.endpoint,
                                      local_path=args.local_path, mode=args.mode,
                                      retries=args.retries, progress=counter)
    ratio = (result.tensor_bytes_fetched / result.tensor_bytes_used if result.tensor_bytes_used
             else 0.0)
    return result.as_json(), (
        f"fetch: {result.tensors} FP8 tensors of {args.repo}@{result.commit[:12]} -> "
        f"{args.dest}: tensor bytes fetched {result.tensor_bytes_fetched} / used "
        f"{result.tensor_bytes_used} ({ratio:.3f}x), headers {result.header_bytes}")


def _item(number: int, args: argparse.Namespace, argv: list[str] | None = None) -> Any:
    """A parsed fetch as a :class:`sparkspec.hub.dest.Item`: its --dest, the folders it reads."""
    from sparkspec.hub.dest import Item

    inputs = {"--int4": getattr(args, "int4", None), "--local-path": args.local_path}
    return Item(number, args.dest, {k: v for k, v in inputs.items() if v is not None},
                tuple(argv or ()))


def _fetch_repo(args: argparse.Namespace) -> int:
    from sparkspec.hub.dest import check_batch

    check_batch([_item(1, args)], args.progress_file)
    return _finish(args, *_repo(args))


def _fetch_subset(args: argparse.Namespace) -> int:
    from sparkspec.checkpoint.selection import compile_patterns
    from sparkspec.hub.dest import check_batch

    compile_patterns(args.fp8_pattern)  # a bad --fp8-pattern is refused before anything is fetched
    check_batch([_item(1, args)], args.progress_file)
    return _finish(args, *_subset(args))


MAX_ITEMS = 256


def _items(text: str) -> list[list[str]]:
    """--items: a JSON list of argument lists (strings), at most MAX_ITEMS."""
    from sparkspec.jsonfile import JsonShapeError, loads_bounded

    try:
        value = loads_bounded(text, max_bytes=1 << 20)
    except (JsonShapeError, ValueError):
        value = None
    if (not isinstance(value, list) or not value or len(value) > MAX_ITEMS or not all(
            isinstance(a, list) and a and all(isinstance(w, str) for w in a) for a in value)):
        raise argparse.ArgumentTypeError(
            f"not a JSON list of 1-{MAX_ITEMS} argument lists of strings, e.g. "
            '[["repo", "org/name", "--revision", "main", "--dest", "/srv/x"]]')
    return value


def _fetch_batch(args: argparse.Namespace) -> int:
    """Each item is parsed by the same ``fetch repo`` / ``fetch fp8-subset`` parser, then the items
    are checked as a whole (:func:`sparkspec.hub.dest.check_batch`: all refused in one line before
    anything is fetched or created), then fetched in order: an item may read what one before it
    fetched (the FP8 subset reads the INT4 folder). One process: the CLI starts once per plan."""
    from sparkspec.checkpoint.selection import compile_patterns
    from sparkspec.cli.common import Parser
    from sparkspec.hub.dest import check_batch

    items = []
    for number, argv in enumerate(args.items, 1):
        where = f"sparkspec fetch batch item {number}"
        if argv[0] not in ("repo", "fp8-subset"):
            raise UserError(f"--items: item {number} is {argv[0][:40]!r}; each item is a "
                            "`fetch repo` or `fetch fp8-subset` command line")
        flags = (w.split("=", 1)[0] for w in argv)
        own = [f for f in flags if f in ("--json", "--progress-file", "-h", "--help")]
        if own:
            raise UserError(f"--items: item {number} sets {own[0]}, which is the batch's own; "
                            "drop it from the item")
        parser = Parser(prog=where)
        _fetch_commands(parser.add_subparsers(dest="fetch_command", metavar="SUBCOMMAND",
                                              required=True))
        try:
            item = parser.parse_args(argv)
        except SystemExit as exc:  # the parser printed its one line
            return int(exc.code or 2)
        if item.fetch_command == "fp8-subset":
            compile_patterns(item.fp8_pattern)
        items.append(item)
    pairs = zip(items, args.items, strict=True)
    check_batch([_item(n, item, argv) for n, (item, argv) in enumerate(pairs, 1)],
                args.progress_file)
    docs = []
    for number, item in enumerate(items, 1):
        item.progress_file = args.progress_file
        run = _subset if item.fetch_command == "fp8-subset" else _repo
        doc, line = run(item, f" ({number} of {len(items)})" if len(items) > 1 else "")
        print(line, file=sys.stderr, flush=True)
        docs.append(doc)
    if args.json:
        emit_json({"changed": any(d.get("changed") for d in docs), "results": docs})
    return 0


def _plan(args: argparse.Namespace) -> int:
    from sparkspec.hub import fetch as hub
    from sparkspec.hub.dest import claim, preflight
    from sparkspec.hub.source import Source

    if args.dest:  # the checks a fetch into --dest would make first
        claim(Path(args.dest), {"--local-path": args.local_path})
    token = _token(args)  # first: it may take the endpoint from HF_ENDPOINT
    source = Source(args.repo, args.revision, args.endpoint, token, args.local_path)
    plan = hub.plan(source, args.include)
    if args.dest:
        preflight(Path(args.dest), plan.total_bytes)
    doc = {"changed": False, "repo": args.repo, "commit": plan.commit, "files": plan.files,
           "bytes_needed": plan.total_bytes, "bytes_fetched": 0}
    return _finish(args, doc, f"plan: {args.repo}@{plan.commit[:12]}: {len(plan.files)} files, "
                              f"{plan.total_bytes} bytes")


def _serve(args: argparse.Namespace) -> int:
    from sparkspec.hub.server import HubServer

    root = Path(args.root)
    if not root.is_dir():
        raise UserError(f"--root {root}: not a directory; give the folder that holds the "
                        "<org>/<name> repo folders")
    tokens, warnings = _serve_tokens(args.token_file, root)
    try:
        server = HubServer(root, args.host, args.port, tokens, verbose=args.verbose)
    except OSError as exc:
        raise UserError(f"--host {args.host} --port {args.port}: cannot listen "
                        f"({exc.strerror or exc}); pick another --port or --host") from None
    if not tokens and not _loopback(args.host):
        warnings.append(f"hub serve binds {args.host} without a token: anyone who reaches "
                        f"{server.url} can read every repo under {root.resolve()}; set "
                        f"--token-file or {TOKENS_ENV}")
    signal.signal(signal.SIGTERM, _interrupt)
    try:  # from here a SIGTERM is a clean stop (exit 0)
        for warning in warnings:
            print(f"sparkspec: warning: {warning}", file=sys.stderr, flush=True)
        _announce(server, root)
        print(f"hub: serving {root.resolve()} at {server.url} "
              f"(tokens: {'on' if tokens else 'off'})", file=sys.stderr, flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def _announce(server: HubServer, root: Path) -> None:
    """One line per served repo with its revision. Where no revision file names the commit, the
    files are hashed here (once: the digests are kept beside them): the first client never waits."""
    from sparkspec.hub.api import HubError

    names = server.repos.names()
    if not names:
        print(f"sparkspec: warning: no repo to serve under {root.resolve()}: a folder "
              f"<org>/<name> is served when it holds {MARKER}; touch it in each folder to serve",
              file=sys.stderr, flush=True)
    for repo in names:
        try:
            org, _, name = repo.partition("/")
            snap = server.repos.snapshot(org, name, "main")
        except HubError as exc:
            print(f"sparkspec: warning: hub: {repo}: {exc.message}; not served",
                  file=sys.stderr, flush=True)
            continue
        print(f"hub: {repo}@{snap.commit} ({len(snap.files)} files)", file=sys.stderr, flush=True)


def _serve_tokens(token_file: str | None, root: Path) -> tuple[list[str], list[str]]:
    """The accepted tokens (and warnings): from ``token_file`` (one per line, not readable by every
    user), else ``$SPARKSPEC_HUB_TOKENS`` (comma or newline separated), else none. Set but holding
    no token is refused, never taken for "no token needed". Never from argv, which ps shows."""
    warnings: list[str] = []
    if token_file:
        where = f"--token-file {token_file}"
        if validate.real(token_file).is_relative_to(validate.real(root)):
            raise UserError(f"{where} is inside --root, which the hub may serve; keep it "
                            "outside")
        raw = validate.read_regular(token_file, "token file", 1 << 20)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{where}: is not UTF-8 text; write one token per line") from None
    elif TOKENS_ENV in os.environ:
        where, text = TOKENS_ENV, os.environ[TOKENS_ENV]
    else:
        return [], warnings
    tokens = [t.strip() for t in re.split(r"[,\n]", text) if t.strip()]
    if not tokens:  # set but empty: serving without tokens would fail open
        raise UserError(f"{where}: holds no token; give one token per line (or comma separated in "
                        f"{TOKENS_ENV}), or unset {TOKENS_ENV} to serve without tokens")
    if any(re.search(r"[\x00-\x20\x7f]", t) for t in tokens):
        raise UserError(f"{where}: a token holds a space or control character; write one token "
                        "per line")
    if token_file:
        from sparkspec.hub.repo import check_private

        check_private(token_file, "token file")
    return tokens, warnings


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name may resolve anywhere
        return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
