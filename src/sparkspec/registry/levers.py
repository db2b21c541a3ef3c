"""Levers (:data:`.data.LEVERS`): the ``levers`` blocks of profiles,
methods and hosts checked and merged, what the unit carries for them,
and what the vLLM release and the model's head must be for each."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import sparkspec.registry.fields as fields
from sparkspec.registry.data import LEVERS, MAX_INT
from sparkspec.registry.fields import fail, key, show

ON_OFF = "true (on), false (off) or a mapping of its options (on unless it says enabled: false)"


def _setting(lever: str, value: Any, where: str) -> dict[str, Any]:
    """One layer's setting of a lever: what it says of ``enabled`` and of the lever's options."""
    if isinstance(value, bool):
        return {"enabled": value}
    if not isinstance(value, Mapping):
        raise fail(where, f"{show(value)} is not {ON_OFF}; fix it")
    defaults = LEVERS[lever]["options"]
    out: dict[str, Any] = {"enabled": True}
    for option, setting in value.items():
        if option == "enabled":
            if not isinstance(setting, bool):
                raise fail(f"{where}.enabled", f"{show(setting)} is not true or false; fix it")
            out["enabled"] = setting
        elif option in defaults:
            out[option] = fields.integer(setting, f"{where}.{option}", 0, MAX_INT,
                                         "give an integer >= 0")
            choices = LEVERS[lever].get("choices", {}).get(option)
            if choices and out[option] not in choices:
                allowed = ", ".join(map(str, choices))
                raise fail(f"{where}.{option}", f"{show(setting)} is not one of {allowed} "
                                                "(docs/methods.md#levers); fix it")
        else:
            raise fail(f"{where}.{key(option)}", f"not an option of lever {lever}; use enabled"
                                                 f"{''.join(', ' + o for o in defaults)}")
    return out


def check_levers(value: Any, where: str) -> dict[str, dict[str, Any]]:
    """A ``levers`` block: a mapping of lever name to :data:`ON_OFF`, or a list of lever names (all
    on). Returns each lever's setting (``enabled`` and the options it gives). An unknown or
    malformed name is refused in one line."""
    if value is None:
        return {}
    if isinstance(value, list):
        for i, name in enumerate(value):
            fields.name(name, "lever", f"{where}[{i}]",
                        "list lever names, or give a mapping of lever to options")
        value = {name: True for name in value}
    if not isinstance(value, Mapping):
        raise fail(where, f"is a {type(value).__name__}; give a mapping of lever name to {ON_OFF}, "
                          "or a list of lever names")
    out: dict[str, dict[str, Any]] = {}
    for lever, setting in value.items():
        fields.name(lever, "lever", f"{where}.{key(lever)}",
                    "name a lever of docs/methods.md#levers")
        if lever not in LEVERS:
            close = difflib.get_close_matches(lever, sorted(LEVERS), 1, 0.6)
            raise fail(f"{where}.{lever}",
                       f"unknown lever; {f'did you mean {close[0]}? ' if close else ''}"
                       f"choose one of {', '.join(LEVERS)}")
        out[lever] = _setting(lever, setting, f"{where}.{lever}")
    return out


def merge_levers(*layers: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Checked ``levers`` blocks in order (profile < method < host), each setting over the earlier
    ones (a later true or false turns a lever on or off and keeps the options set before it); the
    levers left on, by name, with their options over the defaults."""
    state: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for lever, setting in layer.items():
            state.setdefault(lever, {"enabled": False, **LEVERS[lever]["options"]}).update(setting)
    return {lever: {k: v for k, v in sorted(s.items()) if k != "enabled"}
            for lever, s in sorted(state.items()) if s["enabled"]}


def exact_block(on: Iterable[str], host: Any = None) -> dict[str, dict[str, Any]]:
    """A host's ``sparkspec_levers`` that turns exactly the levers
    ``on`` on and every other off, keeping the options the host's own
    block (``host``) gives them: what a compare or tune row serves."""
    given = check_levers(host, "sparkspec_levers")
    wanted = set(on)
    return {lever: {**{k: v for k, v in given.get(lever, {}).items() if k != "enabled"},
                    "enabled": lever in wanted} for lever in LEVERS}


def plugin_levers(levers: Iterable[str]) -> list[str]:
    """The levers the sparkspec-levers plugin carries (those without ``serve``), in order."""
    return [lever for lever in levers if "serve" not in LEVERS[lever]]


def serve_values(levers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The serve knobs the serve levers on set,
    an option's value where they name one (``"<option>"``)."""
    out: dict[str, Any] = {}
    for lever, options in levers.items():
        for knob, value in LEVERS[lever].get("serve", {}).items():
            named = isinstance(value, str) and value.startswith("<") and value.endswith(">")
            out[knob] = options[value[1:-1]] if named else value
    return out


def env_value(levers: Mapping[str, Mapping[str, Any]]) -> str:
    """What the unit's SPARKSPEC_LEVERS carries: compact JSON
    of each plugin lever on to its options ("" with none on)."""
    mine = plugin_levers(sorted(levers))
    if not mine:
        return ""
    return json.dumps({lever: dict(levers[lever]) for lever in mine}, separators=(",", ":"),
                      sort_keys=True)


def release_problems(levers: Iterable[str], release: str) -> list[str]:
    """A line for each lever whose hooks were not read against the vLLM
    ``release`` (its base version, without a local suffix such as +cpu),
    or that cannot be checked because the release is unknown ("")."""
    base = release.split("+", 1)[0]
    if not base:
        return [f"lever {lever} needs a known vLLM release ({', '.join(LEVERS[lever]['vllm'])}), "
                "and this install mode names none (a source build at a git ref that is not a "
                "release tag?); build a release, or turn the lever off" for lever in levers]
    return [f"lever {lever} does not fit vLLM {base}: its hooks were read against vLLM "
            f"{', '.join(LEVERS[lever]['vllm'])} (docs/spark-facts.md); install that release or "
            f"turn the lever off (levers: {{{lever}: false}})"
            for lever in levers if base not in LEVERS[lever]["vllm"]]


def _dtype(config: Mapping[str, Any]) -> str | None:
    for block in (config.get("text_config"), config):
        if isinstance(block, Mapping):
            for field in ("dtype", "torch_dtype"):
                if isinstance(block.get(field), str):
                    return str(block[field])
    return None


def _text_value(config: Mapping[str, Any], field: str) -> Any:
    text = config.get("text_config")
    if isinstance(text, Mapping) and field in text:
        return text[field]
    return config.get(field)


def _head_quantized(config: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's quantization_config quantizes the LM head too (AutoRound's
    quant_lm_head, GPTQ's lm_head)."""
    quant = config.get("quantization_config")
    return isinstance(quant, Mapping) and any(quant.get(field) is True
                                              for field in ("quant_lm_head", "lm_head"))


def head_problems(levers: Mapping[str, Mapping[str, Any]], config: Any, model: str) -> list[str]:
    """A line for each lever the model's head cannot take,
    from its config.json (``model`` names it)."""
    problems = []
    for lever, options in levers.items():
        needs = LEVERS[lever].get("head_dtypes")
        if not needs:
            continue
        off = ("turn the lever off for this profile (sparkspec_profiles.<profile>.levers: "
               f"{{{lever}: false}})")
        if not isinstance(config, Mapping):
            problems.append(f"lever {lever}: {model}'s config.json is not a JSON object; {off}")
            continue
        dtype, vocab = _dtype(config), _text_value(config, "vocab_size")
        if _text_value(config, "tie_word_embeddings") is True:
            problems.append(f"lever {lever}: {model} ties its LM head to the embedding "
                            f"(tie_word_embeddings), which the lever leaves alone; {off}")
        elif _head_quantized(config) or dtype not in needs:
            what = "quantized (quantization_config)" if _head_quantized(config) else show(dtype)
            problems.append(f"lever {lever}: {model}'s LM head is {what}, not "
                            f"{' or '.join(needs)}; {off}")
        elif (isinstance(vocab, bool) or not isinstance(vocab, int)
                or vocab < options["min_vocab"]):
            problems.append(f"lever {lever}: {model}'s vocabulary ({show(vocab)}) is below the "
                            f"lever's min_vocab {options['min_vocab']} (the head is too small to "
                            f"pay); {off}")
    return problems
