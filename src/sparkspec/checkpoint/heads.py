"""Check a draft head (EAGLE3 or DFlash) against its target before the
server is touched, from the two config.json files and the head's
safetensors headers (no weights): one line naming the field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.checkpoint.safetensors_io import read_header
from sparkspec.errors import UserError

# the methods that draft with a head: the registry's
from sparkspec.registry.data import HEAD_KINDS as METHODS


@dataclass(frozen=True)
class HeadReport:
    method: str
    head: str
    architecture: str
    hidden_size: int
    aux_layers: list[int]
    target_layers: int
    tensors: int

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "head": self.head, "architecture": self.architecture,
                "hidden_size": self.hidden_size, "aux_layers": self.aux_layers,
                "target_layers": self.target_layers, "tensors": self.tensors}


def _config(folder: Path, what: str) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: {what} config.json not found; give the {what}'s folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: {what} config.json unreadable ({exc}); re-fetch the "
                        f"{what}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: {what} config.json is not a JSON object; re-fetch the {what}")
    text = doc.get("text_config")
    return (text | {k: v for k, v in doc.items() if k != "text_config"} if isinstance(text, dict)
            else doc)


def _int(doc: dict[str, Any], key: str, where: str, minimum: int = 1) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{where}: {key} is {value!r}, expected an integer >= {minimum}; fix the "
                        "config.json")
    return value


def _layer_ids(value: object, where: str, key: str, top: int, meaning: str) -> list[int]:
    if (not isinstance(value, list) or not value
            or any(not isinstance(i, int) or isinstance(i, bool) for i in value)):
        raise UserError(f"{where}: {key} is {value!r}, expected a non-empty list of layer numbers; "
                        "fix the head's config.json")
    bad = [i for i in value if not 0 <= i <= top]
    if bad:
        raise UserError(f"{where}: {key} {value} has {bad} outside 0..{top} ({meaning}); "
                        "use a head made for this target")
    return list(value)


def _shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder}: no *.safetensors in the head's folder; re-fetch the head")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        shapes.update({n: t.shape for n, t in read_header(path).tensors.items()})
    return shapes


def check_head(method: str, head: str | Path, target: str | Path,
               k: int | None = None) -> HeadReport:
    """The head's report, or UserError naming the first mismatch with
    ``target`` and the fix; ``k``: the method's num_speculative_tokens,
    which a DFlash head's block must hold (the bonus token and k drafts)."""
    if method not in METHODS:
        raise UserError(f"--method {method}: not a head method; use one of {', '.join(METHODS)}")
    head, target = Path(head), Path(target)
    hcfg, tcfg = _config(head, "head"), _config(target, "target")
    where = f"{head}/config.json"
    arch = (hcfg.get("architectures") or ["?"])[0]
    if method == "dflash" and arch != "DFlashDraftModel":
        raise UserError(f"{where}: architectures is {hcfg.get('architectures')!r}, a DFlash head "
                        "has [DFlashDraftModel]; give the DFlash head's folder")
    if method == "eagle3" and "eagle3" not in str(arch).lower():
        raise UserError(f"{where}: architectures is {hcfg.get('architectures')!r}, not an EAGLE3 "
                        "head (e.g. LlamaForCausalLMEagle3); give the EAGLE3 head's folder")
    t_hidden = _int(tcfg, "hidden_size", f"{target}/config.json")
    layers = _int(tcfg, "num_hidden_layers", f"{target}/config.json")
    h_hidden = _int(hcfg, "hidden_size", where)
    reads = hcfg.get("target_hidden_size") or h_hidden
    if reads != t_hidden:
        key = "target_hidden_size" if hcfg.get("target_hidden_size") else "hidden_size"
        raise UserError(f"{where}: {key} {reads} does not match the target's hidden_size "
                        f"{t_hidden} ({target}); use a head trained for this target")
    if method == "dflash":
        dcfg = hcfg.get("dflash_config")
        if not isinstance(dcfg, dict):
            raise UserError(f"{where}: no dflash_config (block_size, mask_token_id, "
                            "target_layer_ids); vLLM needs it to draft with DFlash: use a DFlash "
                            "head that has it")
        block = _int(dcfg, "block_size", f"{where} dflash_config", minimum=2)
        if k is not None and k > block - 1:
            raise UserError(f"{where}: k {k} does not fit this DFlash head's block (dflash_config."
                            f"block_size {block}: the bonus token and k drafts); set "
                            f"num_speculative_tokens <= {block - 1}")
        mask = _int(dcfg, "mask_token_id", f"{where} dflash_config", minimum=0)
        vocab = _int(hcfg, "vocab_size", where)
        if mask >= vocab:
            raise UserError(f"{where}: dflash_config.mask_token_id {mask} is outside the "
                            f"vocabulary (0..{vocab - 1}); fix the head's config.json")
        aux = _layer_ids(dcfg.get("target_layer_ids"), where, "dflash_config.target_layer_ids",
                         layers - 1, f"the target has {layers} layers, numbered from 0")
    else:
        ecfg = hcfg["eagle_config"] if isinstance(hcfg.get("eagle_config"), dict) else {}
        ids = ecfg.get("eagle_aux_hidden_state_layer_ids",
                       hcfg.get("eagle_aux_hidden_state_layer_ids"))
        aux = [] if ids is None else _layer_ids(
            ids, where, "eagle_aux_hidden_state_layer_ids", layers,
            f"the target has {layers} layers: id i is the input of layer i, {layers} the last "
            "output")
    t_vocab = _int(tcfg, "vocab_size", f"{target}/config.json")
    shapes = _shapes(head)
    _check_tensors(where, shapes, hcfg, t_vocab, h_hidden, t_hidden, len(aux) or 3)
    return HeadReport(method, str(head), str(arch), h_hidden, aux, layers, len(shapes))


def _check_tensors(where: str, shapes: dict[str, tuple[int, ...]], hcfg: dict[str, Any],
                   t_vocab: int, h_hidden: int, t_hidden: int, n_aux: int) -> None:
    fc = shapes.get("fc.weight") or shapes.get("model.fc.weight")
    if fc is None:
        raise UserError(f"{where}: the head has no fc.weight (the layer that reads the target's "
                        "hidden states); re-fetch the head")
    if fc != (h_hidden, n_aux * t_hidden):
        raise UserError(f"{where}: fc.weight is {list(fc)}, expected [{h_hidden}, "
                        f"{n_aux * t_hidden}] for {n_aux} aux states of hidden size "
                        f"{t_hidden}; the head's aux layer list does not fit its fc: use a head "
                        "made for this target")
    vocab = hcfg.get("draft_vocab_size") or hcfg.get("vocab_size")
    has_map = any(n.endswith("d2t") for n in shapes)
    if vocab != t_vocab and not (has_map and isinstance(vocab, int) and vocab < t_vocab):
        raise UserError(f"{where}: vocabulary {vocab} differs from the target's {t_vocab} (and no "
                        "d2t map); use a head made for this target's tokenizer")
