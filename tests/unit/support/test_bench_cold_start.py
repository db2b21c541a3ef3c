"""The cold-start bench's summary lines (tests/support/bench_cold_start.py)."""

from __future__ import annotations

from tests.support.bench_cold_start import summary


def _pairs(cold_state, warm_state):
    start = {"ready_s": 30.0, "compile_s": None, "compile_cache": cold_state}
    again = {"ready_s": 20.0, "compile_s": None, "compile_cache": warm_state}
    return {"host": "sim01", "method": "dflash", "key": "k1", "pairs": [{"cold": start,
                                                                        "warm": again}] * 3}


def test_the_states_are_named_and_an_eager_line_says_it_compiles_nothing():
    lines = summary(_pairs("stored", "loaded"))
    assert lines[-1] == "  compile cache: cold stored; warm loaded"
    assert "warm/cold READY median 0.67 (min 0.67, max 0.67, n=3)" in lines[-2]
    eager = summary(_pairs(None, None))
    assert eager[-1] == ("  compile cache: none reported (the command line compiles nothing: "
                         "enforce_eager)")
