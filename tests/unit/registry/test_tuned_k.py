"""The contract key sparkspec_num_speculative_tokens (what `invoke tune --apply` writes): k per
method over the method's speculative_config, where the served k came from (k_source), the unit's
record that carries both, and `invoke status` reading them back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sparkspec import registry
from sparkspec.errors import UserError
from tasks.lib import status

NOW = "2026-12-01T04:00:00Z"
SERVICE = {"unit": "sparkspec-vllm", "bind_address": "127.0.0.1", "port": 8000, "user": "sparkspec"}
KEY = "sparkspec_num_speculative_tokens"


@pytest.fixture(scope="module")
def sim01() -> dict[str, Any]:
    """sim01's contract as a play reads it (tasks.lib.inventory: the defaults under the sim
    inventory's vars)."""
    from tasks.lib import inventory

    values = inventory.load("inventories/sim").host_vars(
        "sim01", tuple(f"sparkspec_{k}" for k in registry.CONTRACT_KEYS))
    return {k: values.get(f"sparkspec_{k}") for k in registry.CONTRACT_KEYS}


def _resolve(contract: dict[str, Any], method: str, **over: Any) -> dict[str, Any]:
    return registry.resolve({**contract, "method_switch": method, **over}, None, NOW)


def test_the_contract_default_is_an_empty_mapping(sim01: dict[str, Any]) -> None:
    assert "num_speculative_tokens" in registry.CONTRACT_KEYS
    assert sim01["num_speculative_tokens"] == {}


def test_tuned_k_overrides_the_chosen_methods_k_only(sim01: dict[str, Any]) -> None:
    r = _resolve(sim01, "ngram", num_speculative_tokens={"ngram": 3, "mtp": 5})
    # k replaced, the method's other fields kept
    assert r["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert r["k_source"] == KEY
    # untouched
    assert registry.BUILTIN_METHODS["ngram"]["speculative_config"]["num_speculative_tokens"] == 4
    # the entry for mtp does not reach ngram; served, mtp gets its own
    assert _resolve(sim01, "mtp",
                    num_speculative_tokens={"ngram": 3, "mtp": 5})["speculative_config"] == {
        "method": "mtp", "num_speculative_tokens": 5}


def test_tuned_k_of_a_head_method_keeps_its_head_folder(sim01: dict[str, Any]) -> None:
    r = _resolve(sim01, "dflash", num_speculative_tokens={"dflash": 7})
    spec = r["speculative_config"]
    assert (spec["num_speculative_tokens"], spec["attention_backend"]) == (7, "FLASHINFER")
    assert spec["model"].endswith("/sparkspec--sim-tiny-DFlash")
    assert r["head_kind"] == "dflash"


def test_k_source_values(sim01: dict[str, Any]) -> None:
    assert _resolve(sim01, "ngram")["k_source"] == "registry (ngram)"
    assert _resolve(sim01, "mtp", num_speculative_tokens={"ngram": 2})["k_source"] == \
        "registry (mtp)"
    own = {"ngram5": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5}}}
    r = _resolve(sim01, "ngram5", methods=own)
    assert r["k_source"] == "sparkspec_methods.ngram5"
    assert r["speculative_config"]["num_speculative_tokens"] == 5
    # an inventory method replacing a built-in by name is the inventory's
    mine = {"ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 6}}}
    assert _resolve(sim01, "ngram", methods=mine)["k_source"] == "sparkspec_methods.ngram"
    # and the tuned key wins over the inventory's method
    r = _resolve(sim01, "ngram5", methods=own, num_speculative_tokens={"ngram5": 2})
    assert (r["k_source"], r["speculative_config"]["num_speculative_tokens"]) == (KEY, 2)


def test_baseline_has_no_k_and_no_source(sim01: dict[str, Any]) -> None:
    r = _resolve(sim01, "baseline", num_speculative_tokens={"ngram": 3})
    assert (r["speculative_config"], r["k_source"]) == (None, None)


@pytest.mark.parametrize(("tuned", "match"), [
    ({"nope": 3},
     rf"^{KEY}\.nope: no such method; choose one of baseline, ngram, mtp, eagle3, dflash$"),
    ({"baseline": 1},
     rf"^{KEY}\.baseline: method baseline drafts nothing \(no speculative_config\), so it has no "
     r"k; remove the entry$"),
    ({"ngram": 0}, rf"^{KEY}\.ngram: 0; set it to an integer k > 0 and <= 64"),
    ({"ngram": 65}, rf"^{KEY}\.ngram: 65; set it to an integer k > 0 and <= 64"),
    ({"ngram": True}, rf"^{KEY}\.ngram: True; set it to an integer k > 0 and <= 64"),
    ({"ngram": "3"}, rf"^{KEY}\.ngram: '3'; set it to an integer k > 0 and <= 64"),
    ({"ngram": 2.0}, rf"^{KEY}\.ngram: 2\.0; set it to an integer k > 0 and <= 64"),
    ([3], rf"^{KEY}: is a list, not a mapping"),
    ("{{ k }}", rf"^{KEY}: is a str, not a mapping"),
])
def test_bad_tuned_k_is_one_line(sim01: dict[str, Any], tuned: Any, match: str) -> None:
    with pytest.raises(UserError, match=match):
        _resolve(sim01, "mtp", num_speculative_tokens=tuned)


def test_every_entry_is_checked_even_when_not_served(sim01: dict[str, Any]) -> None:
    with pytest.raises(UserError, match=rf"^{KEY}\.eagle3: 99;"):
        _resolve(sim01, "baseline", num_speculative_tokens={"eagle3": 99})


def test_the_units_record_carries_k_and_its_source(sim01: dict[str, Any]) -> None:
    tuned = registry.vllm_command(_resolve(sim01, "mtp", num_speculative_tokens={"mtp": 3}),
                                  SERVICE)
    assert (tuned["record"]["num_speculative_tokens"], tuned["record"]["k_source"]) == (3, KEY)
    args = tuned["args"]
    assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp",
                                                                        "num_speculative_tokens": 3}
    plain = registry.vllm_command(_resolve(sim01, "ngram"), SERVICE)["record"]
    assert (plain["num_speculative_tokens"], plain["k_source"]) == (4, "registry (ngram)")
    base = registry.vllm_command(_resolve(sim01, "baseline"), SERVICE)["record"]
    assert "num_speculative_tokens" not in base and "k_source" not in base
    assert base["method"] == "baseline"


def _probe(record: Any) -> dict[str, Any]:
    return {"show": {"ActiveState": "active", "SubState": "running", "LoadState": "loaded"},
            "record": record, "health": 200}


def test_status_reads_k_and_its_source_from_the_record() -> None:
    s = status._status("spark01", "sparkspec-vllm", _probe({"method": "mtp", "profile": "p",
                                                            "num_speculative_tokens": 3,
                                                            "k_source": KEY}))
    assert (s.method, s.k, s.k_source) == ("mtp", 3, KEY)
    old = status._status("spark01", "u", _probe({"method": "mtp"}))   # a record from before the key
    assert (old.k, old.k_source) == (None, None)
    odd = status._status("spark01", "u", _probe({"method": "mtp", "num_speculative_tokens": "x",
                                                 "k_source": 5}))
    assert (odd.k, odd.k_source) == (None, None)
    assert status._status("spark01", "u", _probe(None)).k is None


def test_status_table_shows_k_and_where_it_came_from() -> None:
    from rich.console import Console

    s = status._status("spark01", "u", _probe({"method": "ngram", "num_speculative_tokens": 3,
                                               "k_source": "registry (ngram)"}))
    b = status._status("spark02", "u", _probe({"method": "baseline"}))
    console = Console(record=True, width=300)
    console.print(status.table([s, b]))
    text = console.export_text()
    assert "k (from)" in text
    assert "3 (registry (ngram))" in text
    row = next(line for line in text.splitlines() if "spark02" in line)
    assert "baseline" in row and " - " in row


def test_status_shows_the_levers_of_the_record() -> None:
    from rich.console import Console

    levers = {"int8_lm_head": {"min_vocab": 1}}
    on = status._status("spark01", "u", _probe({"method": "mtp", "levers": levers}))
    assert on.levers == ["int8_lm_head"]
    assert status._status("spark02", "u", _probe({"method": "mtp"})).levers == []
    # not a mapping
    odd = status._status("spark02", "u", _probe({"method": "mtp", "levers": ["x"]}))
    assert odd.levers == []
    console = Console(record=True, width=300)
    console.print(status.table([on]))
    row = next(line for line in console.export_text().splitlines() if "spark01" in line)
    assert "int8_lm_head" in row


def test_status_shows_headless_mode_and_what_it_freed() -> None:
    from rich.console import Console

    record = {"previous_default": "graphical.target", "display_manager": "gdm3.service",
              "display_manager_was_active": True, "freed_bytes": 12 * 2**30}
    on = status._status("spark01", "u", {**_probe({"method": "mtp"}), "headless": record})
    quiet = status._status("spark02", "u", {**_probe({"method": "mtp"}),
                                            "headless": {**record, "freed_bytes": None}})
    off = status._status("spark03", "u",
                         {**_probe({"method": "mtp"}), "headless": ["not", "a", "record"]})
    assert on.headless == record and off.headless is None
    console = Console(record=True, width=300)
    console.print(status.table([on, quiet, off]))
    rows = {line.split()[1]: line for line in console.export_text().splitlines()
            if "spark0" in line}
    assert "on (freed +12.0 GiB)" in rows["spark01"]
    assert "on (nothing to stop)" in rows["spark02"] and \
        rows["spark03"].rstrip(" │|").endswith("off")
