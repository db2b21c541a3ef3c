"""The vLLM unit's ExecStartPre keeper of its compile-cache folder (docs/operate.md#cold-start).

Usage: <vllm venv>/bin/python -I compile_cache.py ROOT KEY KEEP   (exit 1 and one line when refused)
"""

import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time

# on the host the deploy puts sparkspec_host.py beside this file (run with -I: not on sys.path by
# itself); in the checkout it is the contract role's
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path += [_HERE, os.path.join(_HERE, "..", "..", "sparkspec", "module_utils")]
from sparkspec_host import atomic_write, vllm_identity  # noqa: E402

RECORD = "sparkspec-cache.json"
KEY = re.compile(r"[0-9a-f]{16}\Z")
STALE = ".stale-"
# vLLM's model-info files, under VLLM_CACHE_ROOT (the folder's "vllm", registry COMPILE_CACHE_ENV):
# a start without them inspects each model class in a subprocess (docs/spark-facts.md, model_info)
MODEL_INFO = ("vllm", "modelinfos")
SMALL = 1 << 16   # the most a record or a model-info file is read of


class Refused(Exception):
    pass


def owned_folder(path, what, create):
    """Refuses a path that is a link, not a folder or not this user's; makes it (0700) if absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise Refused(f"{what} {path} does not exist") from None
        try:
            os.mkdir(path, 0o700)
        except OSError as exc:
            raise Refused(f"{what} {path} cannot be created ({exc.strerror}); check its parent "
                          "folder and deploy_read_write_paths") from None
        return False
    if stat.S_ISLNK(st.st_mode):
        raise Refused(f"{what} {path} is a symbolic link; point deploy_compile_cache_dir at a real "
                      "folder of the service user")
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{what} {path} is not a folder; remove it or set another "
                      "deploy_compile_cache_dir")
    if st.st_uid != os.geteuid():
        raise Refused(f"{what} {path} belongs to uid {st.st_uid}, not the service user "
                      f"(uid {os.geteuid()}); chown it to the service user or set another "
                      "deploy_compile_cache_dir")
    return True


def read_small(path):
    """A file's bytes, never through a link; None when it cannot be read or is over SMALL."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read(SMALL + 1)
    except OSError:
        return None
    return data if len(data) <= SMALL else None


def read_record(folder):
    """The folder's record, or None (absent, a link, not JSON)."""
    try:
        doc = json.loads(read_small(os.path.join(folder, RECORD)) or b"")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def remove(root, name):
    """Moves ROOT/name aside (a half-removed folder never looks like a cache), then removes it."""
    aside = os.path.join(root, f"{STALE}{name}-{os.getpid()}")
    os.rename(os.path.join(root, name), aside)
    shutil.rmtree(aside, ignore_errors=True)


def size(folder):
    files, total = 0, 0
    for top, _, names in os.walk(folder):
        for name in names:
            if name != RECORD:
                files += 1
                total += os.lstat(os.path.join(top, name)).st_size
    return files, total


def prune(root, key, keep):
    """Removes all but the KEEP most recently started key folders (this one always kept), and what
    an interrupted removal left; never a link or anything not named like a key."""
    folders: list[tuple[float, str]] = []
    for entry in os.scandir(root):
        if entry.name.startswith(STALE) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        elif KEY.match(entry.name) and entry.name != key and entry.is_dir(follow_symlinks=False):
            started = (read_record(entry.path) or {}).get("started")
            if not isinstance(started, (int, float)):
                started = entry.stat(follow_symlinks=False).st_mtime
            when = started
            folders.append((when, entry.name))
    folders.sort(reverse=True)
    removed = [name for _, name in folders[max(keep - 1, 0):]]
    for name in removed:
        remove(root, name)
    return removed


def model_info_files(folder):
    """name -> bytes of a key folder's model-info JSON files; none through a link or a foreign
    folder."""
    path = folder
    try:
        for part in MODEL_INFO:
            path = os.path.join(path, part)
            owned_folder(path, "", create=False)
        entries = list(os.scandir(path))
    except (Refused, OSError):
        return {}
    out = {}
    for entry in entries:
        if entry.name.endswith(".json") and entry.is_file(follow_symlinks=False):
            data = read_small(entry.path)
            if data is not None:
                out[entry.name] = data
    return out


def seed_model_info(root, key, digest):
    """Copies into a cold key folder the model-info files of the other folders this vLLM build
    filled (the newest started first); returns how many. vLLM checks each file's module hash."""
    found: dict[str, bytes] = {}
    folders: list[tuple[float, str]] = []
    for entry in os.scandir(root):
        if KEY.match(entry.name) and entry.name != key and entry.is_dir(follow_symlinks=False):
            record = read_record(entry.path) or {}
            started = record.get("started")
            if record.get("vllm_sha256") == digest and isinstance(started, (int, float)):
                folders.append((started, entry.path))
    for _, folder in sorted(folders, reverse=True):
        for name, data in model_info_files(folder).items():
            found.setdefault(name, data)
    if not found:
        return 0
    path = os.path.join(root, key)
    for part in MODEL_INFO:
        path = os.path.join(path, part)
        owned_folder(path, "the compile-cache folder", create=True)
    for name, data in found.items():
        atomic_write(os.path.join(path, name), data, mode=0o600, durable=False)
    return len(found)


def prepare(root, key, keep):
    owned_folder(root, "the compile-cache folder", create=True)
    folder = os.path.join(root, key)
    existed = owned_folder(folder, "the compile-cache folder", create=True)
    identity = vllm_identity()
    build = identity.split(b"\n", 1)[0].decode()
    digest = hashlib.sha256(identity).hexdigest()
    record = read_record(folder) if existed else None
    files, total = size(folder) if existed else (0, 0)
    if record is not None and record.get("vllm_sha256") == digest:
        state = f"warm ({files} files, {total / 2**20:.1f} MiB; {build})"
    elif existed and files:
        remove(root, key)
        os.mkdir(folder, 0o700)
        before = record.get("vllm", "another build") if record else "an unrecorded build"
        state = f"cold (filled by {before}, this is {build}: emptied)"
    else:
        state = f"cold (new; {build})"
    if state.startswith("cold"):
        seeded = seed_model_info(root, key, digest)
        state += f"; model info of {seeded} class(es) from earlier folders" if seeded else ""
    now = time.time()
    created = record.get("created", now) if record is not None and state.startswith("warm") else now
    atomic_write(os.path.join(folder, RECORD), json.dumps(
        {"key": key, "vllm": build, "vllm_sha256": digest, "started": now, "created": created},
        sort_keys=True).encode(), mode=0o600, durable=False)
    removed = prune(root, key, keep)
    return f"sparkspec compile cache {key}: {state}" + (
        f"; removed {len(removed)} older folder(s): {', '.join(removed)}" if removed else "")


def main(argv):
    if len(argv) != 3 or not KEY.match(argv[1]) or not argv[2].isdigit() or int(argv[2]) < 1 \
            or not os.path.isabs(argv[0]):
        print("usage: compile_cache.py ROOT KEY KEEP (ROOT absolute, KEY 16 hex digits, KEEP >= 1)",
              file=sys.stderr)
        return 2
    try:
        print(prepare(os.path.normpath(argv[0]), argv[1], int(argv[2])), flush=True)
    except Refused as exc:
        print(f"sparkspec compile cache: refused: {exc}", file=sys.stderr, flush=True)
        return 1
    except OSError as exc:
        print(f"sparkspec compile cache: {exc.filename or argv[0]}: {exc.strerror or exc}",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
