"""What the vllm_build molecule scenario gets from the controller (roles/vllm_build/molecule/default): the
stand-in vLLM tree packed as two release tarballs (the second one differs by a file: "a changed ref"), both
stand-in torch wheels (cu130 and cpu), and a patch that does not apply to the tree. Written to one folder, which
the scenario's prepare copies to /opt/standin on the host; the tarballs' sha256 go to it through the
environment, as a site's pinned digests would."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from tests.support.torch_standin import buildenv

STANDIN = Path(__file__).resolve().parent / "vllm_standin"
# Not a diff of the stand-in: its context line is in no file of the tree, so `patch --fuzz=0` refuses it.
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


def _tarball(path: Path, extra: str | None) -> str:
    with tarfile.open(path, "w:gz") as tar:
        tar.add(STANDIN, arcname="vllm-0.32.0", filter=_skip)
        if extra is not None:   # another release of the same tree
            data = extra.encode()
            info = tarfile.TarInfo("vllm-0.32.0/RELEASE")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(out: Path) -> dict[str, str]:
    """Writes the inputs under ``out``; returns the environment the scenario reads."""
    out.mkdir(parents=True, exist_ok=True)
    for variant in buildenv.VARIANTS:
        buildenv.torch_wheel(out / "wheels", variant)
    (out / "broken.patch").write_text(BROKEN_PATCH)
    return {"SPARKSPEC_STANDIN_DIR": str(out),
            "SPARKSPEC_STANDIN_SHA256": _tarball(out / "vllm-0.32.0.tar.gz", None),
            "SPARKSPEC_STANDIN_B_SHA256": _tarball(out / "vllm-0.32.0-b.tar.gz", "b\n")}
