"""Fetch checkpoints with pinned revisions: whole repos (snapshot_download) and the FP8 subset that
``checkpoint assemble`` needs, read as HTTP byte ranges.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub._local_folder import read_download_metadata
from huggingface_hub.utils import filter_repo_objects
from huggingface_hub.utils import tqdm as hf_tqdm

from sparkspec import validate
from sparkspec.checkpoint.safetensors_io import (
    INDEX_NAME,
    Header,
    TensorInfo,
    encode_header,
    parse_header,
    read_header,
    read_index,
    write_index,
)
from sparkspec.checkpoint.selection import (
    fp8_candidates,
    fp8_pair,
    fp8_selection,
    int4_model_shards,
    int4_model_tensors,
    weight_block_size,
)
from sparkspec.errors import UserError
from sparkspec.hub.dest import (
    STATE_DIR,
    begin,
    claim,
    copy_local,
    finish,
    preflight,
    prune,
    recorded_shards,
    remove_stale,
    state,
    write_file,
    writing,
)
from sparkspec.hub.source import Reader, Source, hub_errors
from sparkspec.jsonfile import read_json
from sparkspec.progress import ProgressFile


@dataclass
class Plan:
    reader: Reader
    files: dict[str, int]  # path -> size, after allow_patterns

    @property
    def commit(self) -> str:
        return self.reader.commit

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


@dataclass
class FetchResult:
    repo: str
    commit: str
    dest: str
    mode: str
    changed: bool
    files: list[str] = field(default_factory=list)
    bytes_fetched: int = 0  # every body byte transferred in this run
    tensor_bytes_fetched: int = 0  # tensor data transferred in this run (headers excluded)
    tensor_bytes_used: int = 0  # tensor data the local checkpoint holds for assemble
    header_bytes: int = 0
    tensors: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def plan(source: Source, allow_patterns: Sequence[str] | None = None) -> Plan:
    """The commit a revision resolves to and the sizes of the files a fetch would bring (disk
    preflight)."""
    reader = Reader(source)
    patterns = list(allow_patterns or ["*"])
    names = list(filter_repo_objects([*reader.files, *reader.unsafe], allow_patterns=patterns))
    reader.check_names(names)
    return Plan(reader, {name: reader.files[name] for name in names})


# --- whole repos ---------------------------------------------------------------------------------
def fetch_repo(repo: str, revision: str, dest: str | os.PathLike[str],
               allow_patterns: Sequence[str] | None = None, token: str | None = None,
               endpoint: str | None = None, local_path: str | None = None,
               max_workers: int = 8, progress: ProgressFile | None = None) -> FetchResult:
    """Download (or copy from ``local_path``) the repo's files at the pinned revision into ``dest``;
    ``progress`` counts the bytes as huggingface_hub's own bar does (a local copy: file by file)."""
    out = Path(dest)
    claim(out, {"--local-path": local_path})
    p = plan(Source(repo, revision, endpoint, token, local_path), allow_patterns)
    todo = {rel: size for rel, size in p.files.items() if not _have(p.reader, out, rel)}
    preflight(out, sum(todo.values()))
    if progress:
        progress.set_total(sum(todo.values()))
    with writing(out):
        if local_path:
            for rel in todo:
                n = _fetch_whole(p.reader, rel, out)
                if progress:
                    progress.add(n)
        elif todo:
            with hub_errors(p.reader.source):
                snapshot_download(repo, revision=p.commit, local_dir=out,
                                  allow_patterns=list(todo), token=token,
                                  endpoint=p.reader.endpoint, max_workers=max_workers,
                                  tqdm_class=_counting(progress, SNAPSHOT_BAR) if progress
                                  else None)
        finish(out, {"repo": repo, "revision": revision, "commit": p.commit, "mode": "repo",
                     "files": p.files})
    return FetchResult(repo, p.commit, str(out), "repo", bool(todo), sorted(p.files),
                       bytes_fetched=sum(todo.values()))


def _have(reader: Reader, dest: Path, rel: str) -> bool:
    """A whole file already in place: for the hub, huggingface_hub's record of a finished download
    of this commit; for a local source, the same size."""
    target, size = dest / rel, reader.size(rel)
    if not (target.is_file() and target.stat().st_size == size):
        return False
    if reader.source.local_path:
        return True
    meta = read_download_metadata(dest, rel)
    return meta is not None and meta.commit_hash == reader.commit


def _fetch_whole(reader: Reader, rel: str, dest: Path) -> int:
    """One whole file into ``dest``: hf_hub_download (resumable, records the commit) or a local
    copy/link."""
    if reader.source.local_path:
        copy_local(validate.under(reader.source.local_path, rel), validate.under(dest, rel))
    else:
        with hub_errors(reader.source, rel):
            hf_hub_download(reader.source.repo, rel, revision=reader.commit, local_dir=dest,
                            endpoint=reader.endpoint, token=reader.source.token)
    return reader.size(rel)


SNAPSHOT_BAR = "huggingface_hub.snapshot_download"  # snapshot_download's bar of bytes written
SUBSET_BAR = "sparkspec.fp8_subset"


def _counting(progress: ProgressFile, name: str) -> type[hf_tqdm]:
    """huggingface_hub's bar class, whose bar called ``name`` also adds what it counts to
    ``progress`` (even when bars are off: no terminal, or HF_HUB_DISABLE_PROGRESS_BARS)."""

    class Counting(hf_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # huggingface_hub's tqdm subclass leaves __init__ unannotated (a third-party signature)
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
            self.counted = kwargs.get("name") == name

        def update(self, n: float | None = 1) -> bool | None:
            if self.counted and n:
                progress.set_total(int(self.total) if self.total else None)
                progress.add(int(n))
            return super().update(n)  # type: ignore[no-any-return]

    return Counting


# --- the FP8 subset ------------------------------------------------------------------------------
@dataclass
class _Shard:
    name: str
    header: Header
    tensors: list[TensorInfo]  # selected, in source order

    def prefix(self) -> bytes:
        specs = [(t.name, t.dtype, t.shape, t.nbytes) for t in self.tensors]
        return encode_header(specs, self.header.metadata)[0]

    def body(self, reader: Reader, tally: list[int], bar: Any) -> Iterator[bytes]:
        """The subset file: a fresh header, then the selected tensors' bytes as fetched."""
        yield self.prefix()
        for start, end in self.ranges():
            for chunk in reader.chunks(self.name, start, end):
                tally[0] += len(chunk)
                bar.update(len(chunk))
                yield chunk

    def ranges(self) -> list[tuple[int, int]]:
        """Absolute byte ranges of the selected tensors, adjacent ones merged."""
        merged: list[tuple[int, int]] = []
        for t in self.tensors:
            start, end = self.header.data_start + t.begin, self.header.data_start + t.end
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((start, end))
        return merged


def _cached(reader: Reader, path: Path, rel: str,
            parse: Callable[[Callable[[int, int], bytes]], Any], tally: list[int]) -> Any:
    """``parse(read)`` over the leading bytes of ``rel``; the bytes read are kept in ``path`` (per
    commit) so that a re-run of the same commit transfers nothing."""
    if path.is_file():
        raw = validate.read_regular(path, "cached header")
        return parse(lambda offset, length: raw[offset: offset + length])
    got = bytearray()

    def read(offset: int, length: int) -> bytes:
        data = reader.read(rel, offset, length)
        got.extend(data)
        tally[0] += len(data)
        return data

    result = parse(read)
    write_file(path.parent, path.name, [bytes(got)], sync=False)
    return result


def _select(reader: Reader, int4: Path, patterns: Sequence[str], config: Path, cache: Path,
            tally: list[int]) -> list[_Shard]:
    """The FP8 tensors assemble will take, by assemble's own rule (``fp8_candidates`` on names,
    then ``fp8_selection`` on headers): the FP8 index, then only the headers of shards holding
    candidates."""
    label = reader.source.label
    index4 = read_index(int4)["weight_map"]
    int4_tensors = int4_model_tensors(read_header(int4 / f) for f in int4_model_shards(index4))
    _cached(reader, cache / INDEX_NAME, INDEX_NAME, lambda read: read(0, reader.size(INDEX_NAME)),
            tally)
    index8: dict[str, str] = read_index(cache)["weight_map"]
    names = [n for m in fp8_candidates(int4_tensors, index8, patterns) for n in fp8_pair(m)]
    headers: dict[str, Header] = {}
    for shard in sorted({index8[n] for n in names}):
        size = reader.size(shard)
        parse = functools.partial(parse_header, size=size, source=f"{label}: {shard}")
        headers[shard] = _cached(reader, cache / f"{shard}.header", shard, parse, tally)
    missing = [n for n in names if n not in headers[index8[n]].tensors]
    if missing:
        raise UserError(f"{label}: {INDEX_NAME} maps {missing[0]} to {index8[missing[0]]}, whose "
                        "header has no such tensor; the repo is inconsistent, pin another revision")
    fp8_tensors = {n: headers[index8[n]].tensors[n] for n in names}
    doc = read_json(config, "config.json not found; re-fetch it", "re-fetch it")
    try:
        block = weight_block_size(doc)
    except (AttributeError, TypeError):
        raise UserError(f"{config}: has no quantization_config object; check the FP8 "
                        "repo") from None

    def where(side: str, name: str) -> str:
        return f"{label}: {index8[name]}" if side == "fp8" else str(int4 / index4[name])

    modules = fp8_selection(int4_tensors, fp8_tensors, patterns, block, where)
    if not modules:
        raise UserError(f"{label}: no tensor of {int4} has an F8_E4M3 X.weight with "
                        "X.weight_scale_inv there; check that the repos are one model's INT4/FP8 "
                        "pair (or use --fp8-pattern)")
    picked: dict[str, list[TensorInfo]] = {}
    for module in modules:
        for n in fp8_pair(module):
            picked.setdefault(index8[n], []).append(fp8_tensors[n])
    return [_Shard(shard, headers[shard], sorted(ts, key=lambda t: t.begin))
            for shard, ts in sorted(picked.items())]


def fetch_fp8_subset(repo: str, revision: str, int4_dir: str | os.PathLike[str],
                     dest: str | os.PathLike[str], patterns: Sequence[str] = (),
                     token: str | None = None, endpoint: str | None = None,
                     local_path: str | None = None, mode: str = "ranges", retries: int = 5,
                     progress: ProgressFile | None = None) -> FetchResult:
    """Build in ``dest`` a small FP8 source checkpoint holding only the tensors ``checkpoint
    assemble`` takes from the FP8 repo (assemble's rule, see :func:`_select`), plus its config and
    other non-weight files. ``mode="ranges"`` fetches only those tensors' byte ranges;
    ``mode="full"`` downloads the whole shards that hold them (for mirrors without Range support).
    ``progress`` counts the tensor bytes (whole shards with ``full``) as they arrive."""
    if mode not in ("ranges", "full"):
        raise UserError(f"--mode {mode}: unknown; use ranges or full")
    out, int4 = Path(dest), Path(int4_dir)
    claim(out, {"--int4": int4, "--local-path": local_path})
    read_index(int4)  # fail early, naming the INT4 index, before any transfer
    reader = Reader(Source(repo, revision, endpoint, token, local_path, retries))
    side = [rel for rel in sorted(reader.files)
            if not rel.endswith(".safetensors") and rel != INDEX_NAME]
    reader.check_names(n for n in reader.unsafe if not n.endswith(".safetensors"))
    if "config.json" not in side:
        raise UserError(f"{reader.source.label}: config.json not found (404); check the repo and "
                        "revision")
    side = [rel for rel in side if not _have(reader, out, rel)]
    preflight(out, sum(reader.size(rel) for rel in side))
    with writing(out):
        return _fetch_subset(reader, int4, out, side, patterns, mode, progress)


def _fetch_subset(reader: Reader, int4: Path, out: Path, side: list[str],
                  patterns: Sequence[str], mode: str, progress: ProgressFile | None) -> FetchResult:
    repo, previous = reader.source.repo, state(out)
    tally = [0]  # body bytes transferred outside the tensor data
    for rel in side:
        tally[0] += _fetch_whole(reader, rel, out)
    cache = out / STATE_DIR / "headers" / reader.commit
    prune(out / STATE_DIR / "headers", cache)
    shards = _select(reader, int4, patterns, out / "config.json", cache, tally)
    used = sum(t.nbytes for s in shards for t in s.tensors)
    names = sorted(t.name for s in shards for t in s.tensors)
    key = f"{reader.commit}:{mode}:" + hashlib.sha256("\n".join(names).encode()).hexdigest()
    if mode == "full":
        todo = {s.name: s.header.file_size for s in shards if not _have(reader, out, s.name)}
        weight_map = {t: s.name for s in shards for t in s.header.tensors}
        total_size = sum(s.header.data_size for s in shards)
    else:
        todo = begin(out, key, {s.name: len(s.prefix()) + sum(t.nbytes for t in s.tensors)
                                for s in shards})
        weight_map = {t.name: s.name for s in shards for t in s.tensors}
        total_size = used
    remove_stale(out, recorded_shards(previous), {s.name for s in shards})
    preflight(out, sum(todo.values()))
    fetched = [0]
    if mode == "full":
        if progress:
            progress.set_total(sum(todo.values()))
        for name in todo:
            fetched[0] += _fetch_whole(reader, name, out)
            if progress:
                progress.add(reader.size(name))
    else:
        total = sum(t.nbytes for s in shards if s.name in todo for t in s.tensors)
        bar_class = _counting(progress, SUBSET_BAR) if progress else hf_tqdm
        with bar_class(total=total, unit="B", unit_scale=True, desc=f"FP8 tensors of {repo}",
                       name=SUBSET_BAR) as bar:
            for shard in (s for s in shards if s.name in todo):
                write_file(out, shard.name, shard.body(reader, fetched, bar))
    index_changed = _write_index_if_changed(out, weight_map, total_size)
    local_path = reader.source.local_path
    finish(out, {"key": key, "repo": repo, "revision": reader.source.revision,
                 "commit": reader.commit, "mode": mode,
                 "endpoint": None if local_path else reader.endpoint, "local_path": local_path,
                 "tensors": names, "shards": sorted(s.name for s in shards)})
    return FetchResult(repo, reader.commit, str(out), mode, bool(todo) or index_changed,
                       sorted(s.name for s in shards), bytes_fetched=tally[0] + fetched[0],
                       tensor_bytes_fetched=fetched[0], tensor_bytes_used=used,
                       header_bytes=sum(p.stat().st_size for p in cache.glob("*.header")),
                       tensors=len(names))


def _write_index_if_changed(out: Path, weight_map: dict[str, str], total_size: int) -> bool:
    if (out / INDEX_NAME).is_file():
        current = read_index(out)
        if (current["weight_map"] == weight_map
                and current["metadata"].get("total_size") == total_size):
            return False
    write_index(out, weight_map, total_size)
    return True
