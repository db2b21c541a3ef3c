"""sparkspec.registry: the method and profile schema (one line naming the key), the repo-folder
rule, the profile lookup, the switch rule (what wins), and vLLM's command line against what the
Jinja args.yml rendered before the registry existed (registry_argv_golden.json, from `invoke render`
on the sim and example inventories)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkspec import registry
from sparkspec.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = json.loads((Path(__file__).with_name("registry_argv_golden.json")).read_text())["cases"]
NOW = "2026-12-01T04:00:00Z"


def _yaml(rel: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / rel).read_text()) or {}


CONTRACT = _yaml("roles/sparkspec/defaults/main.yml")
INVENTORIES = {
    "sim01": (_yaml("inventories/sim/group_vars/all.yml"), {}),
    "spark01": (
        _yaml("inventories/example/group_vars/all/main.yml"),
        _yaml("inventories/example/hosts.yml")["all"]["children"]["sparks"]["hosts"]["spark01"]),
    "spark02": (
        _yaml("inventories/example/group_vars/all/main.yml"),
        _yaml("inventories/example/hosts.yml")["all"]["children"]["sparks"]["hosts"]["spark02"]),
}


def _vars(host: str, **extra: Any) -> dict[str, Any]:
    """The host's variables as the play sees them: contract defaults, group vars, host vars."""
    group, host_vars = INVENTORIES[host]
    out = {**copy.deepcopy(CONTRACT), **copy.deepcopy(group), **copy.deepcopy(host_vars), **extra}
    # the three templated contract defaults, as Ansible renders them
    models = out["sparkspec_models_dir"]
    for key, value in (("sparkspec_sources_dir", f"{models}/sources"),
                       ("sparkspec_heads_dir", f"{models}/heads")):
        if out[key] == CONTRACT[key]:
            out[key] = value
    if out["sparkspec_stage_profiles"] == CONTRACT["sparkspec_stage_profiles"]:
        out["sparkspec_stage_profiles"] = [out["sparkspec_profile"]]
    return out


def _contract(v: dict[str, Any]) -> dict[str, Any]:
    return {k: v[f"sparkspec_{k}"] for k in registry.CONTRACT_KEYS}


def _command(v: dict[str, Any], record: dict[str, Any] | None = None) -> dict[str, Any]:
    resolved = registry.resolve(_contract(v), record, NOW)
    service = {"unit": v["sparkspec_unit_name"], "bind_address": v["sparkspec_bind_address"],
               "port": v["sparkspec_port"], "user": v["sparkspec_user"]}
    return registry.vllm_command(resolved, service)


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_argv_and_record_unchanged_from_the_jinja_program(case):
    host, method = case.split("-", 1)
    command = _command(_vars(host, sparkspec_method_switch=method))
    assert command["args"] == GOLDEN[case]["args"]
    # the record adds the levers where the profile turns them on (the example's hybrid: the INT8 LM
    # head and prefix caching)
    levers = command["record"].pop("levers", None)
    assert command["record"] == GOLDEN[case]["record"]
    profile = INVENTORIES[host][0]["sparkspec_profiles"][command["record"]["profile"]]
    # the sim's profile sets an option, off
    on = profile.get("levers") == ["int8_lm_head", "prefix_caching"]
    assert levers == ({"int8_lm_head": {"min_vocab": 100000}, "prefix_caching": {"match_unit": 16}}
                      if on else None)


def test_ngram5_from_the_inventory_only():
    ngram5 = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                                     "prompt_lookup_max": 5}}
    v = _vars("sim01", sparkspec_methods={"ngram5": ngram5}, sparkspec_method_switch="ngram5")
    args = _command(v)["args"]
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}
    # and without the extra table it is unknown, with every defined method listed
    with pytest.raises(UserError) as err:
        _command(_vars("sim01", sparkspec_method_switch="ngram5"))
    assert str(err.value).startswith("sparkspec_method_switch: unknown method 'ngram5'; "
                                     "choose one of baseline, ngram, mtp, eagle3, dflash")


def test_unknown_method_lists_built_ins_and_the_inventorys():
    v = _vars("sim01", sparkspec_method="warp",
              sparkspec_methods={"ngram5": {"speculative_config": None}})
    with pytest.raises(UserError) as err:
        registry.resolve(_contract(v), None, NOW)
    assert str(err.value) == ("sparkspec_method: unknown method 'warp'; choose one of "
                              "baseline, ngram, mtp, eagle3, dflash, ngram5 (or define it in "
                              "sparkspec_methods)")


def test_heads_come_through_the_methods_head_with_their_folders():
    resolved = registry.resolve(_contract(_vars("spark02", sparkspec_method_switch="eagle3")),
                                None, NOW)
    assert resolved["head"] == "eagle3"
    folder = "/opt/sparkspec/models/heads/Tengyunw--qwen3_30b_moe_eagle3"
    assert resolved["profile"]["heads"]["eagle3"]["folder"] == folder
    assert resolved["speculative_config"]["model"] == folder
    # a method whose head is named differently from the method still finds it
    v = _vars("spark02", sparkspec_method_switch="e3k2",
              sparkspec_methods={"e3k2": {"head": "eagle3", "speculative_config":
                                                {"method": "eagle3", "num_speculative_tokens": 2}}})
    assert registry.resolve(_contract(v), None, NOW)["speculative_config"]["model"] == folder


def test_resolved_profile_and_staged_profiles():
    resolved = registry.resolve(_contract(_vars("sim01")), None, NOW)
    assert resolved["method"] == "baseline" and resolved["method_source"] == "inventory"
    assert resolved["venv"] == "/opt/sparkspec/venvs/vllm"
    assert [p["name"] for p in resolved["staged"]] == ["sim-tiny", "sim-hybrid", "sim-mtp"]
    hybrid = resolved["staged"][1]
    assert hybrid["model_dir"] == "/opt/sparkspec/models/sim-qwen3.5-moe-hybrid"
    assert hybrid["sources"]["int4"]["folder"] == \
        "/opt/sparkspec/models/sources/sparkspec--sim-qwen3.5-moe-int4-AutoRound"
    assert resolved["profile"]["sources"]["model"]["folder"] == "/opt/sparkspec/models/sim-tiny"
    # a hybrid without fp8: the INT4 source alone, its MTP head registered
    mtp = resolved["staged"][2]
    assert (mtp["kind"], sorted(mtp["sources"]), mtp["expect_mtp_tensors"]) == \
        ("hybrid", ["int4"], 29)
    assert mtp["sources"]["int4"]["folder"] == \
        "/opt/sparkspec/models/sources/sparkspec--sim-qwen3-next"
    assert mtp["model_dir"] == "/opt/sparkspec/models/sim-qwen3-next"
    assert resolved["disk_gb"] == 3


def test_downloads_in_order_per_staged_profile():
    """What the fetch role downloads: per staged profile the model, or INT4 then the FP8 subset
    reading it; then all heads, or only the served method's head."""
    v = _vars("sim01")
    resolved = registry.resolve(_contract(v), None, NOW)
    got = [(d["profile"], d["mode"], d["repo"]) for d in registry.downloads(resolved)]
    heads = [(("sim-tiny", "repo", h["repo"]))
             for h in v["sparkspec_profiles"]["sim-tiny"]["heads"].values()]
    assert got == [("sim-tiny", "repo", v["sparkspec_profiles"]["sim-tiny"]["model"]["repo"]),
                   *heads, ("sim-hybrid", "repo", "sparkspec/sim-qwen3.5-moe-int4-AutoRound"),
                   ("sim-hybrid", "fp8-subset", "sparkspec/sim-qwen3.5-moe-FP8"),
                   ("sim-mtp", "repo", v["sparkspec_profiles"]["sim-mtp"]["int4"]["repo"])]
    subset = registry.downloads(resolved)[len(heads) + 2]
    assert subset["int4"] == resolved["staged"][1]["sources"]["int4"]["folder"]
    assert subset["dest"] == resolved["staged"][1]["sources"]["fp8"]["folder"]
    assert [d["repo"] for d in registry.downloads(resolved, "method")] == \
        [got[0][2], *[g[2] for g in got[-3:]]]
    switched = registry.resolve(_contract(_vars("sim01", sparkspec_method_switch="eagle3")),
                                None, NOW)
    only = [d for d in registry.downloads(switched, "method") if d["profile"] == "sim-tiny"]
    assert [d["dest"] for d in only][1:] == [switched["speculative_config"]["model"]]


def test_venv_method_over_profile_over_contract():
    v = _vars("sim01")
    v["sparkspec_profiles"]["sim-tiny"]["vllm_venv"] = "/p"
    assert registry.resolve(_contract(v), None, NOW)["venv"] == "/p"
    v["sparkspec_methods"] = {"baseline": {"speculative_config": None, "vllm_venv": "/m"}}
    assert registry.resolve(_contract(v), None, NOW)["venv"] == "/m"


def _set(v: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = v
    for key in path:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value


SCHEMA_ERRORS = [
    ("sparkspec_methods.x", {"speculative_config": {"num_speculative_tokens": 5}},
     "sparkspec_methods.x.speculative_config.method: missing; set it to ngram|mtp|"),
    ("sparkspec_methods.x", {"head": "eagle3"},
     "sparkspec_methods.x.speculative_config: missing; set it to null"),
    ("sparkspec_methods.x",
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
     "sparkspec_methods.x.speculative_config.num_speculative_tokens: 0; "
     "set it to an integer k > 0"),
    ("sparkspec_methods.x",
     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6,
                             "prompt_lookup_max": 3}},
     "sparkspec_methods.x.speculative_config: prompt_lookup_min=6 must be <= prompt_lookup_max=3"),
    ("sparkspec_methods.x", {"speculative_config": None, "serve": {"warp_drive": 1}},
     "sparkspec_methods.x.serve.warp_drive: unknown key; use one of attention_backend"),
    ("sparkspec_methods.x", {"speculative_config": None, "heads": "x"},
     "sparkspec_methods.x.heads: unknown key; did you mean head? use one of head, levers, serve, "
     "speculative_config, verify, vllm_venv"),
    ("sparkspec_methods.x", "ngram", "sparkspec_methods.x: is a str, not a mapping"),
    ("sparkspec_profiles.sim-tiny.kind", "dense",
     "sparkspec_profiles.sim-tiny.kind: 'dense'; set it to hybrid or plain"),
    ("sparkspec_profiles.sim-tiny.dir", "../etc",
     "sparkspec_profiles.sim-tiny.dir: '../etc' is not a plain file name"),
    ("sparkspec_profiles.sim-tiny.disk_gb", "lots",
     "sparkspec_profiles.sim-tiny.disk_gb: 'lots' is not a number >= 0"),
    ("sparkspec_profiles.sim-tiny.model", KeyError,
     "sparkspec_profiles.sim-tiny.model: missing; a plain profile names model"),
    ("sparkspec_profiles.sim-tiny.model.repo", "../../etc",
     "sparkspec_profiles.sim-tiny.model.repo: repo id '../../etc'"),
    ("sparkspec_profiles.sim-tiny.model.revision", "../x",
     "sparkspec_profiles.sim-tiny.model.revision: revision '../x'"),
    ("sparkspec_profiles.sim-tiny.int4", {"repo": "a/b"},
     "sparkspec_profiles.sim-tiny.int4: not a source of a plain"),
    ("sparkspec_profiles.sim-hybrid.fp8", KeyError,
     ("sparkspec_profiles.sim-hybrid.expect_fp8_layers: 12 FP8 layers expected but the profile "
      "names no fp8 source; add fp8 {repo, revision} or drop expect_fp8_layers")),
    ("sparkspec_profiles.sim-hybrid.int4", KeyError,
     ("sparkspec_profiles.sim-hybrid.int4: missing; a hybrid profile names int4 (and optionally "
      "fp8), each {repo, revision}")),
    ("sparkspec_profiles.sim-mtp.expect_mtp_tensors", "29",
     "sparkspec_profiles.sim-mtp.expect_mtp_tensors: '29' is not an integer >= 0"),
    ("sparkspec_profiles.sim-mtp.expect_fp8_layers", 3,
     ("sparkspec_profiles.sim-mtp.expect_fp8_layers: 3 FP8 layers expected but the profile names "
      "no fp8 source")),
    ("sparkspec_profiles.sim-hybrid.heads", {"d": {"repo": "a--b/c"}},
     "sparkspec_profiles.sim-hybrid.heads.d.repo: "),
    ("sparkspec_profiles.sim-hybrid.kernel", 1,
     "sparkspec_profiles.sim-hybrid.kernel: unknown key"),
    ("sparkspec_profile", "nope",
     "sparkspec_profile: 'nope' is not a key of sparkspec_profiles (known: sim-hybrid, sim-mtp, "
     "sim-tiny)"),
    ("sparkspec_stage_profiles", ["sim-tiny", "gone"],
     "sparkspec_stage_profiles: 'gone' is not a key of sparkspec_profiles"),
]


@pytest.mark.parametrize(("key", "value", "expected"), SCHEMA_ERRORS,
                         ids=[f"{k}={v!r}"[:60] for k, v, _ in SCHEMA_ERRORS])
def test_schema_errors_are_one_line_naming_the_key(key, value, expected):
    v = _vars("sim01")
    _set(v, key, value)
    if key.startswith("sparkspec_methods"):
        v["sparkspec_method"] = "x"
    with pytest.raises(UserError) as err:
        registry.resolve(_contract(v), None, NOW)
    message = str(err.value)
    assert expected in message and message.startswith(expected.split(":")[0] + ":")
    assert "\n" not in message and "Traceback" not in message


DFLASH = {"head": "dflash",
          "speculative_config": {"method": "dflash", "num_speculative_tokens": 15}}
SPEC_REFUSALS = [
    ({**DFLASH, "serve": {"attention_backend": "FLASH_ATTN"}},
     "sparkspec_methods.x.serve.attention_backend: is engine-wide (the target's backend "
     "too); drop it and set sparkspec_methods.x.speculative_config.attention_backend (the "
     "drafter's only) instead"),
    # leaving the flag out changes the target's backend too
    ({**DFLASH, "serve": {"attention_backend": ""}},
     "sparkspec_methods.x.serve.attention_backend: is engine-wide (the target's backend "
     "too); drop it and set sparkspec_methods.x.speculative_config.attention_backend (the "
     "drafter's only) instead"),
    ({"speculative_config": {"method": "ngram", "num_speculative_token": 4}},
     "sparkspec_methods.x.speculative_config.num_speculative_token: not a key the "
     "SpeculativeConfig of any vLLM release sparkspec knows takes (vllm/config/speculative.py); "
     "use num_speculative_tokens, or drop it"),
    ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 1,
                             "tensor_parallel_size": 1}},
     "sparkspec_methods.x.speculative_config.tensor_parallel_size: not a key the "
     "SpeculativeConfig of any vLLM release sparkspec knows takes (vllm/config/speculative.py); "
     "use draft_tensor_parallel_size, or drop it"),
    ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 2, "warp": 9}},
     "sparkspec_methods.x.speculative_config.warp: not a key the SpeculativeConfig of any vLLM "
     "release sparkspec knows takes (vllm/config/speculative.py); drop it"),
]


@pytest.mark.parametrize(("method", "expected"), SPEC_REFUSALS,
                         ids=["dflash-engine-wide", "dflash-engine-wide-empty",
                                                                    "typo", "internal-field",
                                                                    "no-close-field"])
def test_speculative_config_refusals_are_one_line(method, expected):
    v = _vars("sim01", sparkspec_methods={"x": method}, sparkspec_method="x")
    with pytest.raises(UserError) as err:
        registry.resolve(_contract(v), None, NOW)
    assert str(err.value) == expected and err.value.exit_code == 2


def _dflash(install_mode: str | None = None, revision: str | None = None,
            **extra: Any) -> dict[str, Any]:
    """The example's spark01 resolved with dflash, its head at ``revision`` and vLLM from
    ``install_mode``."""
    v = _vars("spark01", sparkspec_method_switch="dflash", **extra)
    if revision is not None:
        v["sparkspec_profiles"]["qwen35-122b-hybrid"]["heads"]["dflash"]["revision"] = revision
    return registry.resolve(_contract(v), None, NOW, (), {"install_mode": install_mode})


@pytest.mark.parametrize(("mode", "backend"), [(None, "FLASHINFER"), ("existing", "FLASHINFER"),
                                               ("wheel", "FLASHINFER"), ("source", "FLASH_ATTN")])
def test_dflash_drafter_backend_follows_the_install_mode(mode, backend):
    """The drafter's backend is vLLM's draft-only speculative_config.attention_backend
    (vllm/config/speculative.py:424), by install mode (registry DFLASH_BACKENDS); the target keeps
    the deploy's FLASHINFER (no engine-wide backend from the method)."""
    built_in = registry.BUILTIN_METHODS["dflash"]
    assert "attention_backend" not in built_in.get("serve", {})
    assert "attention_backend" not in built_in["speculative_config"]
    resolved = _dflash(mode)
    drafter = resolved["speculative_config"]["attention_backend"]
    assert drafter == backend == registry.DFLASH_BACKENDS[mode or "existing"]
    target = resolved["serve"]["attention_backend"]
    assert target == registry.SERVE_DEFAULTS["attention_backend"] == "FLASHINFER"
    with pytest.raises(UserError,
                       match=r"^vllm_install_mode: 'pip'; use one of source, wheel, existing$"):
        _dflash("pip")


def test_a_dflash_method_in_a_venv_of_its_own_drafts_with_flashinfer():
    """A method's own vllm_venv is a vLLM the install mode did not build: its drafter takes the
    backend that runs on any build (FLASHINFER), not the source build's FLASH_ATTN."""
    v = _vars("spark01", sparkspec_method_switch="dflash")
    v["sparkspec_methods"] = {"dflash": {**DFLASH, "vllm_venv": "/opt/other-vllm"}}
    resolved = registry.resolve(_contract(v), None, NOW, (), {"install_mode": "source"})
    assert (resolved["venv"], resolved["speculative_config"]["attention_backend"]) == \
        ("/opt/other-vllm", "FLASHINFER")


def test_a_dflash_method_with_its_own_backend_keeps_it():
    mine = {**DFLASH,
            "speculative_config": {**DFLASH["speculative_config"],
                                   "attention_backend": "TRITON_ATTN"}}
    contract = _contract(_vars("sim01", sparkspec_methods={"x": mine}, sparkspec_method="x"))
    resolved = registry.resolve(contract, None, NOW, (), {"install_mode": "source"})
    assert resolved["speculative_config"]["attention_backend"] == "TRITON_ATTN"
    assert registry.check_method("x", mine)["serve"] == {}


@pytest.mark.parametrize(("revision", "k", "source"), [
    ("main", 12, "registry (dflash)"),
    ("2274357" + "a" * 33, 12, "registry (dflash, drafter 2274357)"),
    ("6c7242c" + "b" * 33, 5, "registry (dflash, drafter 6c7242c)"),
    ("0123456" + "c" * 33, 12, "registry (dflash)"),
])
def test_dflash_k_follows_the_pinned_drafter(revision, k, source):
    """The registry's k is the best published one for the drafter revision the head pins
    (DFLASH_REVISIONS); an unknown revision or a branch takes the built-in k, the newest
    drafter's."""
    resolved = _dflash("wheel", revision)
    assert (resolved["speculative_config"]["num_speculative_tokens"], resolved["k_source"]) == \
        (k, source)
    # a k the owner set wins over the drafter's
    tuned = _dflash("wheel", revision, sparkspec_num_speculative_tokens={"dflash": 7})
    assert (tuned["speculative_config"]["num_speculative_tokens"], tuned["k_source"]) == (
        7, "sparkspec_num_speculative_tokens")


def test_a_dflash_k_is_checked_against_the_heads_own_block():
    """A k the owner sets is not capped at z-lab's block here: the deploy checks it against the
    fetched head's own dflash_config.block_size (sparkspec checkpoint check-head --k,
    tests/unit/checkpoint/test_heads.py), before anything changes; the registry's own k fits
    z-lab's block (tests/unit/project/test_spark_facts.py)."""
    resolved = _dflash("wheel", sparkspec_num_speculative_tokens={"dflash": 20})
    assert resolved["speculative_config"]["num_speculative_tokens"] == 20
    validate = (ROOT / "roles/deploy/tasks/validate_head.yml").read_text()
    assert '--k, "{{ _deploy_spec.num_speculative_tokens }}"' in validate


def test_pinned_revisions_are_required_where_asked():
    """sparkspec_require_pinned_revisions: every source and head of every profile at a full commit
    id, refused in one line naming the first that is not; off (the default), a branch is served."""
    assert _dflash("wheel")["method"] == "dflash"          # the example's heads say main
    with pytest.raises(UserError,
                       match=r"^sparkspec_profiles\.qwen35-122b-hybrid\.int4\.revision: 'main' is "
                       r"not a full commit id, and sparkspec_require_pinned_revisions asks "
                       r"for one; pin the 40-character id"):
        _dflash("wheel", sparkspec_require_pinned_revisions=True)
    v = _vars("spark01", sparkspec_require_pinned_revisions=True)
    for profile in v["sparkspec_profiles"].values():
        for part in ("int4", "fp8", "model"):
            if part in profile:
                profile[part]["revision"] = "d" * 40
        for head in (profile.get("heads") or {}).values():
            head["revision"] = "e" * 40
    # a short id
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["heads"]["dflash"]["revision"] = "2274357"
    with pytest.raises(UserError,
                       match=r"^sparkspec_profiles\.qwen35-122b-hybrid\.heads\.dflash\.revision: "
                       r"'2274357' is not a full commit id"):
        registry.resolve(_contract(v), None, NOW)
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["heads"]["dflash"]["revision"] = \
        "2274357" + "f" * 33
    assert registry.resolve(_contract(v), None, NOW)["profile"]["name"] == "qwen35-122b-hybrid"
    for bad in ("yes", 1):
        with pytest.raises(UserError,
                           match=r"^sparkspec_require_pinned_revisions: .* is not true or false"):
            registry.resolve(_contract({**v, "sparkspec_require_pinned_revisions": bad}), None, NOW)
    # a contract that leaves it out, or null (compare's and tune's own contracts), does not ask
    # for pins
    unset = _contract({**_vars("spark01"), "sparkspec_require_pinned_revisions": None})
    assert registry.resolve(unset, None, NOW)["method"] == "mtp"


@pytest.mark.parametrize(("repo", "ok"),
                         [("Qwen/Qwen3.5-122B-A10B-FP8", "Qwen--Qwen3.5-122B-A10B-FP8"),
                          ("a/b/c", None), ("../x", None), ("a--b/c", None), (None, None)])
def test_repo_folder_rule(repo, ok):
    if ok:
        assert registry.repo_folder(repo, "k") == ok
    else:
        with pytest.raises(UserError, match=r"^k: repo id "):
            registry.repo_folder(repo, "k")


def test_profile_lookup():
    dirs = {"models": "/m", "sources": "/m/s", "heads": "/m/h"}
    profiles = _vars("spark01")["sparkspec_profiles"]
    profile = registry.lookup_profile(profiles, "qwen3-30b-a3b", dirs)
    assert (profile["kind"], profile["model_dir"],
            profile["served_model_name"]) == ("plain", "/m/qwen3-30b-a3b",
                                                                                    "qwen3-30b-a3b")
    assert profile["heads"]["eagle3"]["folder"] == "/m/h/Tengyunw--qwen3_30b_moe_eagle3"
    with pytest.raises(UserError,
                       match=r"^sparkspec_profile: 'x' is not a key .*known: qwen35-122b-hybrid, "
                                        r"qwen3-30b-a3b"):
        registry.lookup_profile(profiles, "x", dirs)


def _rec(method: str, inventory: str, time: str = "t0") -> dict[str, str]:
    return {"method": method, "inventory_method": inventory, "time": time}


# (inventory's method, switch, record on the host) -> (method served, source, record action, record
# kept/written)
WHAT_WINS = [
    ("baseline", None, None, "baseline", "inventory", "none", None),
    ("baseline", "ngram", None, "ngram", "switch", "write", _rec("ngram", "baseline", NOW)),
    ("baseline", "ngram", _rec("ngram", "baseline"), "ngram", "switch", "keep",
     _rec("ngram", "baseline")),
    ("baseline", "mtp", _rec("ngram", "baseline"), "mtp", "switch", "write",
     _rec("mtp", "baseline", NOW)),
    ("baseline", "baseline", _rec("ngram", "baseline"), "baseline", "switch", "remove", None),
    ("baseline", "baseline", None, "baseline", "switch", "none", None),
    ("baseline", None, _rec("ngram", "baseline"), "ngram", "recorded", "keep",
     _rec("ngram", "baseline")),
    ("mtp", None, _rec("ngram", "baseline"), "mtp", "inventory", "remove", None),
    ("mtp", "ngram", _rec("ngram", "baseline"), "ngram", "switch", "write",
     _rec("ngram", "mtp", NOW)),
    ("baseline", None, {"garbage": 1}, "baseline", "inventory", "none", None),
]


@pytest.mark.parametrize(("inventory", "switch", "record", "method", "source", "action", "kept"),
                         WHAT_WINS)
def test_what_wins(inventory, switch, record, method, source, action, kept):
    chosen = registry.choose_method(inventory, switch, record, NOW)
    assert (chosen["method"], chosen["source"], chosen["action"],
            chosen["record"]) == (method, source, action, kept)
    if source == "recorded":
        assert chosen["note"] == (f"serving {method}, switched to at t0 (the switch wins while "
                                  f"the inventory still says {inventory}); go back with: "
                                  f"invoke deploy --method {inventory}")
    if action == "remove" and source == "inventory":
        assert "the inventory's method mtp wins over the earlier switch to ngram" in chosen["note"]


def test_resolve_passes_the_record_through():
    v = _vars("sim01")
    resolved = registry.resolve(_contract(v), _rec("ngram", "baseline"), NOW)
    assert (resolved["method"], resolved["method_source"],
            resolved["inventory_method"]) == ("ngram", "recorded", "baseline")
    assert resolved["desired"]["previous"] == _rec("ngram", "baseline")  # what a rollback puts back
    assert registry.resolve(_contract(v), None, NOW)["desired"]["previous"] is None
    args = _command(v, _rec("ngram", "baseline"))["args"]
    assert json.loads(args[args.index("--speculative-config") + 1])["method"] == "ngram"


def test_one_thin_playbook_per_built_in_method():
    built_ins = set(registry.BUILTIN_METHODS)
    playbooks = {p.stem.removeprefix("deploy-"): p
                 for p in (ROOT / "playbooks").glob("deploy-*.yml")}
    assert set(playbooks) == built_ins
    for method, path in playbooks.items():
        (play,) = yaml.safe_load(path.read_text())
        assert play["ansible.builtin.import_playbook"] == "deploy.yml"
        assert play["vars"] == {"sparkspec_method_switch": method}


def test_rules_live_only_in_the_registry():
    """Nothing else derives a repo folder or looks a profile up by hand."""
    offenders = []
    for base in ("roles", "playbooks", "tasks", "src", "inventories"):
        for path in (ROOT / base).rglob("*"):
            if path.suffix in (".py", ".yml", ".j2") and path.is_file():
                text = path.read_text()
                if re.search(r"replace\(\s*['\"]/['\"]\s*,\s*['\"]--['\"]",
                             text) and path.name != "validate.py":
                    offenders.append(str(path))
                if ("sparkspec_profiles[sparkspec_profile]" in text
                        or "role_path | dirname | dirname }}/templates" in text):
                    offenders.append(str(path))
    assert offenders == []


def test_serve_merges_registry_defaults_then_profile_then_method_then_host():
    """One order, each layer overriding the one below it by knob name; the rest comes from below."""
    v = _vars("spark01", sparkspec_method_switch="m")
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["verify"] = {}   # no needle tier to fit
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["serve"] = {"max_model_len": 1000,
                                                              "reasoning_parser": "p1",
                                                              "max_num_batched_tokens": 10}
    v["sparkspec_methods"] = {"m": {"speculative_config": None,
                                    "serve": {"max_model_len": 2000, "reasoning_parser": "m1"}}}
    v["sparkspec_serve"] = {"reasoning_parser": "h1"}
    serve = registry.resolve(_contract(v), None, NOW)["serve"]
    assert (serve["max_model_len"], serve["reasoning_parser"],
            serve["max_num_batched_tokens"]) == (2000, "h1", 10)
    assert serve["gpu_memory_utilization"] == registry.SERVE_DEFAULTS["gpu_memory_utilization"]
    assert set(serve) == set(registry.KNOBS)
    # enable_prefix_caching: the default follows the profile's kind (off for a hybrid), the
    # prefix_caching lever (on in the example's hybrid) turns it on with its match unit, over every
    # layer's setting
    assert (serve["enable_prefix_caching"], serve["prefix_match_unit"]) == (True, 16)
    v["sparkspec_serve"] = {"enable_prefix_caching": False, "prefix_match_unit": 8}
    assert registry.resolve(_contract(v), None, NOW)["serve"]["prefix_match_unit"] == 16
    v["sparkspec_levers"] = {"prefix_caching": {"match_unit": 8}}
    assert registry.resolve(_contract(v), None, NOW)["serve"]["prefix_match_unit"] == 8
    v["sparkspec_levers"] = {"prefix_caching": False}
    del v["sparkspec_serve"]["enable_prefix_caching"]
    off = registry.resolve(_contract(v), None, NOW)["serve"]
    assert (off["enable_prefix_caching"], off["prefix_match_unit"]) == (False, 8)
    assert registry.resolve(
        _contract(_vars("spark02")), None, NOW)["serve"]["enable_prefix_caching"] is True


def test_floors_merge_in_the_same_order_and_per_method():
    v = _vars("spark01")
    floors = registry.resolve(_contract(v), None, NOW)["floors"]
    assert {m: f["min_tok_s"] for m, f in floors.items()} == {
        m: (e.get("verify") or {}).get("min_tok_s") for m, e in registry.BUILTIN_METHODS.items()}
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["verify"] = {"min_tok_s": 5,
                                                               "min_acceptance_rate": 50}
    v["sparkspec_verify"] = {"min_acceptance_rate": 60}
    floors = registry.resolve(_contract(v), None, NOW)["floors"]
    # no floor of its own: the profile's
    assert floors["eagle3"] == {"min_tok_s": 5, "min_acceptance_rate": 60, "prefix_cache": None,
                                "needle_tiers": None}
    assert floors["mtp"] == {"min_tok_s": registry.BUILTIN_METHODS["mtp"]["verify"]["min_tok_s"],
                             # the method's over the profile's
                             "min_acceptance_rate": 60, "prefix_cache": None, "needle_tiers": None}
    with pytest.raises(UserError,
                       match=r"^sparkspec_verify.min_acceptance_rate: 120 is not a number >= 0 "
                                        r"and <= 100"):
        registry.resolve(_contract({**v, "sparkspec_verify": {"min_acceptance_rate": 120}}),
                         None, NOW)


@pytest.mark.parametrize(("tiers", "expected"), [
    ([8192, 262144], r"^verify.needle_tiers: 262144 tokens is above what mtp serves: "
                     r"max_model_len 262144 less the answer's 32 tokens; lower the tier"),
    ([32768, 8192], r"needle_tiers: \[32768, 8192\] is not a list of 1 to 16 context lengths"),
    ([64], r"each >= 128"),
    ("8192", r"is not a list of 1 to 16"),
], ids=["above-max-model-len", "descending", "too-short", "a-string"])
def test_a_needle_tier_the_profile_cannot_serve_is_refused(tiers: Any, expected: str) -> None:
    v = _vars("spark01")
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["verify"] = {"needle_tiers": tiers}
    with pytest.raises(UserError, match=expected):
        registry.resolve(_contract(v), None, NOW)
    v["sparkspec_profiles"]["qwen35-122b-hybrid"]["verify"] = {"needle_tiers": [8192, 262112]}
    assert registry.resolve(_contract(v), None, NOW)["verify"]["needle_tiers"] == [8192, 262112]


def test_compare_row_on_another_profile_serves_that_profiles_settings():
    """`invoke compare --methods eagle3@qwen3-30b-a3b` on spark01 (which stages both example
    profiles): the plan, resolved from the example inventory as Ansible reads it, serves the 30B
    with its own context length and tool parser, not the 122B's 262144 and qwen3_coder; no host is
    contacted."""
    from tasks.compare import plan as compare_plan
    from tasks.lib import inventory

    inv = inventory.load(ROOT / "inventories/example")
    values = inv.host_vars("spark01", tuple(f"sparkspec_{k}" for k in registry.CONTRACT_KEYS))
    rows = compare_plan.plan(compare_plan.parse("eagle3@qwen3-30b-a3b",
                                                values["sparkspec_profile"]))
    resolved = compare_plan.check(rows, values)
    assert [r.name for r in rows] == ["baseline@qwen3-30b-a3b", "eagle3@qwen3-30b-a3b"]
    service = {"unit": "u", "bind_address": "127.0.0.1", "port": 8000, "user": "s"}
    for row, host in zip(rows, resolved, strict=True):
        args = registry.vllm_command(host, service)["args"]
        assert args[args.index("--max-model-len") + 1] == "40960", row
        assert args[args.index("--tool-call-parser") + 1] == "hermes", row
        assert args[args.index("--served-model-name") + 1] == "qwen3-30b-a3b", row
    # and the inventory's own profile keeps the 122B's
    (own,) = compare_plan.check([compare_plan.Row("mtp", "qwen35-122b-hybrid")], values)
    assert own["serve"]["max_model_len"] == 262144 and \
        own["serve"]["tool_call_parser"] == "qwen3_coder"


@pytest.mark.parametrize("old", sorted(registry.RENAMED))
def test_a_renamed_variable_is_one_line_naming_the_new_key(old):
    with pytest.raises(UserError) as err:
        registry.resolve(_contract(_vars("sim01")), None, NOW, set_names=["sparkspec_port", old])
    message = str(err.value)
    assert message.startswith(f"{old}: renamed in sparkspec 0.2.0; set ") and "\n" not in message
    new = registry.RENAMED[old].split()[0].strip("`")
    assert new.startswith(("sparkspec_", "verify:")), new
    assert registry.resolve(_contract(_vars("sim01")), None, NOW,
                            set_names=["sparkspec_port"])["method"]
