"""The registry's typed values, each checked whole: names, folders, serve knob values,
speculative_config values, the service's port and address, and vLLM's secret options.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from sparkspec import systemd, validate
from sparkspec.errors import UserError
from sparkspec.registry.data import (
    MAX_INT,
    MAX_SPECULATIVE_TOKENS,
    NAMES,
    SECRET_HOMES,
    SECRET_OPTIONS,
    SECRET_PREFIX_OPTIONS,
)

_PATTERNS = {kind: re.compile(pattern) for kind, (pattern, _) in NAMES.items()}
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.:/@+-]{1,128}")
# RFC 1123 host names: dot-separated labels of letters, digits and '-', neither first nor last, at
# most 253 characters; the last label not all digits (that would be a malformed IPv4 address).
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
SECRET_KNOBS = {opt[2:].replace("-", "_"): opt for opt in SECRET_OPTIONS}


class RegistryError(UserError):
    """A method, profile or switch record that cannot be used;
    the message names the key and the fix."""


def fail(where: str, what: str) -> RegistryError:
    return RegistryError(f"{where}: {what}")


def show(value: Any, limit: int = 80) -> str:
    """A value as an error line shows it:
    repr (every control or separator character escaped), cut short."""
    try:
        text = repr(value)
    except ValueError:   # an integer too long to print (Python's int_max_str_digits)
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def key(name: Any) -> str:
    """An inventory key as an error names it: as written when plain, else quoted (a key holding a
    line break or a quote cannot break the line)."""
    text = str(name) if isinstance(name, str | int) and not isinstance(name, bool) else ""
    return text if _PLAIN_KEY.fullmatch(text) else show(name, 60)


def name(value: Any, kind: str, where: str, fix: str) -> str:
    """A name of ``kind`` (a key of :data:`.data.NAMES`), matched whole."""
    if isinstance(value, str) and _PATTERNS[kind].fullmatch(value):
        return value
    label = kind.replace("_", " ").replace("vllm", "vLLM")
    raise fail(where, f"{show(value)} is not a {label}{'' if label.endswith('name') else ' name'} "
                      f"({NAMES[kind][1]}); {fix}")


def folder(value: Any, where: str, fix: str = "give the folder's full path") -> str:
    """An absolute, normalised folder that the unit can
    carry as a path (ReadOnlyPaths=, ReadWritePaths=)."""
    try:
        validate.absolute_path(value, "path")
    except UserError as exc:
        raise fail(where, f"{str(exc).rsplit(';', 1)[0]}; {fix}") from None
    _unit_can_carry(systemd.path_list_item, value, where, fix)
    return str(value)


def venv(value: Any, where: str, fix: str = "give the venv's full path, or drop it") -> str:
    """A venv folder whose bin/python the unit runs as ExecStart's executable
    (:func:`sparkspec.systemd.executable`)."""
    folder(value, where, fix)
    _unit_can_carry(systemd.executable, f"{value}/bin/python", where, fix)
    return str(value)


def _unit_can_carry(quote: Callable[[object, str], str], value: str, where: str, fix: str) -> None:
    try:
        quote(value, where)
    except UserError as exc:
        raise RegistryError(f"{str(exc).rsplit(';', 1)[0]}; {fix}") from None


def integer(value: Any, where: str, low: int, high: int = MAX_INT, fix: str = "fix it") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise fail(where, f"{show(value)} is not an integer in {low}..{high}; {fix}")
    return value


def number(value: Any, where: str, fix: str = "fix it") -> float:
    """A finite int or float (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise fail(where, f"{show(value)} is not a finite number; {fix}")
    return value


def text(value: Any, where: str, fix: str = "give a string without control characters") -> str:
    if not isinstance(value, str) or validate.has_control(value):
        raise fail(where, f"{show(value)} is not a string without control characters or line "
                          f"breaks; {fix}")
    return lands(value, where)


def lands(value: str, where: str) -> str:
    """A string that becomes a word of the unit's ExecStart, checked here, at resolve, by the
    quoting rule the unit template applies (:func:`sparkspec.systemd.word`), so what the unit cannot
    carry exactly stops the play before anything renders."""
    try:
        systemd.word(value, where)
    except UserError as exc:
        raise RegistryError(str(exc)) from None
    return value


def _unset(value: Any) -> bool:
    return value is None or value == ""


def _flag(value: Any, where: str, null: bool) -> Any:
    if isinstance(value, bool) or (null and value is None):
        return value
    raise fail(where, f"{show(value)} is not true or false"
                      f"{' or null (the default)' if null else ''}; write true or false, unquoted")


def _generation_config(value: Any, where: str) -> Any:
    if _unset(value) or value in ("auto", "vllm"):
        return value
    return folder(value, where, "give auto, vllm, or the full path of a folder holding "
                                "generation_config.json")


def _overrides(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail(where, f"is a {type(value).__name__}, not a mapping; e.g. {{temperature: 0.6}}")
    for field, item in value.items():
        at = f"{where}.{key(field)}"
        name(field, "generation_field", at, "use a field of the model's generation_config.json")
        for one in item if isinstance(item, list) else [item]:
            if not isinstance(one, bool | str):
                number(one, at, "give a number, a string, a boolean or a list of them")
            elif isinstance(one, str):
                text(one, at)
    return dict(value)


def secret_option(arg: str) -> str | None:
    """The secret option of vLLM's (:data:`.data.SECRET_OPTIONS`) that ``arg`` sets as vLLM 0.32.0's
    parser reads it: --NAME, --NAME=VALUE, --NAME.FIELD, '_' for '-', and any prefix (argparse
    expands a unique one; one that is not unique vLLM refuses anyway) that is not an option of its
    own, in any case; None for any other argument."""
    if not arg.startswith("--"):
        return None
    flag = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()
    if f"--{flag}" in SECRET_PREFIX_OPTIONS:   # an option of its own, matched exactly first
        return None
    return next((opt for opt in SECRET_OPTIONS if flag and opt[2:].startswith(flag)), None)


def _args(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise fail(where,
                   "is not a list of vLLM arguments; give a list, e.g. [--max-num-seqs, '8']")
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            raise fail(where, f"item {i} ({show(arg)}) is not a string; quote it (vLLM's arguments "
                              "are strings, e.g. '8')")
        if validate.has_control(arg):
            raise fail(where, f"item {i} ({show(arg)}) holds a control character or line break (it "
                              "would end the unit's ExecStart line); remove it")
        lands(arg, f"{where}[{i}]")
        if (opt := secret_option(arg)) is not None:
            raise fail(where, f"{arg.split('=', 1)[0]} (item {i}) is vLLM's {opt}, a secret on "
                              "vLLM's command line, where every process list shows it; remove it "
                              f"and {SECRET_HOMES[opt]}")
    return list(value)


def _or_unset(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, where: value if _unset(value) else check(value, where)


def _fraction(value: Any, where: str) -> Any:
    if number(value, where, "give a number in (0, 1], e.g. 0.9") <= 0 or value > 1:
        raise fail(where, f"{show(value)} is not in (0, 1]; give the share of GPU memory, e.g. 0.9")
    return value


_KNOB_KINDS: dict[str, Callable[[Any, str], Any]] = {
    "count": _or_unset(lambda v, w: integer(v, w, 1, fix="give a positive integer, or null for "
                                                         "vLLM's default")),
    "fraction": _or_unset(_fraction),
    "name": _or_unset(lambda v, w: name(v, "vllm_name", w,
                                        "give the name vLLM registers, or null")),
    "backend": _or_unset(lambda v, w: name(v, "backend", w, "give a vLLM attention backend, e.g. "
                                                            "FLASHINFER, or null")),
    "flag": lambda v, w: _flag(v, w, False),
    "flag_or_null": lambda v, w: _flag(v, w, True),
    "generation_config": _generation_config,
    "overrides": _overrides,
    "args": _args,
}


def knob(kind: str, value: Any, where: str) -> Any:
    """A serve knob's value by its kind (:data:`.data.SERVE`)."""
    return _KNOB_KINDS[kind](value, where)


def secret_knob(field: Any, where: str) -> None:
    """A serve block's key that names a secret option
    (api_key, hf_token, ...): refused, naming its place."""
    opt = SECRET_KNOBS.get(str(field).replace("-", "_").lower())
    if opt is not None:
        raise fail(f"{where}.{key(field)}",
                   f"is vLLM's {opt}, a secret, and a serve knob is a command-line argument; "
                   f"remove it and {SECRET_HOMES[opt]}")


def _model(value: Any, where: str) -> str:
    if isinstance(value, str) and value.startswith("/"):
        return folder(value, where, "give the draft model's folder, or its hub repo id")
    try:
        return validate.repo_id(value, "model")
    except UserError as exc:
        raise fail(where, f"{exc}; or the draft model's full path") from None


def _revision(value: Any, where: str) -> str:
    try:
        return validate.revision(value)
    except UserError as exc:
        raise fail(where, str(exc)) from None


def json_value(value: Any, where: str, depth: int = 0) -> Any:
    """A value JSON carries exactly: null, a boolean, an integer, a finite number, a string without
    control characters, or a list or mapping (string keys) of them, at most 8 deep."""
    if depth > 8:
        raise fail(where, "nests deeper than 8 levels; flatten it")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return (number(value, where) if isinstance(value, float)
                else integer(value, where, -2**63, 2**63 - 1))
    if isinstance(value, str):
        return text(value, where)
    if isinstance(value, list):
        return [json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str) or validate.has_control(k):
                raise fail(f"{where}.{key(k)}", "is not a plain string key; fix it")
        return {k: json_value(v, f"{where}.{key(k)}", depth + 1) for k, v in value.items()}
    raise fail(where, f"a {type(value).__name__} is not a JSON value; give a string, number, list "
                      "or mapping")


_POSITIVE = "give an integer >= 1"


def _tokens(value: Any, where: str) -> int:
    """k: > 0 (vLLM, speculative.py:393) and <= 64
    (our bound: no public drafter is trained for more)."""
    if (isinstance(value, bool) or not isinstance(value, int)
            or not 1 <= value <= MAX_SPECULATIVE_TOKENS):
        raise fail(where, f"{show(value)}; set it to an integer k > 0 and <= "
                          f"{MAX_SPECULATIVE_TOKENS} (a larger k drafts more than any public "
                          "drafter is trained for)")
    return value
# The speculative_config fields inventories set, by type (vLLM 0.32.0's SpeculativeConfig,
# vllm/config/speculative.py:386-608); any other field is a JSON value (:func:`json_value`).
SPEC_VALUES: dict[str, Callable[[Any, str], Any]] = {
    "method": lambda v, w: name(v, "spec_method", w,
                                "set it to ngram|mtp|eagle3|dflash|draft_model|..."),
    "num_speculative_tokens": lambda v, w: _tokens(v, w),
    # ge=1: speculative.py:470-473
    "prompt_lookup_min": lambda v, w: integer(v, w, 1, fix=_POSITIVE),
    "prompt_lookup_max": lambda v, w: integer(v, w, 1, fix=_POSITIVE),
    # ge=1: speculative.py:407
    "draft_tensor_parallel_size": lambda v, w: integer(v, w, 1, fix=_POSITIVE),
    "max_model_len": lambda v, w: integer(v, w, 1, fix=_POSITIVE),  # ge=1: speculative.py:431
    "attention_backend": lambda v, w: name(v, "backend", w,
                                           "give a vLLM attention backend, e.g. FLASHINFER"),
    "quantization": lambda v, w: name(v, "vllm_name", w,
                                      "give a quantization vLLM registers, or drop it"),
    "model": _model,
    "revision": _revision,
    "code_revision": _revision,
}


def spec_value(field: str, value: Any, where: str) -> Any:
    if field in SPEC_VALUES and value is not None:
        return SPEC_VALUES[field](value, where)
    return json_value(value, where)


def port(value: Any, where: str) -> int:
    """A TCP port, 1-65535: an integer, or its decimal
    digits (an extra var given on the command line)."""
    number_ = (int(value) if isinstance(value, str) and re.fullmatch(r"[1-9][0-9]{0,4}", value)
               else value)
    return integer(number_, where, 1, 65535, "give a TCP port, e.g. 8000")


def address(value: Any, where: str) -> str:
    """An address to bind: a literal IPv4 or IPv6 address (no zone index: '%' is a systemd
    specifier) or an RFC 1123 host name."""
    if isinstance(value, str) and "%" not in value:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            labels = value.split(".")
            if (len(value) <= 253 and all(_LABEL.fullmatch(label) for label in labels)
                    and not labels[-1].isdigit()):
                return value
    raise fail(where, f"{show(value)} is not an IP address or host name; give e.g. 127.0.0.1 (this "
                      "host only) or 0.0.0.0 (the LAN; then set sparkspec_api_key)")
