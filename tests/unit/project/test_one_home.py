"""Each listed fact is defined once, in the registry (src/sparkspec/registry/data.py): the built-in
methods, the head kinds, the contract's keys and the serve knob names. A second list of any of them
in the product's code (src/, tasks/, roles/, playbooks/) fails here, naming the file; uses of single
names are fine, and so are the docs, the inventories (a site's data) and the tests.

A "list" is a literal sequence, set or mapping in Python, or a YAML/Jinja text, holding at least
``MIN`` names of the same fact (for the head kinds, both; for the contract, its keys with a '_',
which no other structure has). Comments are not code and are skipped.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sparkspec import registry

ROOT = Path(__file__).resolve().parents[3]
HOME = ROOT / "src/sparkspec/registry/data.py"
FACTS = {
    "built-in methods": (tuple(registry.BUILTIN_METHODS), 3),
    "head kinds": (registry.HEAD_KINDS, len(registry.HEAD_KINDS)),
    # the keys no other structure uses (the resolved host has a method, a profile and serve too)
    "contract keys": (tuple(k for k in registry.CONTRACT_KEYS if "_" in k), 3),
    "serve knob names": (registry.KNOBS, 4),
}


def _product_files() -> list[Path]:
    files = []
    for base in ("src", "tasks", "roles", "playbooks"):
        files += [p for p in (ROOT / base).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".yml", ".yaml", ".j2")
                  and "molecule" not in p.parts and "__pycache__" not in p.parts]
    return sorted(files)


def _python_lists(path: Path, names: tuple[str, ...], least: int) -> list[int]:
    """Lines of literal tuples, lists, sets and dict keys holding at least ``least`` of
    ``names``."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        items: list[ast.expr | None] = []
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = list(node.elts)
        elif isinstance(node, ast.Dict):
            items = list(node.keys)
        found = {i.value for i in items
                 if isinstance(i, ast.Constant) and isinstance(i.value, str)} & set(names)
        if len(found) >= least:
            hits.append(node.lineno)
    return hits


def _text_lists(path: Path, names: tuple[str, ...], least: int) -> list[int]:
    """YAML and Jinja: the names quoted, or as mapping keys, counted per file outside comments."""
    code = "\n".join(line.split(" #", 1)[0] for line in path.read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    found = {n for n in names
             if re.search(rf"""(['"]){re.escape(n)}\1|^\s*-?\s*{re.escape(n)}:""", code, re.M)}
    return [1] if len(found) >= least else []


@pytest.mark.parametrize("fact", sorted(FACTS))
def test_each_fact_is_listed_once(fact: str) -> None:
    names, least = FACTS[fact]
    offenders = []
    for path in _product_files():
        if path == HOME:
            continue
        lines = (_python_lists(path, names, least) if path.suffix == ".py"
                 else _text_lists(path, names, least))
        offenders += [f"{path.relative_to(ROOT)}:{line}" for line in lines]
    assert offenders == [], f"{fact} listed again outside {HOME.relative_to(ROOT)}: {offenders}"


@pytest.mark.parametrize("fact", sorted(FACTS))
def test_the_home_lists_them(fact: str) -> None:
    """The check above can fail: the registry's own file holds each list (or derives it from one
    that does)."""
    names, least = FACTS[fact]
    if fact == "head kinds":   # derived from the built-in methods' heads, never written as a list
        assert set(names) == {m["speculative_config"]["method"]
                              for m in registry.BUILTIN_METHODS.values() if m.get("head")}
        return
    assert _python_lists(HOME, names, least), fact


def test_a_copy_is_found(tmp_path: Path) -> None:
    """A second list in YAML or Python is caught (the detector is not blind)."""
    yml = tmp_path / "x.yml"
    yml.write_text("_m: \"{{ ['baseline', 'ngram', 'mtp'] }}\"\n"
                   "# ['eagle3', 'dflash'] in a comment is not code\n")
    py = tmp_path / "x.py"
    py.write_text('KNOBS = ("max_model_len", "load_format", "attention_backend", '
                  '"reasoning_parser")\n')
    assert _text_lists(yml, tuple(registry.BUILTIN_METHODS), 3) == [1]
    assert _text_lists(yml, registry.HEAD_KINDS, 2) == []
    assert _python_lists(py, registry.KNOBS, 4) == [1]


def test_one_playbook_per_built_in_method() -> None:
    """deploy-<method>.yml stay a few lines over the one shared play, exactly one per built-in
    method."""
    books = sorted(p.stem.removeprefix("deploy-")
                   for p in (ROOT / "playbooks").glob("deploy-*.yml"))
    assert books == sorted(registry.BUILTIN_METHODS)
