"""Fixtures of the checkpoint tests (all named ckpt_*): generated real-format checkpoints and the
real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkspec.checkpoint.safetensors_io import encode_header, read_header
from tests.badinput import Outcome, assert_refused, run
from tests.support import testckpt
from tests.support.testckpt import ModelSpec, write_fp8, write_int4_autoround

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliResult:
    rc: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        import json

        return json.loads(self.stdout.strip().splitlines()[-1])


def run_cli(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> CliResult:
    proc = subprocess.run([sys.executable, "-m", "sparkspec.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})}, timeout=300, check=False)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime_ns of every file under root (hidden included)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(),
                                                path.stat().st_mtime_ns)
    return out


def add_tensor(path: Path, name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
    """Rewrite a shard with one more tensor at the end (a valid file on its own)."""
    header = read_header(path)
    raw = path.read_bytes()
    specs = [(t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors.values()]
    prefix, _ = encode_header([*specs, (name, dtype, shape, len(data))], header.metadata)
    path.write_bytes(prefix + raw[header.data_start:] + data)


@dataclass
class CkptPair:
    int4: Path
    fp8: Path
    out: Path
    spec: testckpt.ModelSpec


@dataclass
class Tree:
    root: Path
    int4: Path
    fp8: Path
    out: Path

    def assemble(self) -> list[str | Path]:
        return ["checkpoint", "assemble", "--int4", self.int4, "--fp8", self.fp8, "--out", self.out]

    def hybrid(self, mtp: bool = True) -> Path:
        """An assembled hybrid (with its MTP head registered) in ``out``."""
        assert run(*self.assemble()).rc == 0
        if mtp:
            assert run("checkpoint", "add-mtp", "--source", self.int4, "--target", self.out).rc == 0
        return self.out


@pytest.fixture
def ckpt_tree(ckpt_sources: dict[str, Path], tmp_path: Path) -> Tree:
    """Copies of the INT4 and FP8 sources in tmp_path (its own root: the bad-input tests fingerprint
    it)."""
    for name in ("int4", "fp8"):
        shutil.copytree(ckpt_sources[name], tmp_path / name)
    return Tree(tmp_path, tmp_path / "int4", tmp_path / "fp8", tmp_path / "out")


@pytest.fixture(scope="session")
def ckpt_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Pristine generated checkpoints (never modified; tests copy them)."""
    root = tmp_path_factory.mktemp("ckpt_sources")
    spec = testckpt.ModelSpec()
    testckpt.write_int4_autoround(root / "int4", spec, index_lists_mtp=False)
    testckpt.write_int4_autoround(root / "int4_listed", spec, index_lists_mtp=True)
    testckpt.write_fp8(root / "fp8", spec)
    testckpt.write_fp8(root / "fp8_f32", spec, scale_dtype="F32")
    return {p.name: p for p in root.iterdir()}


@pytest.fixture
def ckpt_pair(ckpt_sources: dict[str, Path], tmp_path: Path) -> CkptPair:
    for name in ("int4", "int4_listed", "fp8", "fp8_f32"):
        shutil.copytree(ckpt_sources[name], tmp_path / name)
    return CkptPair(tmp_path / "int4", tmp_path / "fp8", tmp_path / "out", testckpt.ModelSpec())


@pytest.fixture
def ckpt_cli() -> Callable[..., CliResult]:
    return run_cli


@pytest.fixture
def ckpt_tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """Mount small tmpfs filesystems (root needed), read-only on request; skip with the reason when
    mounting is refused."""
    mounts: list[Path] = []

    def mount(size: str, readonly: bool = False) -> Path:
        point = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        point.mkdir()
        options = f"size={size}" + (",ro" if readonly else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(point)
        return point

    yield mount
    for point in reversed(mounts):
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture()
def repo_dir(tmp_path: Path) -> Path:
    """A small repo folder for the hub's tests: a safetensors file, a config and a file in a
    subfolder."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.safetensors").write_bytes(os.urandom(300_000))
    (src / "config.json").write_text('{"model_type": "tiny"}\n')
    (src / "sub" / "notes.txt").write_text("hello\n")
    return src


# --- shared by the hub's refusal tests (hub/, cli/test_hub.py, core/test_progress.py) -------------
@pytest.fixture()
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("SPARKSPEC_HUB_TOKENS", raising=False)


def _small_repo(path: Path, text: str = "tiny") -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": text}) + "\n")
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    (path / "sub" / "notes.txt").write_text("hello\n")
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pair")
    write_int4_autoround(base / "int4", ModelSpec(), shards=2)
    write_fp8(base / "fp8", ModelSpec(), shards=2)
    return {"int4": base / "int4", "fp8": base / "fp8"}


def _serve_refused(argv: list[str | Path], env: dict[str, str], match: str) -> None:
    """``hub serve`` run apart (a server that starts never returns): refused at once, one line."""
    try:
        proc = subprocess.run([sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--port", "0",
                               *map(str, argv)], capture_output=True, text=True, timeout=15,
                              check=False, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        pytest.fail(f"hub serve {argv} with {env} started serving")
    assert_refused(Outcome(proc.returncode, proc.stdout, proc.stderr), 2, match)


REV = "a" * 40


def _tree(root: Path) -> dict[str, Path]:
    """int4 (a folder with an index), src (a --local-path copy of a repo), foreign (someone's
    folder)."""
    int4, src, foreign = root / "int4", root / "src", root / "foreign"
    for folder in (int4, src, foreign):
        folder.mkdir()
    (int4 / "model.safetensors.index.json").write_text('{"weight_map": {}}\n')
    (src / "config.json").write_text("{}\n")
    (foreign / "notes.txt").write_text("mine\n")
    return {"int4": int4, "src": src, "foreign": foreign}


def _repo(dest: str | Path, src: Path) -> list[str]:
    return ["repo", "org/name", "--revision", REV, "--dest", str(dest), "--local-path", str(src)]


def _fp8_subset(dest: str | Path, int4: str | Path, src: Path) -> list[str]:
    return ["fp8-subset", "org/fp8", "--revision", REV, "--int4", str(int4), "--dest", str(dest),
            "--local-path", str(src)]


def _dangling(t: Path) -> Path:
    (t / "d").symlink_to(t / "nowhere")
    return t / "d"


def _fifo(t: Path) -> Path:
    os.mkfifo(t / "d")
    return t / "d"
