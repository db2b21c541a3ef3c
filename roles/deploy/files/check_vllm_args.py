"""Check a vLLM command line with the installed vLLM's own argument parser (run by the deploy role).

Usage: <vllm venv>/bin/python check_vllm_args.py ARG... ; exit 0 when vLLM's parser accepts the
arguments, else exit 2 with the parser's message as one line on stderr. Nothing is started.
"""

import contextlib
import io
import sys


def main(argv: list[str]) -> int:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # older vLLM releases
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            print(f"vLLM refused the command line: {lines[-1] if lines else exc.code}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
