"""The test checkpoint generator (``python -m tests.support checkpoint generate``,
tests/support/testckpt.py): it never deletes what it did not write."""

from __future__ import annotations

import json
from pathlib import Path

from tests.badinput import refused_untouched, run

# The checkpoint commands against a hostile user: outputs that would overwrite inputs or other
# people's files, corrupted outputs reported up to date, add-mtp half done, duplicate tensors, non-
# regular files, read-only and full filesystems. Each refusal is one line, exit 2 (1 for a run-time
# failure), and leaves every folder involved byte for byte as it was (tests.badinput fingerprints
# them: a leftover temp, lock or link counts as a change).


# --- generate: never deletes what it did not write ------------------------------------------------
def test_generate_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused_untouched(["checkpoint", "generate", "--kind", "int4", "--out", mine], [tmp_path],
                      match=r"--out .*mine.* was not written by "
                            r"python -m tests.support checkpoint generate")


def test_generate_refuses_a_file_and_a_symlink_as_out(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("data")
    refused_untouched(["checkpoint", "generate", "--kind", "fp8", "--out", plain], [tmp_path],
                      match=r"--out .*plain.* not a folder")
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    refused_untouched(["checkpoint", "generate", "--kind", "fp8", "--out", tmp_path / "link"],
                      [tmp_path], match="symbolic link")


def test_generate_replaces_its_own_output_by_a_swap_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    first = run("checkpoint", "generate", "--kind", "int4", "--out", out, "--layers", "4")
    assert first.rc == 0, first.stderr
    second = run("checkpoint", "generate", "--kind", "int4", "--out", out, "--layers", "8")
    assert second.rc == 0, second.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 8
    # no temp, old copy or lock beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen"]
