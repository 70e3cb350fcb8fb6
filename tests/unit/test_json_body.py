"""`json_body.loads` answers what `json.loads` answers: the same value (types, float bits, the
sign of zero, big integers) or the same exception with the same message, on valid documents,
documents orjson refuses, and arbitrary bytes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mariner.server.common import json_body


def same(a: Any, b: Any) -> bool:
    """Equal as values and as types: 1 is not 1.0, -0.0 is not 0.0, NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def outcome(decode: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "value", decode(raw)
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return type(exc).__name__, str(exc)


def check(raw: bytes) -> None:
    ours, theirs = outcome(json_body.loads, raw), outcome(json.loads, raw)
    assert ours[0] == theirs[0], (raw[:80], ours, theirs)
    if ours[0] == "value":
        assert same(ours[1], theirs[1]), (raw[:80], ours, theirs)
    else:
        assert ours[1] == theirs[1], raw[:80]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()  # unbounded: past 64 bits too
    | st.floats()  # NaN, infinities, -0.0, subnormals
    | st.text(),  # lone surrogates too
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(json_values, st.sampled_from([None, 2]), st.booleans())
def test_any_document_decodes_to_the_same_value(value: Any, indent: int | None, ascii_only: bool) -> None:
    check(json.dumps(value, indent=indent, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_give_the_same_value_or_the_same_error(raw: bytes) -> None:
    check(raw)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=0, max_value=200), st.binary(min_size=1, max_size=3))
def test_a_damaged_document_gives_the_same_value_or_the_same_error(value: Any, at: int, junk: bytes) -> None:
    raw = json.dumps(value).encode("utf-8", "surrogatepass")
    at = min(at, len(raw))
    check(raw[:at] + junk + raw[at:])


@pytest.mark.parametrize(
    "raw",
    [
        b"123456789012345678901234567890",  # past 64 bits: orjson would give a float
        b"-9223372036854775809",
        b"18446744073709551616",
        b'{"id": 12345678901234567890123}',
        b"1e400",
        b"-1e400",
        b"NaN",
        b"[Infinity, -Infinity]",
        b'"\\ud800"',
        b'"\xed\xa0\x80"',
        b"\xef\xbb\xbf{}",
        '{"a": 1}'.encode("utf-16"),
        '{"a": 1}'.encode("utf-32"),
        b"[" * 5000 + b"]" * 5000,
        b'{"a": 1, "a": 2}',
        b"0.1000000000000000055511151231257827",
        b"01",
        b"[1,]",
        b"",
    ],
)
def test_documents_orjson_refuses_or_reads_otherwise_answer_as_json_loads(raw: bytes) -> None:
    check(raw)


def test_an_ordinary_body_does_not_go_through_the_standard_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of the module: the digits body is decoded without json.loads."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("json.loads was called")

    monkeypatch.setattr(json_body.json, "loads", refuse)
    body = json.dumps({"data": [0.0, 1.5, 16, -3], "name": "digit é"}).encode()
    assert json_body.loads(body) == {"data": [0.0, 1.5, 16, -3], "name": "digit é"}
