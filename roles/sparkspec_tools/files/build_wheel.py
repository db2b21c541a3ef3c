"""Build the sparkspec wheel (or the levers plugin's) on the controller, or reuse the one built from
this very source.

Usage: python build_wheel.py PROJECT_DIR WHEEL_DIR;
       prints one JSON line {wheel, sha256, source, built}.
"""

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "sparkspec" / "module_utils"))
from sparkspec_host import atomic_write  # noqa: E402
from sparkspec_host import sha256 as file_sha256

PROJECT_FILES = ("pyproject.toml", "README.md", "MANIFEST.in", "setup.cfg", "setup.py")


def source_sha256(source):
    files = [source / name for name in PROJECT_FILES if (source / name).is_file()]
    files += sorted(p for p in (source / "src").rglob("*")
                    if p.is_file() and p.suffix != ".pyc"
                    and not any(part == "__pycache__" or part.endswith(".egg-info")
                                for part in p.parts))
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\0")
    return digest.hexdigest()


def reusable(record, source_digest, wheel_dir):
    try:
        doc = json.loads(record.read_text())
        wheel = wheel_dir / doc["wheel"]
        fresh = doc["source"] == source_digest and wheel.is_file() \
            and file_sha256(wheel) == doc["sha256"]
        return doc if fresh else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main():
    source, wheel_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    if not (source / "pyproject.toml").is_file():
        sys.exit(f"sparkspec_tools: {source} holds no pyproject.toml; point sparkspec_tools_source "
                 "at the project")
    digest = source_sha256(source)
    record = wheel_dir / "sparkspec-source.json"
    doc = reusable(record, digest, wheel_dir)
    built = doc is None
    if built:
        shutil.rmtree(source / "build" / "lib", ignore_errors=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                               "--no-build-isolation",
                               "--wheel-dir", str(wheel_dir), str(source)], capture_output=True,
                              text=True, check=False)
        if proc.returncode != 0:
            last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] \
                or ["no output"]
            sys.exit(f"sparkspec_tools: pip wheel {source} failed: {last}")
        wheels = sorted(wheel_dir.glob("*-py3-none-any.whl"), key=lambda p: p.stat().st_mtime)
        if not wheels:
            sys.exit(f"sparkspec_tools: no wheel in {wheel_dir}; check that {source} is the "
                     "project (or its levers/ folder)")
        doc = {"source": digest, "wheel": wheels[-1].name, "sha256": file_sha256(wheels[-1])}
        atomic_write(record, (json.dumps(doc) + "\n").encode())
    print(json.dumps({"wheel": str(wheel_dir / doc["wheel"]), "sha256": doc["sha256"],
                      "source": digest, "built": built}))


main()
