"""``sparkspec checkpoint assemble|add-mtp|verify|build|check-head``.

Run on the host, in this order: assemble (INT4 shards with the shared-expert layers in FP8),
add-mtp (register the MTP head), verify; ``build`` runs the three in one process (what a provision
runs). The generator of tiny checkpoints in the real formats lives with the tests
(``python -m tests.support checkpoint generate``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sparkspec import figures, progress
from sparkspec.argtypes import non_negative_int
from sparkspec.cli.common import emit_json
from sparkspec.errors import UserError, os_error
from sparkspec.registry.data import HEAD_KINDS

FP8_PATTERN_HELP = (
    "regular expression (re.search on the module name, e.g. 'mlp\\.experts\\.') selecting more "
    "INT4 modules to take in FP8 when the FP8 checkpoint has X.weight F8_E4M3 + "
    "X.weight_scale_inv; repeatable. Consequence: those layers double in size (FP8 is 8 bits, "
    "INT4 4), the patched inc.py must serve them with the FP8 method, and fused groups (q/k/v, "
    "gate/up, in_proj_qkv/z, in_proj_b/a) must be covered whole or not at all")


def _warn(message: str) -> None:
    print(f"sparkspec: warning: {message}", file=sys.stderr)


def summary(args: argparse.Namespace, line: str, doc: dict[str, Any]) -> int:
    """The summary line (on stderr when --json keeps stdout for the final JSON line), then that
    line."""
    print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        emit_json(doc)
    return 0


@contextmanager
def os_errors(fix: str) -> Iterator[None]:
    """An OSError no step turned into its own line (an unreadable source folder, an I/O error while
    verify re-hashes): one line naming the file, exit 2 for a path to fix, 1 for a run-time
    failure."""
    try:
        yield
    except OSError as exc:
        raise os_error(exc, exc.filename or "checkpoint", fix) from None


Start = Callable[[int], Callable[[int], None] | None]  # start(total bytes) -> advance(n bytes)


@contextmanager
def _progress(args: argparse.Namespace, label: str) -> Iterator[Start | None]:
    """One byte count for both: the bar a person at a terminal sees, and --progress-file for a
    play."""
    apart = {"--int4": args.int4, "--fp8": args.fp8, "--out": args.out}
    with (progress.optional(args.progress_file, label, apart=apart) as pfile,
          _bar(not args.json, label) as bar):
        if pfile is None:
            yield bar
            return

        def start(total: int) -> Callable[[int], None]:
            pfile.set_total(total)
            tick = bar(total) if bar else None

            def advance(n: int) -> None:
                pfile.add(n)
                if tick:
                    tick(n)

            return advance

        yield start


@contextmanager
def _bar(enabled: bool, label: str) -> Iterator[Start | None]:
    """A rich byte progress bar on stderr, only for a person at a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                  transient=True) as bar:
        def start(total: int) -> Callable[[int], None]:
            task = bar.add_task(label, total=total)
            return lambda n: bar.advance(task, n)

        yield start


def _run_assemble(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from sparkspec.checkpoint.assemble import assemble

    label = f"assemble {Path(args.out).name}"
    with os_errors("check the path and its permissions"), _progress(args, label) as start:
        result = assemble(Path(args.int4), args.fp8 and Path(args.fp8), Path(args.out),
                          args.fp8_pattern or [], args.expect_fp8, start)
    for warning in result.warnings:
        _warn(warning)
    verb = "assembled" if result.changed else "up to date (no-op)"
    return (f"{result.out}: {verb}; {result.tensors} tensors, {result.fp8_layers} layers in FP8"
            f"{'' if result.expected_fp8 is None else f' (expected {result.expected_fp8})'}, "
            f"{figures.size(result.total_size)}; next: sparkspec checkpoint "
            "add-mtp"), result.as_dict()


def _assemble(args: argparse.Namespace) -> int:
    return summary(args, *_run_assemble(args))


def _run_add_mtp(source: str, target: str) -> tuple[str, dict[str, Any]]:
    from sparkspec.checkpoint.mtp import add_mtp

    with os_errors("check the path and its permissions, then re-run add-mtp"):
        result = add_mtp(Path(source), Path(target))
    state = "changed" if result.changed else "already registered, no-op"
    return (f"{result.target}: {result.mtp_tensors} MTP tensors registered ({state}; file "
            f"{result.file_action})"), result.as_dict()


def _add_mtp(args: argparse.Namespace) -> int:
    return summary(args, *_run_add_mtp(args.source, args.target))


def _run_verify(directory: str, expect_mtp: int | None, load: bool, full: bool, out: Any,
                emit: Callable[[dict[str, Any]], None] | None) -> tuple[str, dict[str, Any]]:
    """verify's notes and loader line to ``out``; its report to ``emit`` (before a problem is
    raised)."""
    from sparkspec.checkpoint.verify import verify

    with os_errors("check the checkpoint folder and the disk"):
        report = verify(Path(directory), expect_mtp, load_sample=load, full=full)
    for note in report.notes:
        print(f"note: {note}", file=out)
    print(report.loader, file=out)
    if emit:
        emit(report.as_dict())
    if report.problems:
        for problem in report.problems[1:]:
            print(f"problem: {problem}", file=out)
        more = f" (+{len(report.problems) - 1} more above)" if len(report.problems) > 1 else ""
        raise UserError(f"{report.problems[0]}{more}")
    return (
        f"{report.directory}: OK; {report.files} files, {report.tensors} tensors, "
        f"{report.mtp} MTP, {report.fp8_weights} FP8 weights, total_size {report.total_size}"
        f"{f', {report.rehashed} files re-hashed against the manifest' if report.rehashed else ''}"
    ), report.as_dict()


def _verify(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    line, _ = _run_verify(args.dir, args.expect_mtp, not args.no_load, args.full, out,
                          emit_json if args.json else None)
    print(line, file=out)
    return 0


def _build_checks(args: argparse.Namespace) -> None:
    """What would stop add-mtp or verify after assemble wrote, checked before: the head in --int4
    and the MTP count verify will expect (from --expect-mtp or the config, by verify's own rule)."""
    from sparkspec.checkpoint.mtp import check_source
    from sparkspec.checkpoint.verify import expected_mtp_from_config

    int4 = Path(args.int4)
    with os_errors("check the path and its permissions"):
        src, _, names = check_source(int4)
        expect = (args.expect_mtp if args.expect_mtp is not None
                  else expected_mtp_from_config(int4)[0])
    count = sum(1 for n in names if not n.endswith("_scale_inv"))
    if expect is not None and count != expect:
        how = "--expect-mtp" if args.expect_mtp is not None else f"{int4 / 'config.json'}"
        raise UserError(f"{src}: holds {count} MTP tensors but {how} expects {expect}, so verify "
                        "would refuse the hybrid; fix --expect-mtp or re-fetch the INT4 checkpoint")


def _build(args: argparse.Namespace) -> int:
    """assemble, add-mtp (from the INT4 folder) and verify in one process (a provision runs this per
    hybrid profile): verify re-hashes every file (--full) after an assemble that wrote something.
    add-mtp's and verify's checks of the inputs run first, so a build they would stop writes
    nothing."""
    from sparkspec.checkpoint.assemble import check_output

    out = sys.stderr if args.json else sys.stdout
    check_output(Path(args.int4), args.fp8 and Path(args.fp8), Path(args.out))
    _build_checks(args)
    line, assembled = _run_assemble(args)
    print(line, file=out)
    line, mtp = _run_add_mtp(args.int4, args.out)
    print(line, file=out)
    line, verified = _run_verify(args.out, args.expect_mtp, not args.no_load,
                                 bool(assembled["changed"]), out, None)
    print(line, file=out)
    if args.json:
        emit_json({"changed": bool(assembled["changed"] or mtp["changed"]), "assemble": assembled,
                   "mtp": mtp, "verify": verified})
    return 0


def _check_head(args: argparse.Namespace) -> int:
    from sparkspec.checkpoint.heads import check_head

    r = check_head(args.method, args.head, args.target, args.k)
    ids = f", aux layers {r.aux_layers}" if r.aux_layers else ""
    return summary(args, f"{r.head}: {r.method} head OK for {args.target} ({r.architecture}, "
                         f"hidden {r.hidden_size}{ids} of {r.target_layers} target layers, "
                         f"{r.tensors} tensors)",
                   r.as_dict())


def _digest(args: argparse.Namespace) -> int:
    from sparkspec.checkpoint.manifest import fingerprint

    r = fingerprint(Path(args.dir))
    return summary(args, f"{args.dir}: {r['digest']} ({r['files']} files, from the "
                         f"{r['source']})", r)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ckpt = sub.add_parser("checkpoint",
                          help="assemble, register MTP and verify the hybrid checkpoint")
    cmds = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ckpt.set_defaults(func=lambda args: (ckpt.print_help(), 2)[1])

    p = cmds.add_parser("assemble",
                        help="INT4 shards with the layers the FP8 checkpoint has in FP8")
    _assemble_options(p)
    p.set_defaults(func=_assemble)

    p = cmds.add_parser("build", help="assemble, then add-mtp from --int4, then verify (--full "
                                      "after an assemble that wrote), in one run")
    _assemble_options(p)
    _verify_options(p)
    p.set_defaults(func=_build)

    p = cmds.add_parser("add-mtp",
                        help="register model_extra_tensors.safetensors' MTP head in the index")
    p.add_argument("--source", required=True,
                   help="directory holding model_extra_tensors.safetensors")
    p.add_argument("--target", required=True, help="assembled checkpoint directory")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.set_defaults(func=_add_mtp)

    p = cmds.add_parser("verify", help="index, headers, total_size, MTP count and a loader sample")
    p.add_argument("dir", help="checkpoint directory")
    _verify_options(p)
    p.add_argument("--full", action="store_true",
                   help="re-hash every file assemble wrote against its manifest's digests (reads "
                        "all data); without it, only files whose size, times or inode changed "
                        "since are re-hashed")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.set_defaults(func=_verify)

    p = cmds.add_parser("digest",
                        help="one digest of a checkpoint folder (a cluster's nodes compare theirs)")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.set_defaults(func=_digest)

    p = cmds.add_parser("check-head",
                        help="an EAGLE3 or DFlash head fits its target (configs and headers only)")
    p.add_argument("--method", required=True, choices=HEAD_KINDS, help="the head's method")
    p.add_argument("--head", required=True,
                   help="the head's folder (config.json and *.safetensors)")
    p.add_argument("--target", required=True, help="the target model's folder (its config.json)")
    p.add_argument("--k", type=int, default=None,
                   help="the method's num_speculative_tokens (DFlash: must fit the head's block)")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.set_defaults(func=_check_head)


def _verify_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expect-mtp", type=non_negative_int, metavar="N",
                   help="mtp.* tensors the index must map (default: 4 + L x (3 x experts + 13) "
                        "from config.json)")
    p.add_argument("--no-load", action="store_true", help="skip the fastsafetensors sample load")


def _assemble_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--int4", required=True,
                   help="AutoRound INT4 checkpoint directory (source, read only)")
    p.add_argument("--fp8", help="FP8 checkpoint directory, whole or the ranged-fetch subset "
                   "(without it: the INT4 checkpoint alone, no layer in FP8, for add-mtp to "
                   "register its MTP head)")
    p.add_argument("--out", required=True,
                   help="output directory (built in a temp sibling, renamed at the end)")
    p.add_argument("--fp8-pattern", action="append", metavar="REGEX", help=FP8_PATTERN_HELP)
    p.add_argument("--expect-fp8", type=non_negative_int, metavar="N",
                   help="warn unless N layers are taken in FP8 (default 3 x num_hidden_layers: 144 "
                        "for the 122B)")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.add_argument("--progress-file", metavar="PATH", help=progress.HELP)
