"""vLLM's command line, the unit's fixed environment and its record, from a resolved host: one unit-tested
function, not Jinja."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# The unit's fixed environment: offline (the unit never downloads), no usage reporting.
BASE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK")


def _truthy(value: Any) -> bool:
    """Ansible's ``bool`` filter."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("yes", "on", "1", "true")


def _set(value: Any) -> bool:
    return value is not None and value != "" and value is not False


def vllm_command(resolved: Mapping[str, Any], service: Mapping[str, Any],
                 overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's argv, the unit's fixed environment and its record, from the resolved host's merged serve knobs
    (``overrides``: what the deploy found on the host, e.g. load_format auto where the venv lacks
    fastsafetensors). ``service``: unit, bind_address, port, user."""
    k = {**resolved["serve"], **(overrides or {})}
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


