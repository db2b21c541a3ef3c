"""Which layers ``checkpoint assemble`` takes in FP8: the one rule that assemble and the ranged FP8
fetch (``fetch fp8-subset``) share, so that the fetch brings exactly the tensors assemble will use.

Names first (:func:`fp8_candidates`, e.g. on an index before any header is read), then headers
(:func:`fp8_selection`: dtypes, shapes, block scales and fused groups checked).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.checkpoint.safetensors_io import Header, TensorInfo
from sparkspec.errors import UserError

EXTRA_FILE = "model_extra_tensors.safetensors"  # the INT4 repo's MTP head: not a model shard
REVISION_FILE = ".sparkspec-revision"  # a fetched folder's commit id (sparkspec fetch writes it)
QUANT_SUFFIXES = (".weight", ".qweight", ".qzeros", ".scales", ".g_idx")
FUSED_GROUPS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"},
                {"in_proj_qkv", "in_proj_z"}, {"in_proj_b", "in_proj_a"})
DEFAULT_BLOCK = (128, 128)


def module_of(name: str) -> str | None:
    for suffix in QUANT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def fp8_pair(module: str) -> tuple[str, str]:
    """The two FP8 tensors a module taken in FP8 brings: ``X.weight`` and ``X.weight_scale_inv``."""
    return f"{module}.weight", f"{module}.weight_scale_inv"


def int4_model_shards(weight_map: Mapping[str, str]) -> list[str]:
    """The INT4 index's model shards (sorted): every file it maps a non-``mtp.*`` tensor to, except
    the MTP head's ``model_extra_tensors.safetensors``."""
    return sorted({f for t, f in weight_map.items()
                   if f != EXTRA_FILE and not t.startswith("mtp.")})


def int4_model_tensors(headers: Iterable[Header]) -> dict[str, TensorInfo]:
    """The model shards' tensors by name, ``mtp.*`` left out (add-mtp's job)."""
    return {n: t for h in headers for n, t in h.tensors.items() if not n.startswith("mtp.")}


_CONFIG_FIX = "fix or re-download config.json"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def weight_block_size(config: Mapping[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """The FP8 checkpoint's ``quantization_config.weight_block_size``: two positive integers
    (default 128 x 128). Anything else is one line naming ``where``."""
    qc = config.get("quantization_config")
    if qc is None:
        return DEFAULT_BLOCK
    if not isinstance(qc, dict):
        raise UserError(f"{where}: quantization_config is {type(qc).__name__}, expected an object; "
                        f"{_CONFIG_FIX}")
    block = qc.get("weight_block_size")
    if block is None:
        return DEFAULT_BLOCK
    if not (isinstance(block, list) and len(block) == 2
            and all(_is_int(b) and 0 < b <= 1 << 20 for b in block)):
        raise UserError(f"{where}: quantization_config.weight_block_size is {block!r:.60}, "
                        f"expected two positive integers like [128, 128]; {_CONFIG_FIX}")
    return tuple(block)


def text_config(config: Mapping[str, Any], where: str = "config.json") -> Mapping[str, Any]:
    """The text model's settings: ``text_config`` of a multimodal config, else the config itself."""
    inner = config.get("text_config", config)
    if not isinstance(inner, dict):
        raise UserError(f"{where}: text_config is {type(inner).__name__}, expected an object; "
                        f"{_CONFIG_FIX}")
    return inner


def config_int(settings: Mapping[str, Any], key: str, where: str, low: int = 0, high: int = 1 << 20
               ) -> int | None:
    """An integer setting in [low, high], or None when absent; a wrong type or value is one line."""
    value = settings.get(key)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise UserError(f"{where}: {key} is {value!r:.60}, expected an integer from {low} to "
                        f"{high}; {_CONFIG_FIX}")
    return int(value)


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint commands read from a config.json, checked once for all of them
    (:func:`read_config`): assemble, build and verify accept and refuse the same files."""

    doc: dict[str, Any]
    layers: int | None  # num_hidden_layers
    shared_expert: int | None  # shared_expert_intermediate_size
    mtp_layers: int | None  # mtp_num_hidden_layers
    experts: int | None  # num_experts

    def expected_mtp(self) -> tuple[int | None, str]:
        """4 + mtp_num_hidden_layers x (3 x num_experts + 13)
        for Qwen3.5-MoE; (None, why) when unknown."""
        if not self.mtp_layers:
            return 0, "config.json declares no MTP layer"
        if self.experts is None:
            return None, "config.json declares MTP layers but no num_experts: MTP count not checked"
        return 4 + self.mtp_layers * (3 * self.experts + 13), "from config.json"


def check_config(doc: Any, where: str) -> ModelConfig:
    """The one check of a model's config.json: an object whose text
    settings (``text_config`` or the top level) hold, where present,
    integers in range; anything else is one line naming ``where``."""
    if not isinstance(doc, dict):
        raise UserError(f"{where}: not a JSON object; {_CONFIG_FIX}")
    tc = text_config(doc, where)
    return ModelConfig(doc, config_int(tc, "num_hidden_layers", where, 1, 1 << 16),
                       config_int(tc, "shared_expert_intermediate_size", where),
                       config_int(tc, "mtp_num_hidden_layers", where, 0, 1024),
                       config_int(tc, "num_experts", where, 1, 1 << 16))


def read_config(directory: Path, flag: str) -> ModelConfig:
    """``directory/config.json`` read (a regular file of the folder: a link out of it is refused)
    and checked by :func:`check_config`."""
    from sparkspec.jsonfile import read_json
    from sparkspec.validate import source_file

    path = source_file(directory, directory / "config.json", flag)
    return check_config(read_json(path, "not found; point at a complete checkpoint directory",
                                  _CONFIG_FIX),
                        str(directory / "config.json"))


def has_config(directory: Path) -> bool:
    return os.path.lexists(directory / "config.json")


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    regexes = []
    for pat in patterns:
        try:
            regexes.append(re.compile(pat))
        except re.error as exc:
            raise UserError(f"--fp8-pattern {pat!r}: not a valid regular expression ({exc}); fix "
                            "it") from None
    return regexes


def fp8_candidates(int4_names: Iterable[str], fp8_names: Collection[str],
                   patterns: Iterable[str] = ()) -> list[str]:
    """Modules X that may take FP8, from tensor names only (e.g. an index, before reading headers).

    Default rule: the INT4 model shards keep ``X.weight`` (16-bit) and the FP8 checkpoint has
    ``X.weight`` and ``X.weight_scale_inv``. A ``--fp8-pattern`` (re.search on X) also admits INT4
    ``X.qweight`` modules. ``mtp.*`` is never a candidate (add-mtp's job). Fetch ``X.weight`` +
    ``X.weight_scale_inv`` for each.
    """
    regexes = compile_patterns(patterns)
    out = set()
    for name in int4_names:
        module = module_of(name)
        if module is None or name.startswith("mtp."):
            continue
        if not (name.endswith(".weight") or (name.endswith(".qweight") and any(r.search(module)
                                                                               for r in regexes))):
            continue
        if all(n in fp8_names for n in fp8_pair(module)):
            out.add(module)
    return sorted(out)


def _label(side: str, name: str) -> str:
    return f"{side} {name}"


def fp8_selection(int4_tensors: Mapping[str, TensorInfo], fp8_tensors: Mapping[str, TensorInfo],
                  patterns: Iterable[str] = (), block: Sequence[int] = DEFAULT_BLOCK,
                  source: Callable[[str, str], str] = _label) -> list[str]:
    """The validated modules to take in FP8 (sorted): the candidates
    whose FP8 ``X.weight`` is F8_E4M3 of the INT4 module's [out, in] with
    a BF16/F32 scale of [ceil(out/b0), ceil(in/b1)]; fused groups whole.

    ``int4_tensors``: the INT4 model shards' tensors by name; ``fp8_tensors``: FP8
    tensors by name (at least each candidate's weight and scale).
    ``source(side, name)`` names the file holding a tensor ("int4" or "fp8" side) in
    error messages. Raises UserError on a dtype or shape mismatch between the sources.
    """
    chosen = []
    for module in fp8_candidates(int4_tensors, fp8_tensors, patterns):
        t = int4_tensors.get(f"{module}.weight") or int4_tensors[f"{module}.qweight"]
        w, scale = (fp8_tensors[n] for n in fp8_pair(module))
        if w.dtype != "F8_E4M3":
            raise UserError(f"{source('fp8', w.name)}: {w.name} has a weight_scale_inv but dtype "
                            f"{w.dtype}, expected F8_E4M3; dtype mismatch between sources, check "
                            "--fp8")
        if t.name.endswith(".weight") and t.dtype not in ("BF16", "F16", "F32"):
            raise UserError(f"{source('int4', t.name)}: {t.name} is {t.dtype}, expected a "
                            "16/32-bit float to replace with FP8; dtype mismatch between sources, "
                            "check --int4")
        want = ((t.shape[1], t.shape[0] * 8) if t.name.endswith(".qweight") and len(t.shape) == 2
                else t.shape)
        if tuple(w.shape) != tuple(want):
            raise UserError(f"{source('fp8', w.name)}: {w.name} is {list(w.shape)} but "
                            f"{source('int4', t.name)} has {t.name} {t.dtype} {list(t.shape)} "
                            f"(weight {list(want)}); shape mismatch between sources, check --int4 "
                            "and --fp8 are one model")
        want_scale = tuple(math.ceil(d / b) for d, b in zip(want, block, strict=False))
        if scale.dtype not in ("BF16", "F32") or tuple(scale.shape) != want_scale:
            raise UserError(f"{source('fp8', scale.name)}: {scale.name} is {scale.dtype} "
                            f"{list(scale.shape)}, expected BF16 or F32 {list(want_scale)} for "
                            f"block {list(block)}; re-fetch it")
        chosen.append(module)
    int4_modules = {module_of(n) for n in int4_tensors}
    for module in chosen:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED_GROUPS:
            missing = [f"{parent}.{o}" for o in sorted(group - {leaf}) if leaf in group
                       and f"{parent}.{o}" in int4_modules and f"{parent}.{o}" not in chosen]
            if missing:
                raise UserError(f"{source('fp8', module + '.weight')}: {module} would be FP8 but "
                                f"{missing[0]} not; vLLM fuses them, so make --fp8-pattern cover "
                                "the whole group or none")
    return chosen
