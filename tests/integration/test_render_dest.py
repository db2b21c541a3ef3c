"""`invoke render --dest` writes only into a folder that is new, empty or an earlier render's (its
.sparkspec-render marker), never through a symbolic link: each refusal is exit 2, one
`sparkspec: error:` line naming the folder, and nothing under it written or changed (issue 23,
kind 3). Runs ansible-playbook locally: no simulated Spark."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.badinput import assert_unchanged, fingerprint
from tests.conftest import BIN, ROOT, run_cli


def _link(t: Path) -> Path:
    (t / "real").mkdir()
    (t / "dest").symlink_to(t / "real")
    return t / "dest"


def _foreign(t: Path) -> Path:
    (t / "dest").mkdir()
    (t / "dest" / "notes.txt").write_text("mine\n")
    return t / "dest"


def _planted_link(t: Path) -> Path:
    """An earlier render's folder in which etc/systemd became a link to a folder of someone
    else's."""
    (t / "elsewhere").mkdir()
    (t / "dest" / "etc").mkdir(parents=True)
    (t / "dest" / ".sparkspec-render").write_text("files written by `invoke render`\n")
    (t / "dest" / "etc" / "systemd").symlink_to(t / "elsewhere")
    return t / "dest"


CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "dest-is-a-link": (_link, "dest: is a symbolic link"),
    "foreign-folder": (_foreign, "dest: holds files that render did not write"),
    "link-inside": (_planted_link, "dest: holds the symbolic link .*etc/systemd"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_refuses_a_dest_it_did_not_make(tmp_path: Path, case: str) -> None:
    make, match = CASES[case]
    dest = make(tmp_path)
    before = fingerprint(tmp_path)
    result = run_cli(f"{BIN}/invoke", "render", "--host", "spark01", "--method", "mtp",
                     "--dest", str(dest), "--inventory", "inventories/example")
    errors = [line for line in result.stderr.splitlines() if line.startswith("sparkspec: error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-2000:] + result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(match, errors[0]), errors[0]
    assert_unchanged(before, tmp_path)


def test_render_refuses_a_dest_inside_the_inventory() -> None:
    """The play reads the inventory folder (group_vars/*.json among it): rendered files never land
    there."""
    inventory = ROOT / "inventories" / "example"
    before = fingerprint(inventory)
    result = run_cli(f"{BIN}/invoke", "render", "--host", "spark01", "--method", "mtp", "--dest",
                     str(inventory / "group_vars" / "rendered"),
                     "--inventory", "inventories/example")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"sparkspec: error: --dest {inventory}/group_vars/rendered is inside the input "
        f"--inventory {inventory}; choose an output folder apart from every input"], result.stderr
    assert_unchanged(before, inventory)
