"""`invoke tune --apply` (tasks.tune.apply): where the winning k is written in an inventory, that
the file's comments stay, the diff it returns, and the files it refuses (nothing written then)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from sparkspec.errors import UserError
from tasks.tune import apply as tune_apply

KEY = "sparkspec_num_speculative_tokens"

HOST_VARS = """\
---
# spark h: the lab's first Spark
ansible_host: 10.0.0.1   # its LAN address
# serving
sparkspec_method: ngram
"""

HOSTS = """\
# the lab
all:
  children:
    g:
      hosts:
        h:   # the Spark on the bench
          ansible_host: 10.0.0.1   # its LAN address
        other:
          ansible_host: 10.0.0.2
"""


# an INI inventory: Ansible reads host_vars/ beside it
INI = "[g]\nh ansible_host=10.0.0.1\nother\n\n[c]\nh\n"


def _ini(folder: Path) -> None:
    """The host listed where apply writes nothing (an INI file), so its own files are what it
    writes."""
    (folder / "hosts.ini").write_text(INI)


def _comments(text: str) -> list[str]:
    return [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]


def test_a_host_file_keeps_its_comments_and_gets_the_key(tmp_path: Path) -> None:
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(HOST_VARS)
    (tmp_path / "hosts.yml").write_text(HOSTS)   # also lists h: its own file wins
    written, diff = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert written == path
    text = path.read_text()
    assert _comments(text) == _comments(HOST_VARS)
    assert f"+{KEY}:" in diff and "+  ngram: 3" in diff
    assert not [line for line in diff.splitlines() if line.startswith("-") and "#" in line]
    assert yaml.safe_load(text) == {"ansible_host": "10.0.0.1", "sparkspec_method": "ngram",
                                    KEY: {"ngram": 3}}
    assert (tmp_path / "hosts.yml").read_text() == HOSTS


def test_a_host_file_keeps_its_document_start(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(HOST_VARS)
    _, diff = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert path.read_text().startswith("---\n# spark h")
    assert "\n----\n" not in diff


def test_the_host_inline_in_the_inventory_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(HOSTS)
    assert tune_apply.target(tmp_path, "h", None) == (hosts, ["host", "h"])
    written, diff = tune_apply.apply(tmp_path, "h", None, "mtp", 2, {})
    assert written == hosts
    text = hosts.read_text()
    assert _comments(text) == _comments(HOSTS)
    assert f"+          {KEY}:" in diff
    doc = yaml.safe_load(text)
    assert doc["all"]["children"]["g"]["hosts"] == {
        "h": {"ansible_host": "10.0.0.1", KEY: {"mtp": 2}}, "other": {"ansible_host": "10.0.0.2"}}
    assert not (tmp_path / "host_vars").exists()
    # the inventory given as its file: the same place
    assert tune_apply.target(hosts, "other", None) == (hosts, ["host", "other"])


def test_a_host_listed_without_vars_gets_a_mapping(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts.yml"
    hosts.write_text("all:\n  hosts:\n    h:\n")
    tune_apply.apply(tmp_path, "h", None, "ngram", 5, {})
    assert yaml.safe_load(hosts.read_text()) == {"all": {"hosts": {"h": {KEY: {"ngram": 5}}}}}


def test_no_file_for_the_host_makes_host_vars(tmp_path: Path) -> None:
    _ini(tmp_path)
    written, diff = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {"mtp": 2})
    assert written == tmp_path / "host_vars" / "h.yml"
    text = written.read_text()
    assert text.startswith("---\n")
    assert yaml.safe_load(text) == {KEY: {"mtp": 2, "ngram": 3}}   # the host's current mapping kept
    assert diff.startswith(f"--- {written}\n+++ {written}\n") and "+---" in diff
    assert written.stat().st_mode & 0o777 == 0o644


def test_applying_again_to_a_file_it_made_changes_nothing(tmp_path: Path) -> None:
    _ini(tmp_path)
    written, _ = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    before = written.read_text()
    _, diff = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert (diff, written.read_text()) == ("", before)


def test_an_existing_mapping_keeps_its_other_methods(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h" / "main.yml"   # the folder form
    path.parent.mkdir(parents=True)
    path.write_text(f"a: 1\n{KEY}:\n  mtp: 2   # tuned in May\nb: 2\n")
    # the file's mapping wins over current
    tune_apply.apply(tmp_path, "h", None, "ngram", 4, {"eagle3": 1})
    text = path.read_text()
    assert yaml.safe_load(text) == {"a": 1, KEY: {"mtp": 2, "ngram": 4}, "b": 2}
    # the same method again: its k replaced, not added
    tune_apply.apply(tmp_path, "h", None, "ngram", 2, {})
    assert yaml.safe_load(path.read_text())[KEY] == {"mtp": 2, "ngram": 2}


def test_comments_inside_the_existing_mapping_are_kept(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(f"{KEY}:\n  # measured in May\n  mtp: 2   # tuned\n")
    tune_apply.apply(tmp_path, "h", None, "ngram", 4, {})
    text = path.read_text()
    assert yaml.safe_load(text) == {KEY: {"mtp": 2, "ngram": 4}}
    assert "mtp: 2   # tuned\n" in text


def test_a_cluster_writes_its_group_vars(tmp_path: Path) -> None:
    (tmp_path / "hosts.yml").write_text(HOSTS)
    written, _ = tune_apply.apply(tmp_path, "h", "g", "mtp", 3, {})
    assert written == tmp_path / "group_vars" / "g.yml"
    assert yaml.safe_load(written.read_text()) == {KEY: {"mtp": 3}}
    assert not (tmp_path / "host_vars").exists()
    assert (tmp_path / "hosts.yml").read_text() == HOSTS
    # a group's folder form is used where it is
    (tmp_path / "hosts.yml").write_text(HOSTS + "    c:\n      hosts:\n        h:\n")
    (tmp_path / "group_vars" / "g.yml").unlink()   # else g (after c in name order) would win for h
    own = tmp_path / "group_vars" / "c" / "main.yml"
    own.parent.mkdir()
    own.write_text("# cluster c\nsparkspec_cluster: {}\n")
    assert tune_apply.apply(tmp_path, "h", "c", "mtp", 1, {})[0] == own
    assert yaml.safe_load(own.read_text()) == {"sparkspec_cluster": {}, KEY: {"mtp": 1}}
    assert own.read_text().startswith("# cluster c\n")


def test_a_template_value_is_refused_and_nothing_written(tmp_path: Path) -> None:
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    original = f'# mine\n{KEY}: "{{{{ lookup(\'env\', \'K\') }}}}"\n'
    path.write_text(original)
    with pytest.raises(UserError,
                       match=rf"h\.yml: {KEY} is (str|\w+) \(a template\?\), not a mapping; set "
                             r"ngram: 3 in it by hand"):
        tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert path.read_text() == original
    assert sorted(os.listdir(path.parent)) == ["h.yml"]   # no temp file left


def test_a_symlinked_file_is_refused_and_its_target_unchanged(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.yml"
    real.write_text(HOST_VARS)
    link = tmp_path / "inv" / "host_vars" / "h.yml"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    with pytest.raises(UserError, match=r"h\.yml: exists and is not a regular file"):
        tune_apply.apply(tmp_path / "inv", "h", None, "ngram", 3, {})
    assert real.read_text() == HOST_VARS and link.is_symlink()


def test_a_dangling_symlink_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "host_vars" / "h.yml"
    link.parent.mkdir()
    link.symlink_to(tmp_path / "nowhere.yml")
    with pytest.raises(UserError, match=r"h\.yml: exists and is not a regular file"):
        tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert not (tmp_path / "nowhere.yml").exists()


def test_applying_the_same_k_twice_changes_nothing(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(HOST_VARS.removeprefix("---\n"))
    _, first = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert first
    after = path.read_text()
    mtime = path.stat().st_mtime_ns
    _, second = tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert second == ""
    assert (path.read_text(), path.stat().st_mtime_ns) == (after, mtime)


def test_the_file_mode_is_kept(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text("a: 1\n")
    path.chmod(0o600)
    tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(("content", "match"), [
    ("a: [1\n", r"cannot read it as YAML"),
    ("- a\n- b\n", r"not a mapping of variables"),
    (f"{KEY}: [3]\n", rf"{KEY} is CommentedSeq"),
])
def test_a_file_that_is_not_a_mapping_of_vars_is_refused(tmp_path: Path, content: str,
                                                         match: str) -> None:
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert path.read_text() == content


def test_a_file_of_comments_only_keeps_them(tmp_path: Path) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text("# h: vars go here\n")
    tune_apply.apply(tmp_path, "h", None, "ngram", 3, {})
    assert "# h: vars go here" in path.read_text()


def test_a_key_a_later_entry_sets_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """h is listed in g and in g2, g2's entry sets the key and is read after g's: writing in g's
    entry (the first found) would not be what Ansible gives h."""
    text = ("all:\n  children:\n    g:\n      hosts:\n        h:\n"
            "          ansible_host: 10.0.0.1\n    g2:\n      hosts:\n        h:\n"
            f"          {KEY}: {{mtp: 2}}\n")
    (tmp_path / "hosts.yml").write_text(text)
    with pytest.raises(UserError,
                       match=r"Ansible gives h sparkspec_num_speculative_tokens = \{'mtp': 2\}"):
        tune_apply.apply(tmp_path, "h", None, "mtp", 4, {"mtp": 2})
    assert (tmp_path / "hosts.yml").read_text() == text
    assert not (tmp_path / "host_vars").exists()


def test_an_anchored_mapping_is_refused(tmp_path: Path) -> None:
    text = ("all:\n  children:\n    g:\n      hosts:\n        h: &spark\n"
            "          ansible_host: 10.0.0.1\n        other: *spark\n")
    (tmp_path / "hosts.yml").write_text(text)
    with pytest.raises(UserError, match=r"is a YAML anchor \(&spark\)"):
        tune_apply.apply(tmp_path, "h", None, "mtp", 4, {})
    assert (tmp_path / "hosts.yml").read_text() == text


@pytest.mark.parametrize("content", ["~\n", "---\nnull\n", "# only a comment\n"])
def test_a_file_without_a_mapping_gets_one(tmp_path: Path, content: str) -> None:
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    path.write_text(content)
    tune_apply.apply(tmp_path, "h", None, "mtp", 4, {})
    assert yaml.safe_load(path.read_text()) == {KEY: {"mtp": 4}}
    assert ("# only a comment" in path.read_text()) == ("#" in content)


@pytest.mark.parametrize("style", ["  - ", "- "])
def test_the_files_list_style_is_kept(tmp_path: Path, style: str) -> None:
    """A block list stays as the owner indented it: the diff shows the key added and nothing
    else."""
    _ini(tmp_path)
    path = tmp_path / "host_vars" / "h.yml"
    path.parent.mkdir()
    text = f"---\nsparkspec_stage_profiles:\n{style}hybrid   # served\n{style}tiny\nport: 8000\n"
    path.write_text(text)
    _, diff = tune_apply.apply(tmp_path, "h", None, "mtp", 2, {})
    assert path.read_text() == text + f"{KEY}:\n  mtp: 2\n"
    assert [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")] == [
        f"+{KEY}:", "+  mtp: 2"]
