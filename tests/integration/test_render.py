"""`invoke render` for the example inventory: files at their target paths, vLLM's parser accepts each
unit's arguments, and bad method configuration is refused before any change."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml

from tests.conftest import BIN, ROOT, run_cli

pytestmark = pytest.mark.sim

EXAMPLE = "inventories/example"
CASES = [("spark01", "baseline"), ("spark01", "ngram"), ("spark01", "mtp"), ("spark01", "dflash"),
         ("spark02", "eagle3")]


def _render(host: str, method: str, dest, *extra: str):
    return run_cli(f"{BIN}/invoke", "render", "--host", host, "--method", method, "--dest", str(dest),
                   "--inventory", EXAMPLE, *extra)


def _render_with_vars(method: str, dest, extra_vars: dict):
    """render.yml with extra vars (what an inventory override would do), on spark01."""
    extra = {"sparkspec_method": method, "deploy_render_root": str(dest), **extra_vars}
    return run_cli(f"{BIN}/ansible-playbook", "-i", EXAMPLE, "--limit", "spark01", "playbooks/render.yml",
                   "-e", json.dumps(extra))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = {}
    for host, method in CASES:
        dest = tmp_path_factory.mktemp(f"{host}-{method}")
        result = _render(host, method, dest)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr
        out[(host, method)] = dest
    return out


def test_files_land_at_their_target_paths(rendered):
    dest = rendered[("spark01", "dflash")]
    unit = (dest / "etc/systemd/system/sparkspec-vllm.service").read_text()
    env = (dest / "etc/sparkspec/sparkspec-vllm.env").read_text()
    record = json.loads((dest / "etc/sparkspec/sparkspec-vllm.json").read_text())
    assert 'HF_HUB_OFFLINE="1"' in env
    assert record["method"] == "dflash" and record["profile"] == "qwen35-122b-hybrid"
    spec = json.loads(record["args"][record["args"].index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "num_speculative_tokens": 15,
                    "model": "/opt/sparkspec/models/heads/z-lab--Qwen3.5-122B-A10B-DFlash"}
    # the method's serve override wins over the profile-wide FLASHINFER default
    assert record["args"][record["args"].index("--attention-backend") + 1] == "FLASH_ATTN"
    # JSON reaches systemd single-quoted (double quotes would be stripped by systemd)
    assert "--speculative-config '{\"method\":\"dflash\"" in unit


def test_units_are_accepted_by_vllms_parser(provisioned, rendered):
    """Every rendered command line goes through the installed vLLM's own parser (in the simulated Spark's
    vLLM venv); a command line with a wrong flag goes through the same check and must be refused."""
    records = [json.loads((d / "etc/sparkspec/sparkspec-vllm.json").read_text())["args"] for d in rendered.values()]
    bogus = records[0] + ["--no-such-flag"]
    check = "/opt/sparkspec/venvs/vllm/bin/python /opt/sparkspec/libexec/check_vllm_args.py --records"
    result = run_cli(*provisioned.ssh_argv(f"echo {shlex.quote(json.dumps(records + [bogus]))} | {check}"), timeout=300)
    lines = result.stdout.strip().splitlines()
    assert lines[:-1] == ["ok"] * len(records), result.stdout + result.stderr
    assert "unrecognized arguments: --no-such-flag" in lines[-1]
    assert result.returncode == 2


def test_eagle3_on_spark01_is_refused(tmp_path):
    result = _render("spark01", "eagle3", tmp_path)
    assert result.returncode == 2
    assert "method eagle3 needs a eagle3 head, and profile qwen35-122b-hybrid has none" in result.stderr
    assert not any(tmp_path.rglob("*.service"))


def test_unknown_method_is_refused(tmp_path):
    result = _render("spark01", "medusa", tmp_path)
    assert result.returncode == 2
    assert "unknown method 'medusa'; choose one of baseline, dflash, eagle3, mtp, ngram" in result.stderr


def _methods_with(method: str, spec: dict) -> dict:
    base = {"baseline": {"speculative_config": None}}
    return {"sparkspec_methods": {**base, method: {"speculative_config": spec}}}


@pytest.mark.parametrize(
    ("method", "spec", "expected"),
    [
        ("ngram", {"method": "ngram", "num_speculative_tokens": 0}, "set it to an integer k > 0"),
        ("mtp", {"method": "mtp", "num_speculative_tokens": -2}, "set it to an integer k > 0"),
        ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6, "prompt_lookup_max": 3},
         "prompt_lookup_min=6 must be <= prompt_lookup_max=3"),
    ],
    ids=["k-zero", "k-negative", "lookup-min-above-max"],
)
def test_bad_method_config_is_refused(tmp_path, method, spec, expected):
    result = _render_with_vars(method, tmp_path, _methods_with(method, spec))
    assert result.returncode != 0
    assert expected in result.stdout, result.stdout[-2000:]
    assert not any(tmp_path.rglob("*.service"))


@pytest.mark.parametrize(("k", "ok"), [(1, True), (2, True), (3, False), (4, True), (5, False)])
def test_mtp_k_against_two_mtp_layers(tmp_path, k, ok):
    """On a config with two MTP layers, k above two must be a multiple of two."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": {"mtp_num_hidden_layers": 2}}))
    dest = tmp_path / "out"
    extra = {**_methods_with("mtp", {"method": "mtp", "num_speculative_tokens": k}),
             "deploy_model_config_file": str(config)}
    result = _render_with_vars("mtp", dest, extra)
    if ok:
        assert result.returncode == 0, result.stdout[-2000:]
    else:
        assert result.returncode != 0
        assert f"num_speculative_tokens={k} does not fit the checkpoint's 2 MTP layer(s)" in result.stdout
        assert not any(dest.rglob("*.service"))


HYBRID = "qwen35-122b-hybrid"


def _example_profiles() -> dict:
    return yaml.safe_load((ROOT / EXAMPLE / "group_vars/all/main.yml").read_text())["sparkspec_profiles"]


def _with(profiles: dict, dotted: str, value) -> dict:
    *path, last = dotted.split(".")
    node = profiles
    for key in path:
        node = node[key]
    node[last] = value
    return profiles


@pytest.mark.parametrize(
    ("method", "field", "value", "expected"),
    [
        ("dflash", f"{HYBRID}.heads.dflash.repo", "../../../etc", r"repo id '(\.\./){3}etc' is not org/name"),
        ("dflash", f"{HYBRID}.heads.dflash.repo", "org/..", r"repo id 'org/\.\.' is not org/name"),
        ("baseline", f"{HYBRID}.int4.repo", "/etc/passwd", r"repo id '/etc/passwd' is not org/name"),
        ("baseline", f"{HYBRID}.fp8.repo", "a/b/c", r"repo id 'a/b/c' is not org/name"),
        ("baseline", f"{HYBRID}.int4.revision", "../../x", r"revision '\.\./\.\./x' is not a commit id"),
        ("baseline", f"{HYBRID}.dir", "../../etc", r"\.dir: '\.\./\.\./etc' is not a plain file name"),
        ("baseline", f"{HYBRID}.dir", "/etc", r"\.dir: '/etc' is not a plain file name"),
        ("baseline", "qwen3-30b-a3b.model.repo", "Qwen/../../etc", r"repo id 'Qwen/(\.\./){2}etc' is not"),
    ],
    ids=["head-dotdot", "head-dot-name", "absolute", "three-parts", "revision-path", "dir-dotdot",
         "dir-absolute", "plain-model"],
)
def test_untrusted_names_are_refused_before_any_file(tmp_path, method, field, value, expected):
    """Repo ids, revisions and folder names become paths on the host: each goes through sparkspec's one
    validator (the resolver, sparkspec.registry over sparkspec.validate) before any file is written."""
    profiles = _with(_example_profiles(), field, value)
    extra = {"sparkspec_profiles": profiles, "sparkspec_stage_profiles": [HYBRID, "qwen3-30b-a3b"]}
    result = _render_with_vars(method, tmp_path, extra)
    assert result.returncode != 0, result.stdout[-2000:]
    assert re.search(expected, result.stdout), result.stdout[-3000:]
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
