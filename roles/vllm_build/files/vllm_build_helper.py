#!/usr/bin/env python3
"""The vllm_build role's helper on the host (standard library only; imports sparkspec_host.py from
beside it).

Usage: vllm_build_helper.py torch VENV | sass SITE CUOBJDUMP ARCH CORE_JSON | fa-archs FA_SRC ARCH
       | take-wheels STAGING DEST SUMS_JSON OWNER | run LOG WHAT CMD... [--progress-file P]
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import re
import secrets
import stat
import subprocess
import sys
import threading
import time
from typing import Any

# on the host the role puts sparkspec_host.py beside this file; in the checkout it is the
# contract role's
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.append(os.path.join(_HERE, "..", "..", "sparkspec", "module_utils"))
from sparkspec_host import atomic_write, torch_version  # noqa: E402

NINJA = re.compile(r"\[(\d+)/(\d+)\]")
ELF = re.compile(r"\.(sm_\d+[a-z]?)\.cubin")
TAIL = 40


def torch(venv: str) -> dict:
    found = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "torch",
                                          "version.py")))
    if not found:
        raise SystemExit(f"no torch in {venv}")
    return torch_version(found[0])   # torch's own version file, read without running it


def sass(site: str, cuobjdump: str, arch: str, core: list[str]) -> dict:
    root = os.path.join(site, "vllm")
    extensions: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(root, "**", "*.so"), recursive=True)):
        rel = os.path.relpath(path, root)
        proc = subprocess.run([cuobjdump, "--list-elf", path], check=False, capture_output=True,
                              text=True)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0 and "does not contain device code" not in text:
            extensions[rel] = {"error": text.strip().splitlines()[-1] if text.strip()
                               else f"rc {proc.returncode}"}
            continue
        extensions[rel] = {"sass": sorted(set(ELF.findall(proc.stdout)))}
    names = {rel.split(".")[0].replace(os.sep, ".") for rel in extensions}
    return {"extensions": extensions,
            "missing_core": [name for name in core if name not in names],
            "without_arch": [rel for rel, got in extensions.items()
                             if "error" in got or (got["sass"] and arch not in got["sass"])]}


FA_SUPPORTED = re.compile(r'^([ \t]*(?:set|list)\((?:APPEND )?CUDA_SUPPORTED_ARCHS )("[^)\n]*")\)',
                          re.MULTILINE)
FA2_LIST = re.compile(r'(cuda_archs_loose_intersection\(FA2_ARCHS ")([^"]*)'
                      r'(" "\$\{CUDA_ARCHS\}"\))')
FA_FIX = ("set vllm_build_fa_arch_patch: false, or use a flash-attention source whose "
          "CMakeLists.txt has that line (as vllm-project/flash-attention 6d21ae21 to 617264c1 do)")


def _ver(item: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", item).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def fa_archs(src: str, arch: str) -> dict:
    """FA_SRC/CMakeLists.txt edited in place so ARCH survives FA's arch selection (design.md)."""
    path = os.path.join(os.path.abspath(src), "CMakeLists.txt")
    if not re.fullmatch(r"\d+\.\d+a?", arch):
        raise SystemExit(f"fa-archs: ARCH {arch!r} is not of the form 12.1a or 12.1")
    if os.path.islink(path):
        raise SystemExit(f"{path}: a symlink, refused (give fa-archs a real copy of the FA source)")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: not found (FA_SRC must be a flash-attention source tree); "
                         f"{FA_FIX}")
    with open(path, newline="") as f:
        old = f.read()
    base = arch.rstrip("a")
    edits: list[dict] = []

    # a list ending below ARCH in ARCH's major version gains ARCH's base
    def supported(m: re.Match) -> str:
        items = re.findall(r"\d+\.\d+", m.group(2))
        if not items or base in items or _ver(items[-1])[0] != _ver(base)[0] \
                or _ver(items[-1]) > _ver(base):
            return m.group(0)
        body = f'{m.group(2)[:-1]};{base}"' if m.group(2).count('"') == 2 \
            else f'{m.group(2)} "{base}"'
        edits.append({"line": old.count("\n", 0, m.start()) + 1, "old": m.group(0).strip(),
                      "new": f"{m.group(1)}{body})".strip()})
        return f"{m.group(1)}{body})"

    text = FA_SUPPORTED.sub(supported, old)
    if not any(base in re.findall(r"\d+\.\d+", m.group(2)) for m in FA_SUPPORTED.finditer(text)):
        raise SystemExit(f"{path}: no CUDA_SUPPORTED_ARCHS list ending at a {_ver(base)[0]}.x "
                         f"below {base} (nor one holding {base}); {FA_FIX}")
    found = list(FA2_LIST.finditer(text))
    if len(found) != 1:
        raise SystemExit(f'{path}: {len(found)} lines cuda_archs_loose_intersection(FA2_ARCHS '
                         f'"<list>" "${{CUDA_ARCHS}}") where exactly one is expected; {FA_FIX}')
    m = found[0]
    if arch not in m.group(2).split(";"):
        new = f"{m.group(1)}{m.group(2)};{arch}{m.group(3)}"
        edits.append({"line": text.count("\n", 0, m.start()) + 1, "old": m.group(0), "new": new})
        text = text[:m.start()] + new + text[m.end():]
    if text != old:   # atomic, the mode kept
        atomic_write(path, text.encode())
    return {"changed": text != old, "file": path, "edits": edits}


def run(argv: list[str]) -> int:
    progress = None
    if len(argv) >= 2 and argv[-2] == "--progress-file":
        progress, argv = os.path.expanduser(argv[-1]), argv[:-2]
    log, what, cmd = argv[0], argv[1], argv[2:]
    state: dict[str, Any] = {"note": "starting", "start": time.monotonic()}
    done = threading.Event()
    writing = threading.Lock()

    written = [0.0]

    def dump() -> None:
        with writing:   # the 2 s ticker and a new ninja step may write at once; one temp file
            doc = {"what": what, "elapsed_s": round(time.monotonic() - state["start"], 1),
                   "note": state["note"], "time": time.time()}
            atomic_write(progress, json.dumps(doc).encode(), durable=False)
            written[0] = time.monotonic()

    def write(at_most_every: float = 0.0) -> None:
        if progress and time.monotonic() - written[0] >= at_most_every:
            try:
                dump()
            except OSError:
                pass

    def keep_writing() -> None:
        while not done.wait(2.0):
            write()

    if progress:
        dump()
        threading.Thread(target=keep_writing, daemon=True).start()
    tail: list[str] = []
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        for text in proc.stdout:
            out.write(text)
            out.flush()
            step = NINJA.search(text)
            if step:
                state["note"] = f"ninja {step.group(1)}/{step.group(2)}"
                write(at_most_every=0.5)   # a new step soon, not at the next 2 s tick
            elif text.strip() and not state["note"].startswith("ninja"):
                state["note"] = text.strip()[:100]
            tail = (tail + [text.rstrip()])[-TAIL:]
        rc = proc.wait()
    done.set()
    if progress:
        try:
            os.unlink(progress)
        except OSError:
            pass
    print("\n".join(tail))
    return rc


def take_wheels(staging: str, dest: str, sums: dict, owner: str) -> dict:
    """Copy the wheels a cluster's head listed (SUMS) from a folder the unprivileged OWNER wrote
    (its fetch) into root's DEST, so that what pip installs is byte for byte what the head built: no
    name but the head's, no link followed (a planted symlink would have root copy a file of its
    choice into a readable folder), no hard link (another file of OWNER's), and a copy that takes
    its name only after its sha256 matched."""
    uid = pwd.getpwnam(owner).pw_uid
    flags = os.O_RDONLY | os.O_NOFOLLOW
    src_dir = os.open(staging, flags | os.O_DIRECTORY)
    dst_dir = os.open(dest, flags | os.O_DIRECTORY)
    src_st, dst_st = os.fstat(src_dir), os.fstat(dst_dir)
    if (src_st.st_dev, src_st.st_ino) == (dst_st.st_dev, dst_st.st_ino):
        os.close(src_dir)
        os.close(dst_dir)
        raise SystemExit(f"{staging} and {dest} are one folder; keep vllm_build_wheelhouse outside "
                         "the staging folder sparkspec_home/handoff-in")
    copied = []
    try:
        for name, want in sorted(sums.items()):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*\.whl", name):
                raise SystemExit(f"{name!r} is not a wheel's file name; the head's list is not its "
                                 "wheels")
            try:
                src = os.open(name, flags | os.O_NONBLOCK, dir_fd=src_dir)
            except OSError as exc:
                raise SystemExit(f"{staging}/{name}: {exc.strerror} (a link, or not fetched)") \
                    from None
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            try:
                st = os.fstat(src)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
                    raise SystemExit(f"{staging}/{name} is not a regular file of {owner} with one "
                                     "link; the fetch writes only such files")
                digest = hashlib.sha256()
                create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                out = os.open(tmp, create, 0o644, dir_fd=dst_dir)
                try:
                    while block := os.read(src, 1 << 20):
                        digest.update(block)
                        os.write(out, block)
                    os.fsync(out)
                finally:
                    os.close(out)
                if digest.hexdigest() != want:
                    raise SystemExit(f"{name}: sha256 {digest.hexdigest()[:16]} is not the head's "
                                     f"{str(want)[:16]}")
                os.rename(tmp, name, src_dir_fd=dst_dir, dst_dir_fd=dst_dir)
                copied.append(name)
            finally:
                os.close(src)
                try:
                    os.unlink(tmp, dir_fd=dst_dir)
                except FileNotFoundError:
                    pass
        os.fsync(dst_dir)
    finally:
        os.close(src_dir)
        os.close(dst_dir)
    return {"copied": copied}


def main(argv: list[str]) -> int:
    if argv[:1] == ["torch"]:
        print(json.dumps(torch(argv[1])))
    elif argv[:1] == ["sass"]:
        print(json.dumps(sass(argv[1], argv[2], argv[3], json.loads(argv[4]))))
    elif argv[:1] == ["fa-archs"] and len(argv) == 3:
        print(json.dumps(fa_archs(argv[1], argv[2])))
    elif argv[:1] == ["take-wheels"] and len(argv) == 5:
        print(json.dumps(take_wheels(argv[1], argv[2], json.loads(argv[3]), argv[4])))
    elif argv[:1] == ["run"]:
        return run(argv[1:])
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
