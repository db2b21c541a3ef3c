"""The vLLM release gate (sparkspec.registry.releases): release names refused in one line, keys and
methods gated by the active release, and which release a host serves (switch, record, inventory)."""

from __future__ import annotations

from typing import Any

import pytest

from sparkspec import registry
from sparkspec.registry import releases
from tests.unit.registry.test_resolve import NOW, _contract, _vars


@pytest.mark.parametrize(("value", "expected"), [
    ("0.32.1", "sparkspec_vllm_release: vLLM 0.32.1 has no record in sparkspec (its pins, fields "
               "and patches are unchecked); give one of 0.31.0, 0.32.0, 0.33.0, 0.34.0"),
    ("0.20.1", "sparkspec_vllm_release: vLLM 0.20.1 is older than sparkspec's floor 0.31.0"),
    ("../0.32.0", "sparkspec_vllm_release: '../0.32.0' is not a vLLM release (X.Y.Z, digits and "
                  "dots only)"),
    ("0.32.0;rm -rf /", "is not a vLLM release (X.Y.Z, digits and dots only)"),
    ("0.32.0/../../etc", "is not a vLLM release"),
    ("v0.32.0", "is not a vLLM release"),
    ("0.32.0\n", "is not a vLLM release"),
    (32, "sparkspec_vllm_release: 32 is not a vLLM release"),
])
def test_a_bad_release_is_one_line(value: Any, expected: str) -> None:
    with pytest.raises(registry.RegistryError) as err:
        releases.release(value)
    assert expected in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("version", "spec", "expected"), [
    ("0.32.0", {"method": "ngram", "num_speculative_tokens": 4, "xpress_topc": 2},
     "x.xpress_topc: vLLM 0.32.0 has no such speculative_config key (vLLM 0.33.0, 0.34.0 have "
     "it)"),
    ("0.34.0", {"method": "mtp", "num_speculative_tokens": 2, "use_heterogeneous_vocab": True},
     "x.use_heterogeneous_vocab: vLLM 0.34.0 has no such speculative_config key (vLLM 0.31.0, "
     "0.32.0, 0.33.0 have it)"),
    ("0.34.0", {"method": "dflash", "num_speculative_tokens": 8, "parallel_drafting": True},
     "x.parallel_drafting: deprecated in vLLM 0.34.0 and has no effect there"),
    ("0.33.0", {"method": "medusa", "num_speculative_tokens": 2},
     "x.method: vLLM 0.33.0 serves no method 'medusa' (vLLM 0.31.0, 0.32.0 have it)"),
    ("0.34.0", {"method": "custom_class", "num_speculative_tokens": 2},
     "x.method: vLLM 0.34.0 serves no method 'custom_class' (vLLM 0.31.0, 0.32.0, 0.33.0 have "
     "it)"),
])
def test_a_key_or_method_the_release_lacks_is_refused(version: str, spec: dict[str, Any],
                                                      expected: str) -> None:
    with pytest.raises(registry.RegistryError) as err:
        releases.check_spec(spec, releases.RELEASES[version], "x")
    assert str(err.value).startswith(expected), str(err.value)


@pytest.mark.parametrize(("version", "spec"), [
    ("0.32.0", {"method": "dspark", "num_speculative_tokens": 4, "dspark_draft_topk": 2}),
    ("0.33.0", {"method": "mtp", "num_speculative_tokens": 2,
                "draft_lm_head_quantization": "fp8"}),
    ("0.32.0", {"method": "dflash", "num_speculative_tokens": 8, "parallel_drafting": True}),
    ("0.34.0", {"method": "suffix", "num_speculative_tokens": 8,
                "suffix_decoding_corpus_tokens": 1000}),
])
def test_a_key_the_release_has_passes(version: str, spec: dict[str, Any]) -> None:
    releases.check_spec(spec, releases.RELEASES[version], "x")


def test_the_resolver_gates_the_methods_keys_by_the_served_release() -> None:
    methods = {"x": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                            "xpress_topc": 2}}}
    v = _vars("sim01", sparkspec_methods=methods, sparkspec_method_switch="x")
    with pytest.raises(registry.RegistryError, match="vLLM 0.32.0 has no such speculative_config"):
        registry.resolve(_contract(v), None, NOW)
    v["sparkspec_vllm_release"] = "0.33.0"
    assert registry.resolve(_contract(v), None, NOW)["release"]["version"] == "0.33.0"


def test_each_release_gets_a_venv_of_its_own_in_wheel_and_source_modes() -> None:
    v = _vars("sim01", sparkspec_vllm_release="0.31.0")
    wheel = registry.resolve(_contract(v), None, NOW, cluster={"install_mode": "wheel"})
    assert wheel["venv"] == "/opt/sparkspec/venvs/vllm-0.31.0"
    assert wheel["release"]["torch"] == "2.13.0" and wheel["release"]["inc_patch_fits"] == [
        "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    existing = registry.resolve(_contract(v), None, NOW, cluster={"install_mode": "existing"})
    assert existing["venv"] == "/opt/sparkspec/venvs/vllm"


def _record(release: str, previous: str, inventory: str = "0.32.0") -> dict[str, str]:
    return {"release": release, "previous": previous, "inventory_release": inventory,
            "time": "t0"}


def test_a_switch_is_recorded_with_the_release_it_replaces() -> None:
    chosen = releases.choose_release("0.32.0", "0.33.0", None, NOW)
    assert chosen["version"] == "0.33.0"
    assert chosen["record"] == _record("0.33.0", "0.32.0") | {"time": NOW}
    # later runs keep it while the inventory says what it said then
    kept = releases.choose_release("0.32.0", "", _record("0.33.0", "0.32.0"), NOW)
    assert (kept["version"], kept["previous"], kept["record"]) == ("0.33.0", "0.32.0", None)
    assert "go back with: invoke rollback" in kept["note"]
    # rollback: the recorded previous, recorded in turn with the one it replaces
    back = releases.choose_release("0.32.0", "previous", _record("0.33.0", "0.32.0"), NOW)
    assert back["version"] == "0.32.0" and back["record"]["previous"] == "0.33.0"


def test_the_inventory_wins_once_it_changed_and_rollback_needs_a_record() -> None:
    moved = releases.choose_release("0.34.0", "", _record("0.33.0", "0.32.0"), NOW)
    assert moved["version"] == "0.34.0" and moved["record"]["previous"] == "0.33.0"
    with pytest.raises(registry.RegistryError, match="no earlier vLLM release is recorded"):
        releases.choose_release("0.32.0", "previous", None, NOW)
    with pytest.raises(registry.RegistryError, match=r"--vllm: vLLM 9\.9\.9 has no record"):
        releases.choose_release("0.32.0", "9.9.9", None, NOW)
    # a switch to what is served changes nothing
    same = releases.choose_release("0.32.0", "0.33.0", _record("0.33.0", "0.32.0"), NOW)
    assert same["record"] is None and same["version"] == "0.33.0"
    # an inventory that moved on to the release served takes the record over, previous kept
    adopted = releases.choose_release("0.33.0", "", _record("0.33.0", "0.32.0"), NOW)
    assert adopted["record"] == _record("0.33.0", "0.32.0", "0.33.0") | {"time": NOW}
    # a host's first deploy records what it serves (a later rollback has nothing before it)
    first = releases.choose_release("0.32.0", "", None, NOW)
    assert first["record"] == _record("0.32.0", "") | {"time": NOW}
