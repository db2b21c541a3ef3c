"""What the vllm_build molecule scenario gets from the controller
(roles/vllm_build/molecule/default): the stand-in vLLM tree packed as a release tarball, the same
tree as a bare git repository with two tagged commits that differ by a file (a changed ref), both
stand-in torch wheels (cu130 and cpu), a stand-in flashinfer-python wheel, flash-attention's real
CMake files as a one-commit repository, and a patch that does not apply to the tree. Written to one
folder, which the scenario's prepare copies to /opt/standin on the host; the tarballs' sha256 go to
it through the environment, as a site's pinned digests would."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tests.support.torch_standin import buildenv

STANDIN = Path(__file__).resolve().parent / "vllm_standin"
# Not a diff of the stand-in: its context line is in no file of the tree, so `patch --fuzz=0`
# refuses it.
BROKEN_PATCH = """\
--- a/setup.py
+++ b/setup.py
@@ -1,3 +1,3 @@
 # this line is not in the stand-in's setup.py
-import nothing
+import something
 # nor this one
"""


def _skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in info.name or info.name.endswith((".egg-info", ".pyc")) else info


def _tarball(path: Path) -> str:
    with tarfile.open(path, "w:gz") as tar:
        tar.add(STANDIN, arcname="vllm-0.32.0", filter=_skip)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flashinfer_wheel(out: Path, version: str = "0.7.0.post1+standin") -> Path:
    """A stand-in flashinfer-python wheel (a module that says what it is), for the FlashInfer step
    of vllm_build: the real one comes from the package index or a 12.1a build, neither of which this
    scenario can use. Its local version label keeps pip from taking the real one from the index
    instead."""
    dist = f"flashinfer_python-{version}.dist-info"
    files = {
        "flashinfer/__init__.py": f'__version__ = "{version}"\nSTANDIN = True\n',
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: flashinfer-python\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sparkspec-standin\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    def digest(text: str) -> str:
        return (base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
                .decode())
    record = [f"{name},sha256={digest(text)},{len(text.encode())}"
              for name, text in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"flashinfer_python-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(zipfile.ZipInfo(name, (2026, 1, 1, 0, 0, 0)), text)
    return wheel


# flash-attention's real CMake files (tests/data/flash-attention/SOURCES.md), the FA source the role
# edits.
FA_FILES = Path(__file__).resolve().parents[1] / "data" / "flash-attention" / "617264c1"


def _git_env() -> dict[str, str]:
    return {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_DATE": "2026-08-06T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-08-06T00:00:00Z"}


def _fa_repo(bare: Path) -> str:
    """flash-attention's CMakeLists.txt and cmake/utils.cmake at 617264c1 as a bare repository of
    one commit (fixed dates: the same commit id every time); returns that id, the scenario's
    vllm_build_fa_commit."""
    env = _git_env()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "fa"
        shutil.copytree(FA_FILES, work)
        for args in (("init", "-q", "-b", "main"), ("add", "-A"),
                     ("commit", "-q", "-m", "flash-attention 617264c1")):
            subprocess.run(["git", "-C", str(work), *args], check=True, capture_output=True,
                           env=env)
        shutil.rmtree(bare, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", "--bare", "--no-local", str(work), str(bare)],
                       check=True, capture_output=True, env=env)
        commit = subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, env=env).stdout.strip()
    # a loose ref: copying skips empty folders
    (bare / "refs" / "heads" / "main").write_text(f"{commit}\n")
    return commit


def _git_repo(bare: Path) -> None:
    """The stand-in tree as a bare repository: tag v0.32.0-b, then a commit that changes RELEASE
    only, tagged v0.32.0-c (its kernel source is the same, so its build can reuse the first one's
    ccache)."""
    env = _git_env()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "vllm"
        shutil.copytree(STANDIN, work,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))

        def git(*args: str) -> None:
            subprocess.run(["git", "-C", str(work), *args], check=True, capture_output=True,
                           env=env)

        git("init", "-q", "-b", "main")
        for release in ("b", "c"):
            (work / "RELEASE").write_text(f"{release}\n")
            git("add", "-A")
            git("commit", "-q", "-m", f"release {release}")
            git("tag", f"v0.32.0-{release}")
        shutil.rmtree(bare, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", "--bare", "--no-local", str(work), str(bare)],
                       check=True, capture_output=True, env=env)
    # loose refs too: the clone packs them, and copying the repository to the host skips empty
    # folders
    listed = subprocess.run(["git", "-C", str(bare), "for-each-ref",
                             "--format=%(refname) %(objectname)"],
                            check=True, capture_output=True, text=True, env=env).stdout.split("\n")
    for ref, sha in (line.split() for line in listed if line):
        # git's loose ref format (update-ref leaves a packed ref alone)
        (bare / ref).write_text(f"{sha}\n")


def write(out: Path) -> dict[str, str]:
    """Writes the inputs under ``out``; returns the environment the scenario reads."""
    out.mkdir(parents=True, exist_ok=True)
    for variant in buildenv.VARIANTS:
        buildenv.torch_wheel(out / "wheels", variant)
    flashinfer_wheel(out / "wheels")
    (out / "broken.patch").write_text(BROKEN_PATCH)
    _git_repo(out / "vllm.git")
    return {"SPARKSPEC_STANDIN_DIR": str(out),
            "SPARKSPEC_STANDIN_FA_COMMIT": _fa_repo(out / "flash-attention.git"),
            "SPARKSPEC_STANDIN_SHA256": _tarball(out / "vllm-0.32.0.tar.gz")}
