"""How int8_lm_head hooks vLLM 0.32.0: the unquantized methods' process_weights_after_loading
quantizes a ParallelLMHead's weight in place and gives the head a method whose apply is INT8.
"""

from __future__ import annotations

import re
import sys
from typing import Any, cast

import torch
import vllm
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)

from .lm_head import _triton_gemv, int8_logits, quantize_rows

SUPPORTED_VLLM = ("0.32.0",)
LEVER = "int8_lm_head"
# vLLM 0.32 gives an unquantized ParallelLMHead one of two methods: UnquantizedEmbeddingMethod
# with no quant config (vocab_parallel_embedding.py), UnquantizedLinearMethod from a quant config
# that leaves lm_head out (INC/AutoRound, the 122B's INT4 checkpoint: inc.py get_quant_method).
HEAD_METHODS: tuple[type, ...] = (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)
ORIGINAL = "_sparkspec_levers_original"  # on a patched class: its process_weights_after_loading
SCALE = "sparkspec_int8_scale"  # a converted head's buffer: float32 [rows]
HEAD_DTYPES = (torch.bfloat16, torch.float16)
LEVER_OFF = "turn the lever off (levers: {int8_lm_head: false}; SPARKSPEC_LEVERS without it)"

# A name under "vllm.": vLLM's logging config puts its handler on the "vllm" logger.
logger = init_logger("vllm.sparkspec_levers")
_levers: dict[str, dict[str, Any]] = {}


def _fail(message: str) -> RuntimeError:
    return RuntimeError(f"sparkspec_levers: {message}")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_version(version: str) -> None:
    """Refuse a vLLM whose release (a local suffix such as +cpu aside) is not SUPPORTED_VLLM;
    pre-, post- and dev releases (0.32.0rc1, 0.32.0.dev3) are other code, so refused too."""
    release = re.fullmatch(r"(\d+(?:\.\d+)*)(?:\+[\w.]+)?", version.strip())
    if release is None or release.group(1) not in SUPPORTED_VLLM:
        raise _fail(f"vLLM {version} is not supported (the hooks are read against vLLM "
                    f"{', '.join(SUPPORTED_VLLM)}); unset SPARKSPEC_LEVERS or install that vLLM")


def enable(levers: dict[str, dict[str, Any]]) -> None:
    """Turn on the parsed levers in this process; each class is patched once."""
    check_version(vllm.__version__)
    _levers.clear()
    _levers.update(levers)
    if LEVER in levers:
        for cls in HEAD_METHODS:
            _patch(cls)


def is_patched() -> bool:
    return all(ORIGINAL in vars(cls) for cls in HEAD_METHODS)


def _patch(cls: type) -> None:
    if ORIGINAL in vars(cls):
        return
    original = vars(cls)["process_weights_after_loading"]

    def process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
        # A head the lever converts skips the original: on CUDA that does nothing; on CPU it
        # packs the bf16 weight for oneDNN (UnquantizedLinearMethod's also drops layer.weight)
        # for a bf16 apply the converted head no longer makes.
        if not _maybe_convert(self, layer):
            original(self, layer)

    process_weights_after_loading.__doc__ = original.__doc__
    process_weights_after_loading.__qualname__ = original.__qualname__
    setattr(cls, ORIGINAL, original)
    cls.process_weights_after_loading = process_weights_after_loading  # type: ignore[attr-defined]


def _int8_apply(self: Any, layer: torch.nn.Module, x: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    return int8_logits(x, cast(torch.Tensor, layer.weight), getattr(layer, SCALE), bias)


def _already_done(self: Any, layer: torch.nn.Module) -> None:
    return None


class Int8EmbeddingHeadMethod(UnquantizedEmbeddingMethod):
    """A converted head's method where vLLM gave it UnquantizedEmbeddingMethod."""

    apply = _int8_apply
    process_weights_after_loading = _already_done


class Int8LinearHeadMethod(UnquantizedLinearMethod):
    """A converted head's method where vLLM gave it UnquantizedLinearMethod."""

    apply = _int8_apply
    process_weights_after_loading = _already_done


CONVERTED: dict[type, type] = {UnquantizedEmbeddingMethod: Int8EmbeddingHeadMethod,
                               UnquantizedLinearMethod: Int8LinearHeadMethod}


def _model_tag() -> str:
    """vLLM's model tag: "backbone" for the target; a drafter loads under another (eagle_head,
    draft_model, dflash_head, ...: set_model_tag in llm_base_proposer.py, draft_model.py)."""
    backends = sys.modules.get("vllm.compilation.backends")
    return str(getattr(backends, "model_tag", "backbone"))


def _refusal(layer: ParallelLMHead, weight: torch.Tensor, min_vocab: int) -> str | None:
    """Why this head cannot turn INT8, or None."""
    vocab = int(getattr(layer, "org_vocab_size", weight.shape[0]))
    if weight.dtype not in HEAD_DTYPES:
        return f"weight dtype {_dtype(weight.dtype)}, the lever takes bfloat16 or float16"
    if vocab < min_vocab:
        return f"vocabulary {vocab} is under min_vocab {min_vocab}"
    if weight.is_cuda and _triton_gemv() is None:
        return "Triton cannot be imported, and the INT8 head on CUDA is a Triton kernel"
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.utils import is_weights_pre_processed

    if is_weights_pre_processed():
        return "the weights come pre-processed (weight cache loader)"
    config = get_current_vllm_config_or_none()
    if config is not None and getattr(config, "lora_config", None) is not None:
        return "LoRA is on (LogitsProcessorWithLoRA reads lm_head.weight as a float weight)"
    model_config = getattr(config, "model_config", None)
    head_dtype = getattr(model_config, "head_dtype", None)
    if head_dtype is not None and head_dtype != weight.dtype:
        return (f"head_dtype {_dtype(head_dtype)} differs from the weight's "
                "(LogitsProcessor then multiplies lm_head.weight itself)")
    return None


def _maybe_convert(method: Any, layer: torch.nn.Module) -> bool:
    """Turn a ParallelLMHead INT8 when the lever is on; True if it was (or already is)."""
    options = _levers.get(LEVER)
    if options is None or not isinstance(layer, ParallelLMHead):
        return False
    if type(method) not in CONVERTED or layer.quant_method is not method:
        return False  # a subclass of the unquantized methods calling super(): not ours
    weight = cast(torch.nn.Parameter, layer.weight)
    if weight.is_meta or weight.dim() != 2:
        return False  # a placeholder (vLLM's CPU dispatch skips these too)
    rows, cols = (int(size) for size in weight.shape)
    tag = _model_tag()
    draft = tag != "backbone"
    what = (f"the draft model's ({tag}) " if draft else "") + \
        f"LM head {layer.prefix or 'lm_head'} [{rows}, {cols}] {_dtype(weight.dtype)}"
    owner = getattr(getattr(weight, "weight_loader", None), "__self__", layer)
    if owner is not layer:  # made by another module: tied to the input embedding
        logger.info("sparkspec_levers: int8_lm_head: left %s alone: its weight is the input "
                    "embedding's (tied)", what)
        return False
    problem = _refusal(layer, weight, int(options["min_vocab"]))
    if problem is None:
        try:
            qweight, scale = quantize_rows(weight.data)
        except ValueError as exc:
            problem = str(exc).removeprefix("quantize_rows: ")
    if problem is not None:
        if draft:  # a drafter's own head (often a reduced vocabulary): the target's matters
            logger.info("sparkspec_levers: int8_lm_head: left %s as it is: %s", what, problem)
            return False
        raise _fail(f"int8_lm_head: {what}: {problem}; {LEVER_OFF}")
    saved = weight.numel() * weight.element_size() - qweight.numel() - scale.numel() * 4
    head_dtype = weight.dtype
    weight.data = qweight  # same shape, so shape checks elsewhere pass; frees the bf16 storage
    layer.register_buffer(SCALE, scale, persistent=False)
    method.__class__ = CONVERTED[type(method)]
    if weight.is_cuda:  # autotune and compile now, not inside a CUDA graph capture
        probe = torch.zeros((1, cols), dtype=head_dtype, device=weight.device)
        try:
            int8_logits(probe, qweight, scale)
        except Exception as exc:  # Triton's compile and launch errors have no common base
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise _fail(f"int8_lm_head: {what}: the Triton kernel failed on this card "
                        f"({first}); {LEVER_OFF}") from exc
    logger.info("sparkspec_levers: LM head -> INT8 ([%d, %d], saved %d MB)%s", rows, cols,
                round(saved / 1e6), f" in the draft model ({tag})" if draft else "")
    return True
