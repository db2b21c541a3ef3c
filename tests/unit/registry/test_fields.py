"""From the inventory to the unit, whole: a value with characters special to systemd, environment
files, the shell or JSON, put into any string field of a method, a profile or a serve block, is
either refused by the registry's schema in one line naming that field, or reaches the rendered unit
(the deploy role's real template with the role's filters, in-process) so that systemd's own rules
(tests/support/systemd_rules.py) read ExecStart back as exactly the argv the registry computed, with
the value in its place; the Description reads back as the record's served model name."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkspec import registry
from sparkspec.errors import UserError
from tests.support import systemd_rules as rules

SPECIAL = list(" \t\n\r\x00\\'\"`$%;{}#=+-@!:/.*?~&|<>()[],é✓\u2028\x7f")
VALUES = (st.text(st.sampled_from(SPECIAL) | st.characters(codec="utf-8"), max_size=16)
          | st.sampled_from(["%n", "$HOME", "${X}", ";", "+/bin/sh", "a b",
                             "x\nExecStartPre=+/bin/sh", '{"a":1}', "\\", "'"]))


def _method(c: dict[str, Any]) -> dict[str, Any]:
    c["method"] = "mine"
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    return c["methods"].setdefault("mine", {"speculative_config": spec})


# field -> (where the value goes in the contract, the key an error names)
FIELDS: dict[str, tuple[Callable[[dict[str, Any], str], None], str]] = {
    "served_model_name": (lambda c, v: c["profiles"]["p"].__setitem__("served_model_name", v),
                          "sparkspec_profiles.p.served_model_name"),
    "profile.serve.tool_call_parser": (
        lambda c, v: c["profiles"]["p"].setdefault("serve", {}).__setitem__("tool_call_parser", v),
        "sparkspec_profiles.p.serve.tool_call_parser"),
    "profile.serve.reasoning_parser": (
        lambda c, v: c["profiles"]["p"].setdefault("serve", {}).__setitem__("reasoning_parser", v),
        "sparkspec_profiles.p.serve.reasoning_parser"),
    "serve.load_format": (lambda c, v: c.setdefault("serve", {}).__setitem__("load_format", v),
                          "sparkspec_serve.load_format"),
    "serve.attention_backend": (
        lambda c, v: c.setdefault("serve", {}).__setitem__("attention_backend", v),
        "sparkspec_serve.attention_backend"),
    "serve.generation_config": (
        lambda c, v: c.setdefault("serve", {}).__setitem__("generation_config", v),
        "sparkspec_serve.generation_config"),
    "serve.extra_args": (
        lambda c, v: c.setdefault("serve", {}).__setitem__("extra_args", ["--x", v]),
        "sparkspec_serve.extra_args"),
    "serve.override_generation_config": (
        lambda c, v: c.setdefault("serve", {}).__setitem__("override_generation_config",
                                                           {"stop": v}),
        "sparkspec_serve.override_generation_config"),
    "method.serve.extra_args": (lambda c, v: _method(c).__setitem__("serve", {"extra_args": [v]}),
                                "sparkspec_methods.mine.serve.extra_args"),
    "method.speculative_config.method": (
        lambda c, v: _method(c)["speculative_config"].__setitem__("method", v),
        "sparkspec_methods.mine.speculative_config.method"),
    "method.speculative_config.attention_backend": (
        lambda c, v: _method(c)["speculative_config"].__setitem__("attention_backend", v),
        "sparkspec_methods.mine.speculative_config.attention_backend"),
    "profile.dir": (lambda c, v: c["profiles"]["p"].__setitem__("dir", v),
                    "sparkspec_profiles.p.dir"),
    "profile.model.revision": (lambda c, v: c["profiles"]["p"]["model"].__setitem__("revision", v),
                               "sparkspec_profiles.p.model.revision"),
    "models_dir": (lambda c, v: c.__setitem__("models_dir", "/opt/" + v), "sparkspec_models_dir"),
    "vllm_venv": (lambda c, v: c.__setitem__("vllm_venv", "/opt/" + v), "sparkspec_vllm_venv"),
}


def _check(field: str, value: str) -> None:
    contract = rules.small_contract()
    put, key = FIELDS[field]
    put(contract, value)
    try:
        resolved = registry.resolve(copy.deepcopy(contract))
    except UserError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message, message
        assert message.startswith(key), (key, message)
        return
    unit, argv = rules.render_resolved(resolved)
    entries = rules.unit_entries(unit)
    [exec_start] = [v for s, k, v in entries if (s, k) == ("Service", "ExecStart")]
    command = rules.exec_command(exec_start)
    assert command.prefixes == "" and command.exec_argv() == argv
    [description] = [v for s, k, v in entries if k == "Description"]
    assert rules.specifiers(description) == (f"vLLM {resolved['profile']['served_model_name']} "
                                             f"({resolved['method']}) by sparkspec")
    # the value is in its place, whole: an argument, in one (a folder, JSON), or what is fetched (a
    # revision)
    shown = argv + [json.dumps(json.loads(a)) for a in argv if a.startswith("{")]
    shown += [d["revision"] for d in registry.downloads(resolved)]
    shown += [json.dumps(v) for a in argv if a.startswith("{") for v in _leaves(json.loads(a))]
    assert any(value in a or json.dumps(value) in a for a in shown), (field, value, argv)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("value", ["plain_1", "%n", "$HOME", ";", "+/bin/sh", "a b", "x\ny",
                                   "\"'\\", "", '{"a":1}'])
def test_each_string_field_is_refused_naming_it_or_reaches_the_unit_exactly(field: str,
                                                                            value: str) -> None:
    _check(field, value)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(FIELDS)), VALUES)
def test_random_values_in_any_string_field_are_refused_or_reach_the_unit_exactly(
        field: str, value: str) -> None:
    _check(field, value)
