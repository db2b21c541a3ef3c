"""The bounded JSON reader every untrusted document goes through."""

from __future__ import annotations

import pytest

from sparkspec.jsonfile import JsonShapeError, loads_bounded


@pytest.mark.parametrize("text,why", [
    ('{"hidden_size": 128, "hidden_size": true}', "twice"),
    ('{"a": {"x": 1, "x": 2}}', "twice"),
    ('[NaN]', "NaN"),
    ('[-Infinity]', "Infinity"),
    ('[1e999]', "finite"),
    ("[" * 65 + "]" * 65, "deeper"),
])
def test_refused(text: str, why: str) -> None:
    with pytest.raises(JsonShapeError, match=why):
        loads_bounded(text)


def test_size_bound_and_strings_do_not_count_as_nesting() -> None:
    with pytest.raises(JsonShapeError, match="bytes"):
        loads_bounded(b"[" + b"1," * 100 + b"1]", max_bytes=100)
    assert loads_bounded('{"a": "[[[[{{{{", "b": [1.5, {"c": '
                         'null}]}') == {"a": "[[[[{{{{", "b": [1.5, {"c": None}]}
    assert loads_bounded("[" * 64 + "]" * 64) is not None
