"""`invoke tune`'s plan (tasks.tune.plan): the k and concurrency options, the workload (the owner's
prompts file read before any play), the method's k bound, the sweep's rows and each row's extra
vars."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sparkspec import registry
from sparkspec.errors import UserError
from tasks.tune import plan
from tasks.tune.plan import Row, Workload

GOOD = '{"prompt": "Write a haiku about speculative decoding."}\n{"prompt": "List three primes."}\n'


# --- -k, --k-max ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "want"), [
    ("1,2,4", [1, 2, 4]),
    ("4, 1,2", [1, 2, 4]),       # sorted: the last one is k_max
    ("1-6", [1, 2, 3, 4, 5, 6]),
    ("1-3,5", [1, 2, 3, 5]),
    ("7", [7]),
    ("64", [64]),
])
def test_k_list_and_ranges(text: str, want: list[int]) -> None:
    assert plan.parse_ks(text, 0, 4, 64) == want


@pytest.mark.parametrize(("text", "match"), [
    ("2,2", r"^-k: 2 is listed twice"),
    ("1-3,2", r"^-k: 2 is listed twice"),
    (",", r"^-k: nothing given"),
    (" , ,", r"^-k: nothing given"),
    ("0", r"^-k: 0 is outside 1\.\.64"),
    ("-1", r"^-k: '-1' is not a k"),
    ("abc", r"^-k: 'abc' is not a k \(an integer, or a range such as 1-6\)"),
    ("2.5", r"^-k: '2\.5' is not a k"),
    ("3-1", r"^-k: '3-1' is an empty range"),
    ("65", r"^-k: 65 is outside 1\.\.64"),
    ("60-70", r"^-k: 65 is outside 1\.\.64"),
])
def test_bad_k_is_one_line(text: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        plan.parse_ks(text, 0, 4, 64)


def test_k_defaults_to_the_current_k_and_k_max_replaces_it() -> None:
    assert plan.parse_ks("", 0, 4, 64) == [4]
    assert plan.parse_ks("", 6, 4, 64) == [6]
    with pytest.raises(UserError, match=r"^--k-max: '65' is not a whole number in 1\.\.64"):
        plan.parse_ks("", 65, 4, 64)
    with pytest.raises(UserError, match=r"^--k-max: 0 is not an integer in 1\.\.64"):
        plan.parse_ks("", 0, 0, 64)   # no --k-max and a current k of 0: nothing to measure


def test_k_and_k_max_together_are_refused() -> None:
    with pytest.raises(UserError, match=r"^-k and --k-max both given"):
        plan.parse_ks("1,2", 4, 4, 64)


def test_k_above_a_dflash_block_names_block_size() -> None:
    # block_size 16: k <= 15
    assert plan.parse_ks("1-15", 0, 15, 15)[-1] == 15
    with pytest.raises(UserError,
                       match=r"16 is above what this method allows \(15: the DFlash head's "
                             r"block_size - 1.*give k <= 15"):
        plan.parse_ks("1-16", 0, 15, 15)
    with pytest.raises(UserError, match=r"block_size - 1"):
        plan.parse_ks("", 16, 15, 15)
    # the default k itself above a small block
    with pytest.raises(UserError, match=r"block_size - 1"):
        plan.parse_ks("", 0, 15, 7)


# --- --concurrency --------------------------------------------------------------------------------

def test_levels() -> None:
    assert plan.parse_levels("1,4") == [1, 4]
    assert plan.parse_levels("8,1") == [1, 8]
    assert plan.parse_levels("256") == [256]
    for bad, match in (("0", r"0 is outside 1\.\.256"), ("257", r"257 is outside 1\.\.256"),
                       ("", r"nothing given"), ("1,1", r"1 is listed twice")):
        with pytest.raises(UserError, match=rf"^--concurrency: {match}"):
            plan.parse_levels(bad)


# --- the workload ---------------------------------------------------------------------------------

def _workload(**kw: Any) -> Workload:
    args: dict[str, Any] = {"suite": "all", "prompts": "", "requests": 0, "temperature": 0.0,
                            "thinking": False, "max_tokens": 0}
    return plan.workload(**{**args, **kw})


def test_default_workload_and_its_values() -> None:
    assert _workload() == Workload("all", "", None, 0.0, False, None)
    assert _workload(suite="open", requests=20, temperature="0.6", thinking=1, max_tokens=1024) == \
        Workload("open", "", 20, 0.6, True, 1024)


def test_a_good_prompts_file_is_absolute_and_its_suite_is_prompts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.jsonl").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    load = _workload(prompts="mine.jsonl")
    assert load.prompts == str(tmp_path / "mine.jsonl") and os.path.isabs(load.prompts)
    assert load.suite == "prompts"


@pytest.mark.parametrize(("content", "match"), [
    ("", r"suite has no prompts"),
    ("\n\n", r"suite has no prompts"),
    ("prompt: hello\n", r"mine\.jsonl:1: not JSON"),
    ('{"text": "no prompt key"}\n', r"mine\.jsonl:1: has no 'prompt'"),
])
def test_a_bad_prompts_file_is_one_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        _workload(prompts=str(path))


def test_a_prompts_folder_or_a_missing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(UserError, match=r"d\.jsonl: is not a regular file"):
        _workload(prompts=str(tmp_path / "d.jsonl"))
    with pytest.raises(UserError, match=r"no such suite or file"):
        _workload(prompts=str(tmp_path / "missing.jsonl"))


def test_a_prompts_file_over_16_mib_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    path.write_text(GOOD)
    subprocess.run(["truncate", "-s", str((16 << 20) + 1), str(path)], check=True)   # sparse: fast
    with pytest.raises(UserError,
                       match=r"big\.jsonl: the suite file is 16777217 bytes, more than the "
                             r"16777216"):
        _workload(prompts=str(path))


def test_a_prompts_file_that_is_not_jsonl_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(GOOD)
    with pytest.raises(UserError, match=r"mine\.json: not a \.jsonl file"):
        _workload(prompts=str(path))


def test_a_prompts_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real.jsonl").write_text(GOOD)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    with pytest.raises(UserError):
        _workload(prompts=str(tmp_path / "link.jsonl"))


@pytest.mark.parametrize(("kw", "match"), [
    ({"suite": "bogus"}, r"^--suite: 'bogus' is not one of structured, open, agent, all"),
    ({"suite": "open", "prompts": "x.jsonl"}, r"^--prompts and --suite both given"),
    ({"temperature": "hot"}, r"^--temperature: 'hot' is not a number"),
    ({"temperature": 2.5}, r"^--temperature: 2\.5 is outside 0\.\.2"),
    ({"temperature": -0.1}, r"^--temperature: -0\.1 is outside 0\.\.2"),
    ({"temperature": float("nan")}, r"^--temperature: nan is outside 0\.\.2"),
    ({"requests": -1}, r"^--requests: '-1' is not a whole number"),
    ({"requests": 100_001}, r"^--requests: '100001' is not a whole number"),
    ({"requests": True}, r"^--requests: 'True' is not a whole number"),
    ({"max_tokens": 262_145}, r"^--max-tokens: '262145' is not a whole number"),
    ({"max_tokens": 1.5}, r"^--max-tokens: '1\.5' is not a whole number"),
    # as invoke passes an option
    ({"requests": "abc"}, r"^--requests: 'abc' is not a whole number"),
    ({"max_tokens": "²"}, r"^--max-tokens: '²' is not a whole number"),
    ({"temperature": "warm"}, r"^--temperature: 'warm' is not a number"),
])
def test_bad_workload_options_are_one_line(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match):
        _workload(**kw)


# --- the method and its k bound -------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim01() -> dict[str, Any]:
    from tasks.lib import inventory

    inv = inventory.load("inventories/sim")
    return inv.host_vars("sim01", tuple(f"sparkspec_{k}" for k in registry.CONTRACT_KEYS))


def test_a_drafting_method_resolves_with_its_k(sim01: dict[str, Any]) -> None:
    resolved = plan.method_spec(sim01, "ngram", "sim-tiny")
    assert resolved["method"] == "ngram"
    assert resolved["speculative_config"]["num_speculative_tokens"] == 4   # the built-in's
    tuned = plan.method_spec({**sim01, "sparkspec_num_speculative_tokens": {"ngram": 2}}, "ngram",
                             "sim-tiny")
    assert tuned["speculative_config"]["num_speculative_tokens"] == 2
    assert tuned["k_source"] == "sparkspec_num_speculative_tokens"


def test_baseline_is_refused_naming_the_methods_that_draft(sim01: dict[str, Any]) -> None:
    with pytest.raises(UserError,
                       match=r"^--method baseline: drafts nothing .* tune a method that drafts: "
                             r"ngram, mtp, eagle3, dflash$"):
        plan.method_spec(sim01, "baseline", "sim-tiny")
    # a profile without heads cannot serve eagle3 or dflash: they are not offered
    with pytest.raises(UserError, match=r"tune a method that drafts: ngram, mtp$"):
        plan.method_spec(sim01, "baseline", "sim-hybrid")


def test_an_unknown_method_is_the_registrys_line(sim01: dict[str, Any]) -> None:
    with pytest.raises(UserError, match=r"unknown method 'nope'; choose one of baseline, ngram"):
        plan.method_spec(sim01, "nope", "sim-tiny")


def test_the_profile_must_be_staged(sim01: dict[str, Any]) -> None:
    assert plan.staged_profile(sim01, "") == "sim-tiny"            # the inventory's
    assert plan.staged_profile(sim01, "sim-mtp") == "sim-mtp"      # sim01 stages it
    with pytest.raises(UserError,
                       match=r"^--profile qwen35-122b-hybrid: not staged on this host \(staged: "
                             r"sim-tiny, sim-hybrid, sim-mtp\); add it to sparkspec_stage_"):
        plan.staged_profile(sim01, "qwen35-122b-hybrid")
    # no stage list: the inventory's profile only
    alone = {"sparkspec_profile": "p1", "sparkspec_stage_profiles": None}
    assert plan.staged_profile(alone, "") == "p1"
    with pytest.raises(UserError, match=r"^--profile p2: not staged on this host \(staged: p1\)"):
        plan.staged_profile(alone, "p2")


def test_block_limit() -> None:
    assert plan.block_limit(None) == 64
    assert plan.block_limit({"dflash_config": {"block_size": 16}}) == 15
    assert plan.block_limit({"dflash_config": {"block_size": 2}}) == 1
    assert plan.block_limit({"dflash_config": {"block_size": 1000}}) == 64
    for bad in ({}, {"dflash_config": None}, {"dflash_config": [16]}, {"dflash_config": {}},
                {"dflash_config": {"block_size": True}}, {"dflash_config": {"block_size": 1}},
                {"dflash_config": {"block_size": "16"}}, {"dflash_config": {"block_size": 16.0}}):
        with pytest.raises(UserError, match=r"dflash_config\.block_size .* not an integer >= 2"):
            plan.block_limit(bad)


# --- rows and their vars --------------------------------------------------------------------------

def test_rows_baseline_then_k_max_then_the_rest_at_every_level() -> None:
    rows = plan.rows("ngram", [1, 3, 6], [1, 4])
    assert [(r.k, r.concurrency, r.deploy) for r in rows] == [
        (0, 1, True), (0, 4, False), (6, 1, True), (6, 4, False),
        (1, 1, True), (1, 4, False), (3, 1, True), (3, 4, False)]
    assert [r.name for r in rows[:3]] == ["baseline-k0-c1", "baseline-k0-c4", "ngram-k6-c1"]
    assert {r.method for r in rows} == {"ngram"}
    assert [r.name for r in plan.rows("mtp", [2], [8])] == ["baseline-k0-c8", "mtp-k2-c8"]


def test_extra_vars_of_a_drafting_deploy_row() -> None:
    host = {"mtp": 2, "ngram": 5}
    load = Workload("open", "", 30, 0.6, True, 2048)
    extra = plan.extra_vars(Row("ngram", 3, 1, True), "sim-tiny", host, load, "/r",
                            ("int8_lm_head",))
    # this k over the host's
    assert extra["sparkspec_num_speculative_tokens"] == {"mtp": 2, "ngram": 3}
    # the host's left as it was
    assert host == {"mtp": 2, "ngram": 5}
    assert extra == {
        "sparkspec_profile": "sim-tiny", "sparkspec_num_speculative_tokens": {"mtp": 2, "ngram": 3},
        # the tuned method's levers, exactly
        "sparkspec_levers": {"int8_lm_head": {"enabled": True},
                             "prefix_caching": {"enabled": False}},
        "verify_report_name": "ngram-k3-c1", "verify_reports_dir": "/r",
        "verify_enforce_floors": False, "verify_concurrency": 1, "verify_temperature": 0.6,
        "verify_enable_thinking": True, "verify_prompts_file": "", "verify_suite": "open",
        "verify_requests": 30, "verify_rerecord_reference": False, "verify_lossless": True,
        "verify_max_tokens": 2048}


def test_extra_vars_of_baseline_and_verify_only_rows() -> None:
    host = {"mtp": 2}
    load = Workload()
    base = plan.extra_vars(Row("ngram", 0, 1, True), "p", host, load, "/r")
    assert base["sparkspec_num_speculative_tokens"] == {"mtp": 2}   # no k 0 written for baseline
    # the method's levers: none
    assert base["sparkspec_levers"] == {"int8_lm_head": {"enabled": False},
                                        "prefix_caching": {"enabled": False}}
    assert (base["verify_rerecord_reference"], base["verify_lossless"]) == (True, True)
    assert base["verify_report_name"] == "baseline-k0-c1"
    assert "verify_max_tokens" not in base   # None: the verify role's own
    base4 = plan.extra_vars(Row("ngram", 0, 4, False), "p", host, load, "/r")
    assert (base4["verify_rerecord_reference"], base4["verify_lossless"]) == (False, False)
    top4 = plan.extra_vars(Row("ngram", 4, 4, False), "p", host, load, "/r")
    assert (top4["verify_rerecord_reference"], top4["verify_lossless"]) == (False, False)
    assert top4["sparkspec_num_speculative_tokens"] == {"mtp": 2, "ngram": 4}
    assert all(v["verify_enforce_floors"] is False for v in (base, base4, top4))
    assert (top4["verify_concurrency"], top4["verify_requests"], top4["verify_suite"]) == \
        (4, None, "all")


def test_a_prompts_file_reaches_verify_with_suite_all(tmp_path: Path) -> None:
    (tmp_path / "mine.jsonl").write_text(GOOD)
    load = _workload(prompts=str(tmp_path / "mine.jsonl"))
    extra = plan.extra_vars(Row("mtp", 2, 1, True), "p", {}, load, "/r")
    assert extra["verify_prompts_file"] == str(tmp_path / "mine.jsonl")
    assert extra["verify_suite"] == "all"


@pytest.mark.parametrize("name",
                         ["{{ lookup('pipe', 'id') }}.jsonl", "a{%x%}.jsonl", "b{#c#}.jsonl",
                          "tab\there.jsonl"])
def test_a_prompts_path_ansible_would_template_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text('{"prompt": "hi"}\n')
    with pytest.raises(UserError, match="control character or a Jinja marker"):
        plan.workload("all", str(path), 0, 0.0, False, 0)


SERVING = {"method": "ngram", "profile": "sim-tiny", "k": 4, "state": "active", "health": 200}


@pytest.mark.parametrize(("change", "match"), [
    ({"method": None}, "sim01 serves nothing"),
    ({"state": "failed"}, r"unit failed, /health 200\): tune measures against a healthy host"),
    ({"health": 503}, "/health 503"),
    ({"profile": "{{ lookup('pipe', 'id') }}"}, "which the inventory does not define"),
    ({"profile": ["sim-tiny"]}, "which the inventory does not define"),
    ({"method": "warp"}, "which the inventory cannot deploy again"),
])
def test_what_served_is_checked_before_the_sweep(sim01: dict[str, Any], change: dict,
                                                 match: str) -> None:
    """The host's record is not trusted: what the restore deploys again must resolve from the
    inventory."""
    with pytest.raises(UserError, match=match):
        plan.restore_of(sim01, "sim01", {**SERVING, **change})


def test_the_restore_puts_back_the_k_that_served(sim01: dict[str, Any]) -> None:
    same = plan.restore_of(sim01, "sim01", SERVING)   # the registry's ngram k is 4
    assert same == plan.Restore("ngram", "sim-tiny", {"sparkspec_profile": "sim-tiny"})
    other = plan.restore_of(sim01, "sim01", {**SERVING, "k": 2})  # e.g. a sweep left it, or --apply
    assert other.extra == \
        {"sparkspec_profile": "sim-tiny", "sparkspec_num_speculative_tokens": {"ngram": 2}}
    base = plan.restore_of(sim01, "sim01", {**SERVING, "method": "baseline", "k": None})
    assert base.extra == {"sparkspec_profile": "sim-tiny"}


@pytest.mark.parametrize(("method", "head", "group", "match"), [
    ("ngram..5", "sim01", None, "its results name 'ngram..5-k"),
    ("ngram", "../victim", None, "host '../victim': not a plain name"),
    ("ngram", "a/b", None, "host 'a/b': not a plain name"),
    ("ngram", "sim01", "..", "group '..': not a plain name"),
])
def test_names_that_become_paths_are_checked(method: str, head: str, group: str | None,
                                             match: str) -> None:
    with pytest.raises(UserError, match=match):
        plan.check_names(plan.rows(method, [1, 2], [1]), head, group)
