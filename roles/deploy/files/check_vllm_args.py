"""Check a vLLM command line with the installed vLLM's own argument parser (run by the deploy role).

Usage: <vllm venv>/bin/python check_vllm_args.py ARG... ; exit 0 when vLLM's parser accepts the
arguments, else exit 2 with the parser's message as one line on stderr. Nothing is started.
With --records, reads a JSON list of argument lists on stdin and prints one line per list ("ok" or the
parser's message), exiting 2 if any was refused (one import of vLLM for many command lines).
"""

import contextlib
import io
import json
import sys


def make_parser():
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # older vLLM releases
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def refusal(parser, argv: list[str]) -> str:
    """Empty when the parser accepts argv, else its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            return f"vLLM refused the command line: {lines[-1] if lines else exc.code}"
    return ""


def main(argv: list[str]) -> int:
    parser = make_parser()
    if argv[:1] == ["--records"]:
        messages = [refusal(parser, args) for args in json.load(sys.stdin)]
        for message in messages:
            print(message or "ok")
        return 2 if any(messages) else 0
    message = refusal(parser, argv)
    if message:
        print(message, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
