"""`invoke tune --apply`: write the winning k into the inventory as
``sparkspec_num_speculative_tokens`` (the contract key, docs/methods.md "Choosing k"), keeping the
file's comments and layout, and return the diff.
"""

from __future__ import annotations

import difflib
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap
from ruamel.yaml.error import YAMLError

from sparkspec.errors import UserError
from sparkspec.outputs import refuse_link, write_atomic
from tasks.lib.inventory import load as load_inventory

KEY = "sparkspec_num_speculative_tokens"
MAX_BYTES = 4 << 20


def _yaml() -> YAML:
    y = YAML()   # round trip: comments, order and quoting kept
    y.preserve_quotes = True
    y.width = 4096   # no rewrapping of long lines the owner wrote
    return y


def _indented_dashes(text: str) -> bool:
    """Whether the file indents a block list under its key (``key:`` then ``  - x``, Ansible's usual
    style), so the round trip keeps it rather than writing ``- x`` at the key's column."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for key, item in zip(lines, lines[1:], strict=False):
        if key.rstrip().endswith(":") and item.lstrip().startswith("- "):
            return len(item) - len(item.lstrip()) > len(key) - len(key.lstrip())
    return False


def _dump(doc: Any, explicit_start: bool, text: str = "") -> str:
    y = _yaml()
    if _indented_dashes(text):
        y.indent(mapping=2, sequence=4, offset=2)
    y.explicit_start = explicit_start
    out = io.StringIO()
    y.dump(doc, out)
    return out.getvalue()


def _check_read_back(inventory: Path, path: Path, new: str, hosts: tuple[str, ...], method: str,
                     k: int) -> None:
    """Ansible's own reading of a copy of the inventory with ``new`` at ``path``: each host must get
    k (a later group, another file or a host_vars folder that sets the key would win over the file
    written)."""
    folder = inventory if inventory.is_dir() else inventory.parent
    with tempfile.TemporaryDirectory(prefix="sparkspec-apply-") as tmp:
        copy = Path(tmp) / "inventory"
        shutil.copytree(folder, copy, symlinks=True)
        rel = path.relative_to(folder)
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_text(new, encoding="utf-8")
        source = copy / inventory.name if inventory.is_file() else copy
        for name in dict.fromkeys(hosts):
            got = load_inventory(source).host_vars(name, (KEY,)).get(KEY)
            if not isinstance(got, dict) or got.get(method) != k:
                raise UserError(f"{path}: with {method}: {k} written there, Ansible gives {name} "
                                f"{KEY} = {str(got)[:80]} (another file or group sets it, and "
                                "wins); set it by hand where it is set")


def _own_file(folder: Path, kind: str, name: str) -> Path | None:
    for path in (folder / kind / f"{name}.yml", folder / kind / f"{name}.yaml",
                 folder / kind / name / "main.yml"):
        if os.path.lexists(path):
            return path
    return None


def _host_entry(doc: Any, host: str) -> CommentedMap | None:
    """The mapping of ``host`` under some group's ``hosts`` in an inventory file (None: not listed
    there)."""
    if not isinstance(doc, dict):
        return None
    for group in doc.values():
        if not isinstance(group, dict):
            continue
        hosts = group.get("hosts")
        if isinstance(hosts, dict) and host in hosts:
            if hosts[host] is None:
                hosts[host] = CommentedMap()
            return hosts[host] if isinstance(hosts[host], CommentedMap) else None
        found = _host_entry(group.get("children"), host)
        if found is not None:
            return found
    return None


def _read(path: Path) -> tuple[str, Any]:
    refuse_link(str(path), "the inventory file")
    try:
        if path.stat().st_size > MAX_BYTES:
            raise UserError(f"{path}: larger than {MAX_BYTES >> 20} MiB; set {KEY} by hand")
        text = path.read_text(encoding="utf-8")
        return text, _yaml().load(text)
    except (OSError, UnicodeDecodeError, YAMLError) as exc:
        raise UserError(f"{path}: cannot read it as YAML ({str(exc).splitlines()[0]}); fix the "
                        f"file or set {KEY} by hand") from None


def target(inventory: Path, host: str, group: str | None) -> tuple[Path, list[str]]:
    """The file to write, and where in it (the key path to the mapping that gets the key)."""
    folder = inventory if inventory.is_dir() else inventory.parent
    if group:
        return _own_file(folder, "group_vars", group) or folder / "group_vars" / f"{group}.yml", []
    own = _own_file(folder, "host_vars", host)
    if own:
        return own, []
    files = [inventory] if inventory.is_file() else sorted(
        p for p in folder.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())
    for path in files:
        try:
            _, doc = _read(path)
        except UserError:
            continue   # not YAML (an INI inventory): Ansible reads host_vars/ beside it
        if _host_entry(doc, host) is not None:
            return path, ["host", host]
    return folder / "host_vars" / f"{host}.yml", []


def _comments_only(text: str) -> str:
    """What a file that holds no mapping keeps: its comments, blank lines and document start (a bare
    ``~`` or ``null`` goes: the key's mapping replaces it)."""
    kept = [ln for ln in text.splitlines(True)
            if not ln.strip() or ln.lstrip().startswith(("#", "---"))]
    return "".join(kept)


def apply(inventory: Path, host: str, group: str | None, method: str, k: int,
          current: dict[str, Any], members: tuple[str, ...] = ()) -> tuple[Path, str]:
    """Set ``method``'s k in the file :func:`target` picks; returns the file and the unified diff.
    Written only when Ansible, reading a copy of the inventory with the change, gives ``host`` (and
    every one of ``members``) exactly that k: else one line, nothing written."""
    path, where = target(inventory, host, group)
    text, doc = _read(path) if os.path.lexists(path) else ("", None)
    if doc is None:   # a new file, or one of comments only: the key goes after what is there
        value = CommentedMap(current or {})
        value[method] = k
        kept = _comments_only(text)
        new = kept + ("\n" if kept and not kept.endswith("\n") else "") \
            + ("" if kept.lstrip().startswith("---") else "---\n") \
            + _dump(CommentedMap({KEY: value}), explicit_start=False)
    else:
        holder = _host_entry(doc, host) if where else doc
        if not isinstance(holder, dict):
            raise UserError(f"{path}: not a mapping of variables; set {KEY} by hand")
        anchor = getattr(getattr(holder, "anchor", None), "value", None)
        if anchor:
            raise UserError(f"{path}: the mapping that would hold {KEY} is a YAML anchor "
                            f"(&{anchor}), shared with what refers to it; set {KEY} by hand")
        now = holder.get(KEY)
        if now is not None and not isinstance(now, dict):
            raise UserError(f"{path}: {KEY} is {type(now).__name__} (a template?), not a mapping; "
                            f"set {method}: {k} in it by hand")
        if now is None:
            holder[KEY] = CommentedMap(current or {})
        holder[KEY][method] = k   # in place: the mapping's own comments stay
        new = _dump(doc, explicit_start=text.lstrip().startswith("---"), text=text)
    diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), str(path),
                                        str(path)))
    if new != text:
        _check_read_back(inventory, path, new, (host, *members), method, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, new.encode(),
                     mode=(path.stat().st_mode & 0o7777) if path.exists() else 0o644)
    return path, diff
