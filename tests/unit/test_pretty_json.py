"""The worker encodes handler results with `pretty_json`: it must write exactly what
`json.dumps(value, indent=2)` writes (TorchServe's encoding), or raise what it raises."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
import pytest

from mariner.server.worker.encoding import encode_output, pretty_json


class _Str(str):
    pass


class _Int(int):
    def __repr__(self) -> str:
        return "not-json"


def _nested(depth: int) -> list[Any]:
    value: list[Any] = [1]
    for _ in range(depth - 1):
        value = [value]
    return value


CASES: list[Any] = [
    {"label": 3, "topk": [{"label": 3, "probability": 0.987654}, {"label": 5, "probability": 1.2e-05}]},
    {},
    [],
    [[]],
    {"a": {}, "b": [], "c": ()},
    (1, (2, [3])),
    "plain",
    'quote " backslash \\ newline \n tab \t é \u2028 \U0001f600',
    0,
    -17,
    123456789012345678901234567890,
    1.5,
    -0.0,
    1e16,
    2.5e-300,
    float("nan"),
    float("inf"),
    float("-inf"),
    None,
    True,
    False,
    [True, False, None, 1, 1.0, "1"],
    {"é": {"nested": [{"deep": [[[[1]]]]}]}},
    # Leave-to-json cases: non-str keys, subclasses, numpy values, an OrderedDict.
    {1: "int key", 2.5: "float key", False: "bool key", None: "none key"},
    {_Str("k"): _Str("v")},
    [_Int(5)],
    OrderedDict(a=1, b=[2]),
    _nested(70),  # deeper than the fast path goes: json.dumps writes it
]


@pytest.mark.parametrize("value", CASES, ids=range(len(CASES)))
def test_pretty_json_writes_what_json_dumps_writes(value: Any) -> None:
    assert pretty_json(value) == json.dumps(value, indent=2)
    if not isinstance(value, str):  # a str result is sent as its UTF-8 text, not as JSON
        assert encode_output(value) == json.dumps(value, indent=2).encode("utf-8")


@pytest.mark.parametrize(
    "value", [{"x": object()}, [np.float32(1.0)], {("tuple", "key"): 1}], ids=["object", "numpy", "tuple-key"]
)
def test_pretty_json_raises_what_json_dumps_raises(value: Any) -> None:
    with pytest.raises(TypeError) as ours:
        pretty_json(value)
    with pytest.raises(TypeError) as theirs:
        json.dumps(value, indent=2)
    assert str(ours.value) == str(theirs.value)


def test_a_cycle_is_refused_as_json_dumps_refuses_it() -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="Circular reference"):
        pretty_json(cyclic)
