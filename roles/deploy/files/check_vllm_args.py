"""Check a vLLM command line with the installed vLLM's own argument parser (run by the deploy role).

Usage: <vllm venv>/bin/python check_vllm_args.py [--cache DIR] ARG... | --records;
       exit 0 accepted, 2 refused.
"""

import contextlib
import dataclasses
import difflib
import hashlib
import io
import json
import os
import sys

# on the host the deploy puts sparkspec_host.py beside this file; in the checkout it is the
# contract role's
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.append(os.path.join(_HERE, "..", "..", "sparkspec", "module_utils"))
from sparkspec_host import vllm_identity  # noqa: E402


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


def spec_fields() -> frozenset:
    """The installed vLLM's SpeculativeConfig fields (a pydantic dataclass; imported with the parser
    already)."""
    from vllm.config import SpeculativeConfig
    return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig))


def refusal(parser, fields: frozenset, argv: list[str]) -> str:
    """Empty when the parser accepts argv and every speculative config key is a field, else the
    message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            namespace = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            return f"vLLM refused the command line: {lines[-1] if lines else exc.code}"
        return ""
    spec = getattr(namespace, "speculative_config", None)
    for key in spec if isinstance(spec, dict) else ():
        if str(key).replace("-", "_") not in fields:
            close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(fields), 1, 0.5)
            return (f"vLLM refused the command line: --speculative-config key {key!r} is not a "
                    "field of this vLLM's SpeculativeConfig (its engine would refuse it at "
                    f"start){'; use ' + close[0] if close else ''}")
    return ""


def cache_key(argv: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (json.dumps(argv).encode(), sys.prefix.encode(), vllm_identity(),
                 open(__file__, "rb").read()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cache"] and len(argv) >= 2:
        key = cache_key(argv[2:])
        if os.path.isfile(os.path.join(argv[1], key)):
            print(f"cached {key}")
            return 0
        code = main(argv[2:])
        if code == 0:
            print(f"checked {key}")
        return code
    parser, fields = make_parser(), spec_fields()
    if argv[:1] == ["--records"]:
        messages = [refusal(parser, fields, args) for args in json.load(sys.stdin)]
        for message in messages:
            print(message or "ok")
        return 2 if any(messages) else 0
    message = refusal(parser, fields, argv)
    if message:
        print(message, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
