"""vLLM's command line, the unit's fixed environment and its record, from a resolved host: one
unit-tested function, not Jinja."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from sparkspec.registry.data import COMPILE_CACHE_ENV, LEVERS_ENV, SERVE_FLAGS
from sparkspec.registry.fields import address, port
from sparkspec.registry.levers import env_value

# The unit's fixed environment: offline (the unit never downloads), no usage reporting.
BASE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "VLLM_NO_USAGE_STATS",
            "DO_NOT_TRACK")


def _truthy(value: Any) -> bool:
    """Ansible's ``bool`` filter."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("yes", "on", "1", "true")


def _set(value: Any) -> bool:
    return value is not None and value != "" and value is not False


def _flags(knob: str, style: str, value: Any) -> list[str]:
    """One knob's vLLM flags by its style (sparkspec.registry.data.SERVE)."""
    flag = "--" + knob.replace("_", "-")
    if style == "value":
        return [flag, str(value)] if _set(value) else []
    if style == "switch":
        return ([] if value in (None, "")
                else [("--" if _truthy(value) else "--no-") + knob.replace("_", "-")])
    if style == "tool":
        return ["--enable-auto-tool-choice", flag, str(value)] if _set(value) else []
    if style == "on":
        return [flag] if _truthy(value) else []
    if style == "json":
        return [flag, json.dumps(value, separators=(",", ":"))] if value else []
    return [str(a) for a in value or []]   # args: verbatim


def vllm_command(resolved: Mapping[str, Any], service: Mapping[str, Any],
                 overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's argv, the unit's fixed environment and its record, from the resolved host's merged
    serve knobs (``overrides``: what the deploy found on the host, e.g. load_format auto where the
    venv lacks fastsafetensors). ``service``: unit, bind_address, port, user, and compile_cache (the
    folder of compile caches, "" for vLLM's own places) with what else keys them: extra_env
    (deploy_env, secrets redacted) and levers_dir (the levers' plugin folder)."""
    k = {**resolved["serve"], **(overrides or {})}
    profile = resolved["profile"]
    # checked by resolve where the contract gives them; here too, where they land (null included)
    checked_port = port(service["port"], "sparkspec_port")
    bind = address(service["bind_address"], "sparkspec_bind_address")
    cluster = resolved.get("cluster")
    # one node: vLLM's API server module, --model; a cluster: the `vllm serve`
    # entry point (the only one with --headless: vllm/entrypoints/cli/serve.py),
    # which takes the model as its first word and refuses --model
    args = [profile["model_dir"]] if cluster else ["--model", profile["model_dir"]]
    args += ["--served-model-name", profile["served_model_name"]]
    if not cluster or cluster["rank"] == 0:
        args += ["--host", bind, "--port", str(checked_port)]
    if resolved["speculative_config"] is not None:
        args += ["--speculative-config",
                 json.dumps(resolved["speculative_config"], separators=(",", ":"))]
    for knob, style in SERVE_FLAGS.items():
        args += _flags(knob, style, k.get(knob))
    if cluster:
        args += cluster["args"]
    # where a client on the host reaches it:
    # a wildcard address by loopback, an IPv6 literal in brackets
    local = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bind, bind)
    record = {"unit": service["unit"], "method": resolved["method"], "profile": profile["name"],
              "served_model_name": profile["served_model_name"], "venv": resolved["venv"],
              "url": f"http://{f'[{local}]' if ':' in local else local}:{checked_port}"}
    if resolved.get("release"):   # the release served, for `invoke status` and the bench's result
        record["vllm_release"] = resolved["release"]["version"]
    spec = resolved["speculative_config"]
    if spec is not None:   # k and where it came from, for `invoke status`
        record.update(num_speculative_tokens=spec.get("num_speculative_tokens"),
                      k_source=resolved.get("k_source"))
    levers = resolved.get("levers") or {}
    if levers:   # what `invoke status` shows and the memory guard's key includes
        record["levers"] = {lever: dict(levers[lever]) for lever in sorted(levers)}
    if cluster:   # a worker serves no HTTP: status and verify go to the head
        record.update(cluster={k: cluster[k]
                               for k in ("group", "rank", "role", "head", "members", "nnodes")})
        if cluster["rank"] > 0:
            record["url"] = ""
    env: dict[str, Any] = {name: 1 for name in BASE_ENV}
    env.update(HF_HOME=f"/var/lib/{service['user']}/.cache/huggingface",
               SPARKSPEC_PROFILE=profile["name"])
    if env_value(levers):
        env[LEVERS_ENV] = env_value(levers)
    if cluster:
        env.update(cluster["env"])
    if service.get("compile_cache"):
        key = compile_cache_key(args, {**(service.get("extra_env") or {}), **env},
                                resolved["venv"], service.get("levers_dir", ""))
        folder = f"{service['compile_cache']}/{key}"
        env.update({name: f"{folder}/{sub}" for name, sub in COMPILE_CACHE_ENV.items()})
        record["compile_cache"] = {"folder": folder, "key": key}
    return {"args": args, "env": env, "record": record}


def compile_cache_key(args: list[str], env: Mapping[str, Any], venv: str,
                      levers_dir: str) -> str:
    """16 hex digits of what a compile depends on that the deploy knows:
    the command line, the environment, the venv and the levers' plugin.
    The vLLM build is checked at each start (compile_cache.py)."""
    doc = json.dumps([args, sorted((k, str(v)) for k, v in env.items()), venv, levers_dir])
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


