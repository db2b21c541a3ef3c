"""Role variables are documented where ansible-doc reads them: every key of a role's
defaults/main.yml is an option of its meta/argument_specs.yml whose `default:` is the same value
(templated defaults as the same expression string), and every option that is not required has its
default in defaults/main.yml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLES = sorted(p.parent.parent.name for p in (REPO / "roles").glob("*/meta/argument_specs.yml"))
_MISSING = object()


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (True is not 1, 1 is not 1.0, '8000' is not
    8000)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def load_role(role_dir: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The role's defaults and its entry points' options."""
    defaults_file = role_dir / "defaults" / "main.yml"
    defaults = (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.exists() else {}
    specs = yaml.safe_load((role_dir / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    return defaults, {name: spec.get("options") or {} for name, spec in specs.items()}


def spec_mismatches(role_dir: Path) -> list[str]:
    """Every disagreement between defaults/main.yml and meta/argument_specs.yml, one message
    each."""
    defaults, entry_points = load_role(role_dir)
    problems = [f"{name}: in defaults/main.yml but not an option of entry point main"
                for name in defaults if name not in entry_points.get("main", {})]
    for entry, options in entry_points.items():
        for name, option in options.items():
            documented = option.get("default", _MISSING)
            if option.get("required"):
                if documented is not _MISSING or name in defaults:
                    problems.append(f"{entry}.{name}: required, yet it has a default")
            elif name not in defaults:
                problems.append(f"{entry}.{name}: not required, yet not in defaults/main.yml")
            elif documented is _MISSING:
                problems.append(f"{entry}.{name}: no default: key "
                                f"(defaults/main.yml has {defaults[name]!r})")
            elif not same(documented, defaults[name]):
                problems.append(f"{entry}.{name}: default {documented!r} != defaults/main.yml "
                                f"{defaults[name]!r}")
            if not option.get("description"):
                problems.append(f"{entry}.{name}: no description")
    return problems


@pytest.mark.parametrize("role", ROLES)
def test_argument_spec_defaults_equal_role_defaults(role: str) -> None:
    assert spec_mismatches(REPO / "roles" / role) == []


def test_every_role_has_an_argument_spec() -> None:
    with_defaults = {p.parent.parent.name for p in (REPO / "roles").glob("*/defaults/main.yml")}
    assert with_defaults <= set(ROLES)
    assert len(ROLES) >= 8


def _write_role(root: Path, defaults: str, options: str) -> Path:
    (root / "defaults").mkdir(parents=True)
    (root / "meta").mkdir()
    (root / "defaults" / "main.yml").write_text(defaults)
    (root / "meta" / "argument_specs.yml").write_text(
        "argument_specs:\n  main:\n    short_description: x\n    options:\n" + options)
    return root


def test_the_check_names_each_kind_of_mismatch(tmp_path: Path) -> None:
    role = _write_role(tmp_path / "r", "r_a: 1\nr_b: x\nr_c: true\nr_d: '{{ r_a }}'\n"
                                       "r_only_default: 0\n", """\
      r_a: {type: int, default: 2, description: d}
      r_b: {type: str, description: d}
      r_c: {type: raw, default: 1, description: d}
      r_d: {type: str, default: '{{ r_b }}', description: d}
      r_e: {type: str, default: y, description: d}
      r_f: {type: str, required: true, default: z, description: d}
      r_g: {type: str, default: 0}
""")
    problems = spec_mismatches(role)
    assert problems == [
        "r_only_default: in defaults/main.yml but not an option of entry point main",
        "main.r_a: default 2 != defaults/main.yml 1",
        "main.r_b: no default: key (defaults/main.yml has 'x')",
        "main.r_c: default 1 != defaults/main.yml True",
        "main.r_d: default '{{ r_b }}' != defaults/main.yml '{{ r_a }}'",
        "main.r_e: not required, yet not in defaults/main.yml",
        "main.r_f: required, yet it has a default",
        "main.r_g: not required, yet not in defaults/main.yml",
        "main.r_g: no description",
    ]


def test_the_check_accepts_an_agreeing_role(tmp_path: Path) -> None:
    role = _write_role(tmp_path / "r", "r_a: [1, {b: null}]\nr_t: \"{{ r_x == 'y' }}\"\n", """\
      r_a: {type: list, default: [1, {b: null}], description: d}
      r_t: {type: bool, default: "{{ r_x == 'y' }}", description: d}
      r_p: {type: str, required: true, description: d}
""")
    assert spec_mismatches(role) == []


def test_ansible_doc_renders_every_role_with_its_defaults() -> None:
    """What users read (`ansible-doc -t role -r roles ROLE`) shows the defaults of
    defaults/main.yml."""
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-doc"), "-t", "role",
                           "-r", "roles", "--json", *ROLES],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    assert sorted(docs) == ROLES
    for role in ROLES:
        defaults, _ = load_role(REPO / "roles" / role)
        options = docs[role]["entry_points"]["main"]["options"]
        for name, value in defaults.items():
            assert same(options[name]["default"], value), (role, name)
