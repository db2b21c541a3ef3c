"""The registry's data: the one home of the built-in methods, the serve defaults and the verify floors, and of
the names every other place used to list by hand (head kinds, contract keys, serve knob names).

docs/spark-facts.md cites where each value comes from (the pinned vLLM release, a model card, a public
measurement); tests/unit/test_spark_facts.py ties every value here to a citation there. A newcomer adding a
sixth built-in method adds it to :data:`BUILTIN_METHODS`, adds ``playbooks/deploy-<name>.yml`` and documents
it in docs/methods.md (docs/methods.md says so); nothing else lists methods.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# The speculative decoding methods, as data. `speculative_config` is vLLM's --speculative-config (None: none);
# `head` names the key in the profile's `heads` whose local folder becomes the config's `model`; `serve`
# overrides serve knobs for this method; `verify` holds the method's floors (min_tok_s, min_acceptance_rate:
# None = none). The floors are for the 122B hybrid on a GB10, each at least 15 % below the lowest public
# single-request figure for the method (docs/spark-facts.md); EAGLE3 has no public figure on the 122B, so no
# floor.
BUILTIN_METHODS: MappingProxyType[str, dict[str, Any]] = MappingProxyType({
    "baseline": {"speculative_config": None, "verify": {"min_tok_s": 24}},
    # the benchmark article's values; see the deploy warnings for hybrid Gated-DeltaNet models
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 4},
              "verify": {"min_tok_s": 20}},
    # the article's best: k=2 (k=4 fell below baseline)
    "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
            "verify": {"min_tok_s": 40}},
    "eagle3": {"head": "eagle3", "speculative_config": {"method": "eagle3", "num_speculative_tokens": 1}},
    # DFlash's drafter needs non-causal attention. Its backend is set inside speculative_config (vLLM 0.32.0,
    # vllm/config/speculative.py:424-427), not as serve.attention_backend (--attention-backend is engine-wide
    # and would take FLASHINFER from the target; the schema refuses it). Unset, vLLM picks the first
    # non-causal backend in its order, on SM12x FLASH_ATTN (platforms/cuda.py:165-177), whose FA2 path
    # device-asserted on GB10 (#50707).
    "dflash": {"head": "dflash",
               "speculative_config": {"method": "dflash", "num_speculative_tokens": 15,
                                      "attention_backend": "FLASHINFER"},
               "verify": {"min_tok_s": 25}},
})

# The serve knobs: each one's contract default (the public DGX Spark recipe for Qwen3.5-122B;
# docs/spark-facts.md cites each) and how it becomes vLLM flags, in the order they appear on the command line.
# Applied in one order: these < the profile's `serve` < the method's `serve` < the host's own
# `sparkspec_serve`. None or "" leaves the flag out, so vLLM's own default applies. Flag styles: value (--knob
# VALUE), switch (--knob / --no-knob), on (--knob when true), tool
# (--enable-auto-tool-choice --tool-call-parser VALUE), json (--knob JSON when not empty), args (verbatim).
SERVE: MappingProxyType[str, tuple[Any, str]] = MappingProxyType({
    "max_model_len": (262144, "value"),
    "max_num_batched_tokens": (None, "value"),
    "gpu_memory_utilization": (0.90, "value"),
    # the deploy serves auto where the venv lacks fastsafetensors
    "load_format": ("fastsafetensors", "value"),
    "attention_backend": ("FLASHINFER", "value"),
    "enable_chunked_prefill": (True, "switch"),
    "enable_prefix_caching": (None, "switch"),    # None: off for hybrid profiles (Gated-DeltaNet layers)
    "tool_call_parser": ("qwen3_coder", "tool"),
    "reasoning_parser": ("qwen3", "value"),
    # no torch.compile and no CUDA graphs (slower decode, faster start)
    "enforce_eager": (False, "on"),
    "generation_config": ("auto", "value"),       # auto | vllm | a folder
    "override_generation_config": ({}, "json"),   # e.g. {temperature: 0.6, top_p: 0.95}
    "extra_args": ([], "args"),                   # more vLLM flags, verbatim
})
SERVE_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({k: v[0] for k, v in SERVE.items()})
SERVE_FLAGS: MappingProxyType[str, str] = MappingProxyType({k: v[1] for k, v in SERVE.items()})
KNOBS: tuple[str, ...] = tuple(SERVE)

# The verify floors and their contract defaults (none): the same order as serve.
VERIFY_DEFAULTS: MappingProxyType[str,
                                  Any] = MappingProxyType({"min_tok_s": None, "min_acceptance_rate": None})
VERIFY_KEYS: tuple[str, ...] = tuple(VERIFY_DEFAULTS)

# The speculative methods whose drafts come from a head checkpoint (a profile's `heads`), each checked by
# sparkspec.checkpoint.heads against the target model: derived from the built-ins, never listed by hand.
HEAD_KINDS: tuple[str, ...] = tuple(m["speculative_config"]["method"] for m in BUILTIN_METHODS.values()
                                    if m.get("head"))

# The contract variables the registry resolves a host from (each is sparkspec_<key> in the inventory).
CONTRACT_KEYS: tuple[str, ...] = ("method", "method_switch", "methods", "profile", "profiles",
                                  "stage_profiles",
                                  "models_dir", "sources_dir", "heads_dir", "vllm_venv", "serve", "verify")

# Keys this version renamed: an inventory that still sets one gets one line naming the new key.
RENAMED: MappingProxyType[str, str] = MappingProxyType({
    "sparkspec_methods_extra": "sparkspec_methods (the inventory's methods, added to the built-ins or "
                               "replacing one by name)",
    **{f"deploy_{knob}": f"sparkspec_serve.{knob} (a host's own), or `serve: {{{knob}: ...}}` in its profile "
                         "or method" for knob in KNOBS},
    "verify_min_tok_s": "`verify: {min_tok_s: N}` in the method (or profile), or sparkspec_verify.min_tok_s "
                        "(a host's own)",
    "verify_min_acceptance_rate": "`verify: {min_acceptance_rate: N}` in the method (or profile), or "
                                  "sparkspec_verify.min_acceptance_rate (a host's own)",
})
