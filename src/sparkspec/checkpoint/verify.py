"""verify: a sharded safetensors checkpoint is complete and consistent, MTP head included; in a
hybrid that assemble wrote, its files still hold the bytes the manifest recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec.checkpoint import manifest as ckpt_manifest
from sparkspec.checkpoint.safetensors_io import INDEX_NAME, Header, read_header, read_index
from sparkspec.checkpoint.selection import has_config, read_config
from sparkspec.errors import UserError
from sparkspec.validate import source_file

SAMPLE_FILES = 2
SAMPLE_TENSORS_PER_FILE = 4


@dataclass
class VerifyReport:
    directory: Path
    files: int = 0
    tensors: int = 0
    total_size: int = 0
    mtp: int = 0
    expected_mtp: int | None = None
    fp8_weights: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loader: str = ""
    rehashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"changed": False, "ok": self.ok, "dir": str(self.directory), "files": self.files,
                "tensors": self.tensors, "total_size": self.total_size, "mtp_tensors": self.mtp,
                "expected_mtp": self.expected_mtp, "fp8_weights": self.fp8_weights,
                "problems": self.problems, "notes": self.notes, "loader": self.loader,
                "rehashed": self.rehashed}


def expected_mtp_from_config(directory: Path) -> tuple[int | None, str]:
    """4 + mtp_num_hidden_layers x (3 x num_experts + 13) for Qwen3.5-MoE; (None, why) when unknown.
    The config is checked by assemble's own function
    (:func:`sparkspec.checkpoint.selection.read_config`): what build accepts, verify accepts."""
    if not has_config(directory):
        return None, (f"{directory / 'config.json'} missing: MTP count not checked (pass "
                      "--expect-mtp)")
    return read_config(directory, "the checkpoint").expected_mtp()


def _structure(directory: Path, weight_map: dict[str, str], declared_total: Any,
               report: VerifyReport) -> dict[str, Header]:
    headers: dict[str, Header] = {}
    for file in sorted(set(weight_map.values())):
        try:
            headers[file] = read_header(directory / file)
        except UserError as exc:
            report.problems.append(str(exc))
    total = 0
    for tensor, file in weight_map.items():
        if file not in headers:
            continue
        info = headers[file].tensors.get(tensor)
        if info is None:
            report.problems.append(f"{directory / file}: index maps {tensor} here but the file has "
                                   "no such tensor")
        else:
            total += info.nbytes
    for file, header in headers.items():
        for tensor in header.tensors:
            if weight_map.get(tensor) != file:
                where = (f"maps it to {weight_map[tensor]}" if tensor in weight_map
                         else "does not list it")
                report.problems.append(f"{directory / file}: holds {tensor} but the index {where}")
        for tensor, info in header.tensors.items():
            if info.dtype == "F8_E4M3" and tensor.endswith(".weight"):
                report.fp8_weights += 1
                if f"{tensor}_scale_inv" not in weight_map:
                    report.problems.append(f"{directory / file}: FP8 {tensor} has no "
                                           f"{tensor}_scale_inv in the index")
    if declared_total != total:
        report.problems.append(f"{directory / INDEX_NAME}: metadata.total_size is "
                               f"{declared_total}, the mapped tensors hold {total} bytes")
    report.files, report.tensors, report.total_size = len(headers), len(weight_map), total
    for path in sorted(directory.glob("*.safetensors")):
        if path.name not in headers and path.is_file():
            report.notes.append(f"{path.name} is not named by the index: vLLM never reads it")
    return headers


def _sample_load(directory: Path, headers: dict[str, Header], report: VerifyReport) -> None:
    try:
        import torch
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot check here"
        report.loader = ("loader check skipped: fastsafetensors/torch not importable "
                         f"({exc.__class__.__name__}: {exc})")
        return
    files = sorted(headers, key=lambda f: (directory / f).stat().st_size)[:SAMPLE_FILES]
    loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
    checked = 0
    try:
        loader.add_filenames({0: [str(directory / f) for f in files]})
        buffers = loader.copy_files_to_device()
        try:
            for file in files:
                header = headers[file]
                names = list(header.tensors)
                picks = {names[0], names[-1],
                         *[n for n in names if header.tensors[n].dtype == "F8_E4M3"][:1],
                         *[n for n in names if n.startswith("mtp.")][:1]}
                with open(directory / file, "rb") as fh:
                    for name in sorted(picks)[:SAMPLE_TENSORS_PER_FILE]:
                        info = header.tensors[name]
                        tensor = buffers.get_tensor(name)
                        raw = os.pread(fh.fileno(), info.nbytes, header.data_start + info.begin)
                        loaded = (tensor.contiguous().view(torch.uint8).numpy().tobytes()
                                  if info.nbytes else b"")
                        if tuple(tensor.shape) != info.shape or loaded != raw:
                            report.problems.append(f"{directory / file}: {name} loads with "
                                                   f"fastsafetensors as {tensor.dtype} "
                                                   f"{list(tensor.shape)}, not the bytes on disk")
                        checked += 1
        finally:
            buffers.close()
    except Exception as exc:  # noqa: BLE001 - a loader failure is a verification finding
        report.problems.append(f"{directory}: fastsafetensors failed to load {', '.join(files)} "
                               f"({exc.__class__.__name__}: {exc})")
    finally:
        loader.close()
    report.loader = (f"fastsafetensors loaded {checked} sample tensors from {len(files)} files "
                     "(cpu, nogds)")


def _against_manifest(directory: Path, weight_map: dict[str, str], full: bool,
                      report: VerifyReport) -> None:
    """Assemble's own files as it wrote them:
    re-hash those whose stat record changed (all with ``full``)."""
    if not os.path.lexists(directory / ckpt_manifest.MANIFEST_NAME):
        if full:
            raise UserError(f"{directory / ckpt_manifest.MANIFEST_NAME}: not found; --full "
                            "re-hashes the files against the digests assemble records there: point "
                            "at an assembled hybrid, or drop --full")
        report.notes.append(f"no {ckpt_manifest.MANIFEST_NAME}: file contents not checked against "
                            "digests")
        return
    manifest = ckpt_manifest.load(directory)
    names = (ckpt_manifest.digested(manifest) if full
             else ckpt_manifest.stale_outputs(directory, manifest))
    report.problems.extend(ckpt_manifest.check_digests(directory, manifest, names))
    report.rehashed = len([n for n in names if manifest["hash"] in manifest["outputs"][n]])
    for tensor, file in manifest["weight_map"].items():
        if weight_map.get(tensor) != file:
            report.problems.append(f"{directory / INDEX_NAME}: no longer maps {tensor} to {file} "
                                   "as assemble wrote it; re-run checkpoint assemble")
            break
    if not full and names:
        report.notes.append(f"re-hashed {len(names)} file(s) changed on disk since assemble "
                            "recorded them")


def verify(directory: Path, expect_mtp: int | None = None, load_sample: bool = True,
           full: bool = False) -> VerifyReport:
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: not a directory; point at the assembled checkpoint")
    # every file verify may read or hash: none may link out of the folder
    for entry in os.scandir(directory):
        if entry.is_symlink():
            source_file(directory, Path(entry.path), "the checkpoint")
    doc = read_index(directory)
    weight_map: dict[str, str] = doc["weight_map"]
    report = VerifyReport(directory)
    metadata = doc.get("metadata") or {}
    headers = _structure(directory, weight_map, metadata.get("total_size"), report)
    # FP8 checkpoints carry a weight_scale_inv beside
    # each quantized MTP weight: count weights, not scales
    report.mtp = sum(1 for t in weight_map if t.startswith("mtp.") and not t.endswith("_scale_inv"))
    if expect_mtp is None:
        expect_mtp, why = expected_mtp_from_config(directory)
        report.notes.append("expected MTP tensors: "
                            f"{expect_mtp if expect_mtp is not None else '?'} ({why})")
    report.expected_mtp = expect_mtp
    _against_manifest(directory, weight_map, full, report)
    if expect_mtp is not None and report.mtp != expect_mtp:
        report.problems.append(f"{directory / INDEX_NAME}: maps {report.mtp} mtp.* tensors, "
                               f"expected {expect_mtp}; run `sparkspec checkpoint add-mtp` (vLLM "
                               "would run MTP on uninitialised weights)")
    if report.problems:
        report.loader = "loader check skipped: structural problems first"
    elif not load_sample:
        report.loader = "loader check skipped: disabled (--no-load)"
    else:
        _sample_load(directory, headers, report)
    return report
