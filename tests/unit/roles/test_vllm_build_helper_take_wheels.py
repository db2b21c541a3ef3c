"""A cluster worker's copy of its head's wheels (roles/vllm_build/files/vllm_build_helper.py
take-wheels), run as the role runs it: root copies from a folder the unprivileged user's fetch
wrote, so a link or a hard link planted there, or bytes that are not the head's, must leave nothing
in root's wheelhouse."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).resolve().parents[3] / "roles/vllm_build/files/vllm_build_helper.py"
ME = __import__("pwd").getpwuid(os.getuid()).pw_name


def take(staging: Path, dest: Path, sums: dict[str, str],
         owner: str = ME) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(HELPER), "take-wheels", str(staging), str(dest),
            json.dumps(sums), owner]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    staging, dest = tmp_path / "staging", tmp_path / "dest"
    staging.mkdir()
    dest.mkdir()
    return staging, dest


def wheel(folder: Path, name: str, data: bytes) -> str:
    (folder / name).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def test_the_head_s_wheels_are_copied_byte_for_byte_and_nothing_else(
        dirs: tuple[Path, Path]) -> None:
    staging, dest = dirs
    names = ("vllm-0.32.0-cp38-abi3-linux_aarch64.whl", "flashinfer_python-0.7.0-py3-none-any.whl")
    sums = {names[0]: wheel(staging, names[0], b"vllm" * 300000),
            names[1]: wheel(staging, names[1], b"fi")}
    # in staging, not in the head's list
    wheel(staging, "extra-1.0-py3-none-any.whl", b"not the head's")
    proc = take(staging, dest, sums)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"copied": sorted(sums)}
    assert sorted(p.name for p in dest.iterdir()) == sorted(sums)
    for name, digest in sums.items():
        assert hashlib.sha256((dest / name).read_bytes()).hexdigest() == digest
        assert (dest / name).stat().st_mode & 0o777 == 0o644


def test_a_planted_symlink_is_not_followed(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    staging, dest = dirs
    secret = tmp_path / "secret"
    secret.write_bytes(b"root only")
    (staging / "vllm-1-py3-none-any.whl").symlink_to(secret)
    proc = take(staging, dest,
                {"vllm-1-py3-none-any.whl": hashlib.sha256(b"root only").hexdigest()})
    assert proc.returncode == 1 and "vllm-1-py3-none-any.whl" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(dest.iterdir()) == []


def test_a_hard_link_a_staging_folder_link_and_another_owner_are_refused(dirs: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    staging, dest = dirs
    digest = wheel(tmp_path, "other.whl", b"someone's file")
    os.link(tmp_path / "other.whl", staging / "vllm-1-py3-none-any.whl")
    proc = take(staging, dest, {"vllm-1-py3-none-any.whl": digest})
    assert proc.returncode == 1 and "one link" in proc.stderr
    linked = tmp_path / "linked-staging"
    linked.symlink_to(staging)
    assert take(linked, dest, {"vllm-1-py3-none-any.whl": digest}).returncode == 1
    (staging / "vllm-1-py3-none-any.whl").unlink()
    digest = wheel(staging, "vllm-1-py3-none-any.whl", b"mine")
    other = "nobody" if ME == "root" else "root"
    assert "not a regular file of" in \
        take(staging, dest, {"vllm-1-py3-none-any.whl": digest}, other).stderr
    assert list(dest.iterdir()) == []


def test_bytes_that_are_not_the_head_s_leave_no_file_and_no_temp(dirs: tuple[Path, Path]) -> None:
    staging, dest = dirs
    wheel(staging, "vllm-1-py3-none-any.whl", b"tampered")
    proc = take(staging, dest,
                {"vllm-1-py3-none-any.whl": hashlib.sha256(b"the head's").hexdigest()})
    assert proc.returncode == 1 and "is not the head's" in proc.stderr
    assert list(dest.iterdir()) == []   # neither the wheel's name nor a temp sibling


@pytest.mark.parametrize("name", ["../vllm-1-py3-none-any.whl", "sub/vllm-1.whl", ".hidden.whl",
                                  "vllm-1.tar.gz"])
def test_a_name_that_is_not_a_wheel_s_is_refused(dirs: tuple[Path, Path], name: str) -> None:
    staging, dest = dirs
    proc = take(staging, dest, {name: "0" * 64})
    assert proc.returncode == 1 and "is not a wheel's file name" in proc.stderr


def test_a_wheelhouse_that_is_the_staging_folder_is_refused(dirs: tuple[Path, Path]) -> None:
    staging, _ = dirs
    digest = wheel(staging, "vllm-1-py3-none-any.whl", b"the head's")
    proc = take(staging, staging, {"vllm-1-py3-none-any.whl": digest})
    assert proc.returncode == 1 and "are one folder" in proc.stderr
    assert sorted(p.name for p in staging.iterdir()) == ["vllm-1-py3-none-any.whl"]
