"""The registry's schema: the shape of a method, a profile, a serve block and a verify block,
checked, each error one line naming the inventory key and the fix. Pure functions over plain data;
the values live in :mod:`sparkspec.registry.data`, the resolution in
:mod:`sparkspec.registry.resolve`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import sparkspec.registry.fields as fields
from sparkspec import validate
from sparkspec.errors import UserError
from sparkspec.registry.data import (
    CONTRACT_FOLDERS,
    CONTRACT_KEYS,
    KNOBS,
    NEEDLE_MAX_TIERS,
    NEEDLE_MIN_TIER,
    SERVE_KINDS,
    VERIFY_KEYS,
)
from sparkspec.registry.fields import RegistryError as RegistryError
from sparkspec.registry.fields import fail, key, show
from sparkspec.registry.levers import check_levers
from sparkspec.registry.releases import ALL_SPEC_FIELDS

KINDS = {"hybrid": ("int4", "fp8"), "plain": ("model",)}
# A hybrid without fp8 is the INT4 checkpoint with its MTP head registered and no layer in FP8.
OPTIONAL_SOURCES = {"fp8"}
METHOD_KEYS = {"speculative_config", "head", "serve", "verify", "vllm_venv", "levers"}
PROFILE_KEYS = {"kind", "served_model_name", "dir", "disk_gb", "int4", "fp8", "model", "heads",
                "vllm_venv", "expect_fp8_layers", "expect_mtp_tensors", "serve", "verify", "levers"}
SPEC_METHODS = "ngram|mtp|eagle3|dflash|draft_model|..."
# Every key some known vLLM release's SpeculativeConfig takes (sparkspec.registry.releases: each
# release's own list, read from its vllm/config/speculative.py, a pydantic dataclass with
# extra="forbid" through vllm/config/utils.py): vLLM refuses any other key of --speculative-config,
# but only at engine start, in a traceback. The active release's list is the resolver's check.
SPEC_FIELDS = ALL_SPEC_FIELDS
# Fields an inventory must not set: vLLM fills the target_* and draft_*_config ones itself
# (speculative.py:484-501) and keeps tensor_parallel_size only to refuse it (speculative.py:410,
# 1813-1817: use draft_tensor_parallel_size).
SPEC_INTERNAL = frozenset({"target_model_config", "target_parallel_config", "draft_model_config",
                           "draft_parallel_config", "tensor_parallel_size"})


def _fail(where: str, what: str) -> RegistryError:
    return fail(where, what)


def _mapping(value: Any, where: str, fix: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"is a {type(value).__name__}, not a mapping; {fix}")
    return value


def _string(value: Any, where: str, fix: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where,
                    f"{'missing' if value is None else show(value) + ' is not a non-empty string'}"
                    f"; {fix}")
    return value


def _unknown_keys(entry: Mapping[str, Any], allowed: Iterable[str], where: str,
                  cutoff: float = 0.6) -> None:
    known = sorted(allowed)
    for field in entry:
        if field not in known:
            close = difflib.get_close_matches(str(field), known, 1, cutoff)
            hint = f"did you mean {close[0]}? " if close else ""
            raise _fail(f"{where}.{key(field)}",
                        f"unknown key; {hint}use one of {', '.join(known)}")


def check_serve(serve: Any, where: str) -> dict[str, Any]:
    """A `serve` block (a profile's, a method's, or a host's sparkspec_serve):
    serve knob names only, each value of its kind (sparkspec.registry.data.SERVE);
    a secret (api_key, hf_token) is refused, naming its place."""
    block = _mapping({} if serve is None else serve, where, "give a mapping of serve knobs "
                                                            f"({', '.join(KNOBS)})")
    for field in block:
        fields.secret_knob(field, where)
    _unknown_keys(block, KNOBS, where)
    for knob, value in block.items():
        fields.knob(SERVE_KINDS[knob], value, f"{where}.{knob}")
    return dict(block)


def check_verify(verify: Any, where: str) -> dict[str, Any]:
    """A `verify` block: the floors min_tok_s and min_acceptance_rate, each
    a number >= 0 or null (no floor), and prefix_cache, true, false or null
    (the prefix-cache check's expectation; null follows the unit)."""
    block = _mapping({} if verify is None else verify, where,
                     "give {min_tok_s: N, min_acceptance_rate: N}")
    _unknown_keys(block, VERIFY_KEYS, where)
    for field, value in block.items():
        if field == "needle_tiers":
            _tiers(value, f"{where}.{field}")
            continue
        if field == "prefix_cache":
            if value is not None and not isinstance(value, bool):
                raise _fail(f"{where}.{field}",
                            f"{show(value)} is not true, false or null (null: expect hits where "
                            "the unit serves with prefix caching); fix it")
            continue
        bad = isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not math.isfinite(value))
        if value is not None and (bad or value < 0
                                  or (field == "min_acceptance_rate" and value > 100)):
            bound = " and <= 100 (percent)" if field == "min_acceptance_rate" else ""
            raise _fail(f"{where}.{field}",
                        f"{show(value)} is not a number >= 0{bound} or null (no floor); fix it")
    return dict(block)


def _tiers(value: Any, where: str) -> None:
    """needle_tiers: null, or 1 to NEEDLE_MAX_TIERS token counts, ascending, each >= the minimum."""
    ok = value is None or (
        isinstance(value, list) and 1 <= len(value) <= NEEDLE_MAX_TIERS
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= NEEDLE_MIN_TIER
                for t in value) and value == sorted(set(value)))
    if not ok:
        raise _fail(where, f"{show(value)} is not a list of 1 to {NEEDLE_MAX_TIERS} context "
                    f"lengths in tokens, ascending, each >= {NEEDLE_MIN_TIER}, or null (no needle "
                    "check); e.g. [8192, 32768]")


def repo_folder(repo: Any, where: str) -> str:
    """The one repo-to-folder rule (``org/name`` -> ``org--name``), through sparkspec.validate."""
    try:
        return validate.repo_folder(repo)
    except UserError as exc:
        raise _fail(where, str(exc)) from None


def _spec(spec: Any, where: str, head: Any) -> dict[str, Any]:
    """A speculative_config: a mapping of SpeculativeConfig fields (of any known release), each of
    its type, with `method` and num_speculative_tokens (1..64)."""
    spec = _mapping(spec, where, "give null or a mapping with method")
    allowed = SPEC_FIELDS - SPEC_INTERNAL
    for field in spec:
        if field not in allowed:
            close = difflib.get_close_matches(str(field), sorted(allowed), 1, 0.5)
            raise _fail(f"{where}.{key(field)}", "not a key the SpeculativeConfig of any vLLM "
                        "release sparkspec knows takes (vllm/config/speculative.py); "
                        f"{f'use {close[0]}, or drop it' if close else 'drop it'}")
    if spec.get("method") is None:
        raise _fail(f"{where}.method", f"missing; set it to {SPEC_METHODS}")
    if spec.get("num_speculative_tokens") is None:
        raise _fail(f"{where}.num_speculative_tokens", "missing; set it to an integer k > 0")
    checked = {field: fields.spec_value(field, value, f"{where}.{field}")
               for field, value in spec.items()}
    if checked["method"] == "ngram":
        low, high = checked.get("prompt_lookup_min", 5), checked.get("prompt_lookup_max", 5)
        if low is not None and high is not None and low > high:
            raise _fail(where, f"prompt_lookup_min={low} must be <= prompt_lookup_max={high} (both "
                               "integers, default 5); fix them")
    if head is not None and "model" in checked:
        raise _fail(f"{where}.model", "the method's head is the draft model (its folder becomes "
                                      "model); drop model, or drop head")
    return checked


def check_method(name: str, method: Any) -> dict[str, Any]:
    """A method entry of sparkspec_methods, checked: its name, speculative_config (null or a mapping
    of SpeculativeConfig fields, each of its type), optional head (a head name), serve (no
    engine-wide attention_backend for dflash), verify, vllm_venv (an absolute folder) and levers."""
    where = f"sparkspec_methods.{key(name)}"
    fields.name(name, "method", where, "rename the method")
    entry = _mapping(method, where, "give speculative_config (null for none) and optionally head, "
                     "serve, verify, vllm_venv")
    _unknown_keys(entry, METHOD_KEYS, where)
    if "speculative_config" not in entry:
        raise _fail(f"{where}.speculative_config",
                    "missing; set it to null (no speculation) or a mapping")
    if entry.get("head") is not None:
        fields.name(entry["head"], "head", f"{where}.head",
                    "name a key of the profile's heads, or drop head")
    spec = entry["speculative_config"]
    if spec is not None:
        spec = _spec(spec, f"{where}.speculative_config", entry.get("head"))
    serve = check_serve(entry.get("serve"), f"{where}.serve")
    verify = check_verify(entry.get("verify"), f"{where}.verify")
    if spec is not None and spec["method"] == "dflash" and "attention_backend" in serve:
        # --attention-backend is engine-wide: it would take the target's backend too; vLLM 0.32.0
        # has a draft-only one (speculative.py:424-427), which its DFlash proposer uses
        # (v1/spec_decode/llm_base_proposer.py:1282-1291)
        raise _fail(f"{where}.serve.attention_backend",
                    "is engine-wide (the target's backend too); drop it and set "
                    f"{where}.speculative_config.attention_backend (the drafter's only) instead")
    venv = entry.get("vllm_venv")
    if venv is not None:
        fields.venv(venv, f"{where}.vllm_venv")
    return {"speculative_config": spec, "head": entry.get("head"), "serve": serve, "verify": verify,
            "vllm_venv": venv, "levers": check_levers(entry.get("levers"), f"{where}.levers")}


def _source(value: Any, where: str, parent: str) -> dict[str, str]:
    """A source: exactly {repo, revision} (revision defaults to main; pin a commit id)."""
    src = _mapping(value, where, "give {repo: org/name, revision: <commit id>}")
    _unknown_keys(src, ("repo", "revision"), where)
    folder = repo_folder(src.get("repo"), f"{where}.repo")
    try:
        revision = validate.revision(src.get("revision", "main"))
    except UserError as exc:
        raise _fail(f"{where}.revision", str(exc)) from None
    return {"repo": str(src["repo"]), "revision": revision, "repo_folder": folder,
            "folder": f"{parent}/{folder}"}


def _heads(value: Any, where: str, parent: str) -> dict[str, dict[str, str]]:
    table = _mapping({} if value is None else value, where, "give {name: {repo, revision}}")
    for head in table:
        fields.name(head, "head", f"{where}.{key(head)}",
                    "rename the head (and the methods naming it)")
    return {head: _source(src, f"{where}.{head}", parent) for head, src in table.items()}


def check_profile(name: str, profile: Any, dirs: Mapping[str, str]) -> dict[str, Any]:
    """A profile of sparkspec_profiles, checked, with the local folder of its model, sources and
    heads (``dirs``: models, sources and heads folders)."""
    where = f"sparkspec_profiles.{key(name)}"
    fields.name(name, "profile", where, "rename the profile")
    entry = _mapping(profile, where, "give kind, served_model_name, dir, disk_gb and its sources")
    _unknown_keys(entry, PROFILE_KEYS, where)
    kind = entry.get("kind")
    if kind not in KINDS:
        raise _fail(f"{where}.kind", f"{'missing' if kind is None else show(kind)}; set it to "
                                     "hybrid or plain")
    served = fields.name(entry.get("served_model_name", name), "served_model_name",
                         f"{where}.served_model_name",
                         "name the served model as clients will send it")
    folder = entry.get("dir")
    try:
        validate.filename(folder, "dir")
    except UserError:
        raise _fail(f"{where}.dir", f"{show(folder)} is not a plain file name (one folder under "
                    "sparkspec_models_dir: letters, digits, '._+=@,-'; no '/' or '..'); fix the "
                    "profile") from None
    disk = entry.get("disk_gb", 0)
    if (isinstance(disk, bool) or not isinstance(disk, int | float) or not math.isfinite(disk)
            or disk < 0):
        raise _fail(f"{where}.disk_gb",
                    f"{show(disk)} is not a number >= 0; set the GB the profile needs")
    for source in KINDS["hybrid" if kind == "plain" else "plain"]:
        if source in entry:
            raise _fail(f"{where}.{source}", f"not a source of a {kind} profile; use "
                                             f"{' and '.join(KINDS[kind])}")
    sources = {}
    for source in KINDS[kind]:
        if source not in entry:
            if source in OPTIONAL_SOURCES:
                continue
            names = " and ".join(k for k in KINDS[kind] if k not in OPTIONAL_SOURCES)
            optional = [k for k in KINDS[kind] if k in OPTIONAL_SOURCES]
            raise _fail(f"{where}.{source}", f"missing; a {kind} profile names {names}"
                        f"{' (and optionally ' + ', '.join(optional) + ')' if optional else ''}, "
                        f"each {{repo, revision}}")
        sources[source] = _source(entry[source], f"{where}.{source}",
                                  dirs["sources" if kind == "hybrid" else "models"])
    for field in ("expect_fp8_layers", "expect_mtp_tensors"):
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise _fail(f"{where}.{field}",
                        f"{show(value)} is not an integer >= 0; fix it or drop it")
    if kind == "hybrid" and "fp8" not in sources and entry.get("expect_fp8_layers"):
        raise _fail(f"{where}.expect_fp8_layers",
                    f"{entry['expect_fp8_layers']} FP8 layers expected but the profile "
                    "names no fp8 source; add fp8 {repo, revision} or drop expect_fp8_layers")
    if kind == "plain":
        sources["model"]["folder"] = f"{dirs['models']}/{folder}"
    venv = entry.get("vllm_venv")
    if venv is not None:
        fields.venv(venv, f"{where}.vllm_venv")
    return {"name": name, "kind": kind, "served_model_name": served, "dir": folder,
            "model_dir": f"{dirs['models']}/{folder}", "disk_gb": disk, "sources": sources,
            "heads": _heads(entry.get("heads"), f"{where}.heads", dirs["heads"]),
            "vllm_venv": venv, "expect_fp8_layers": entry.get("expect_fp8_layers"),
            "expect_mtp_tensors": entry.get("expect_mtp_tensors"),
            "serve": check_serve(entry.get("serve"), f"{where}.serve"),
            "verify": check_verify(entry.get("verify"), f"{where}.verify"),
            "levers": check_levers(entry.get("levers"), f"{where}.levers")}


def check_tuned_k(value: Any, methods: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """sparkspec_num_speculative_tokens: method name to k, over that method's speculative_config
    (what `invoke tune --apply` writes). Every entry is checked, served or not: a method that is not
    defined or drafts nothing is refused, and k as the speculative_config's own (1..64)."""
    where = "sparkspec_num_speculative_tokens"
    block = _mapping({} if value is None else value, where,
                     "give a mapping of method name to k, e.g. {ngram: 3}")
    for method, k in block.items():
        if method not in methods:
            raise _fail(f"{where}.{key(method)}",
                        f"no such method; choose one of {', '.join(methods)}")
        if methods[method]["speculative_config"] is None:
            raise _fail(f"{where}.{method}", f"method {method} drafts nothing (no "
                                             "speculative_config), so it has no k; remove the "
                                             "entry")
        fields.spec_value("num_speculative_tokens", k, f"{where}.{method}")
    return dict(block)


def check_pinned(profile: Mapping[str, Any], where: str) -> None:
    """Every source of a checked profile (model or int4/fp8, and each head) at a full
    commit id, for sparkspec_require_pinned_revisions: a branch or tag moves under the
    host, a short id is ambiguous."""
    heads = {f"heads.{name}": src for name, src in profile["heads"].items()}
    for part, src in {**profile["sources"], **heads}.items():
        if not validate.COMMIT_RE.fullmatch(src["revision"]):
            raise _fail(f"{where}.{part}.revision",
                        f"{show(src['revision'])} is not a full commit id, and "
                        "sparkspec_require_pinned_revisions asks for one; pin the 40-character id "
                        "(docs/methods.md: Pinning revisions) or turn "
                        "sparkspec_require_pinned_revisions off")


def check_contract(contract: Mapping[str, Any]) -> dict[str, Any]:
    """The contract's own values (sparkspec_<key> for each key of CONTRACT_KEYS),
    before its structures: the folders absolute and normalised, the method names,
    the tables mappings, stage_profiles a list of profile names, and the service's
    port and address where given (null: not checked here; vllm_command refuses
    it). Returns the folders the resolver joins (models, sources, heads)."""
    for field in contract:
        if field not in CONTRACT_KEYS:
            raise _fail(f"sparkspec_{key(field)}", "not a key of the contract; use one of "
                        f"{', '.join(f'sparkspec_{k}' for k in CONTRACT_KEYS)}")
    for field in CONTRACT_FOLDERS:
        check = fields.venv if field == "vllm_venv" else fields.folder
        check(contract.get(field), f"sparkspec_{field}", "give the folder's full path (the "
              "contract's defaults: roles/sparkspec/defaults/main.yml)")
    fields.name(contract.get("method"), "method", "sparkspec_method",
                "name a built-in method or a key of sparkspec_methods")
    if contract.get("method_switch") not in (None, ""):
        fields.name(contract["method_switch"], "method", "sparkspec_method_switch",
                    "give a built-in method or a key of sparkspec_methods")
    _mapping({} if contract.get("methods") is None else contract["methods"], "sparkspec_methods",
             "give a mapping of method name to method")
    _mapping(contract.get("profiles"), "sparkspec_profiles",
             "give a mapping of profile name to profile")
    stage = contract.get("stage_profiles")
    if stage is not None and not (isinstance(stage, list)
                                  and all(isinstance(s, str) for s in stage)):
        raise _fail("sparkspec_stage_profiles",
                    f"{show(stage)} is not a list of profile names; fix it")
    if contract.get("port") is not None:
        fields.port(contract["port"], "sparkspec_port")
    if contract.get("bind_address") is not None:
        fields.address(contract["bind_address"], "sparkspec_bind_address")
    pinned = contract.get("require_pinned_revisions")
    if pinned is not None and not isinstance(pinned, bool):
        raise _fail("sparkspec_require_pinned_revisions",
                    f"{show(contract['require_pinned_revisions'])} is not true or false; fix it")
    return {"models": contract["models_dir"], "sources": contract["sources_dir"],
            "heads": contract["heads_dir"]}
