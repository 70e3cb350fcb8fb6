"""KServe v1's request and answer shapes (mariner.server.frontend.protocols.kserve_v1), without a server."""

from __future__ import annotations

import pytest

from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferResult
from mariner.server.frontend.protocols.kserve_v1 import (
    MAX_INSTANCES,
    answer_value,
    handler_row,
    parse_instances,
)

pytestmark = pytest.mark.unit


def test_instances_are_read_from_the_envelope() -> None:
    assert parse_instances(b'{"instances": [[1, 2], {"data": 3}]}') == [[1, 2], {"data": 3}]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"", "empty body"),
        (b"[1, 2]", '{"instances": [...]}'),
        (b'{"inputs": [1]}', '{"instances": [...]}'),
        (b'{"instances": []}', "at least one instance"),
        (b'{"instances": 3}', "at least one instance"),
        (b"{nope", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"instances": [' + b",".join([b"0"] * (MAX_INSTANCES + 1)) + b"]}", f"at most {MAX_INSTANCES}"),
    ],
)
def test_bad_requests_are_invalid_argument(body: bytes, fragment: str) -> None:
    with pytest.raises(ServingError) as info:
        parse_instances(body)
    assert info.value.code is Code.INVALID_ARGUMENT
    assert fragment in info.value.message


def test_an_object_instance_is_the_handler_row_anything_else_its_body() -> None:
    assert handler_row({"data": [1], "target": 2}) == {"data": [1], "target": 2}
    assert handler_row([1, 2]) == {"body": [1, 2]}
    assert handler_row("text") == {"body": "text"}


def test_answers_become_json_values() -> None:
    assert answer_value(InferResult(body=b'{\n  "label": 3\n}')) == {"label": 3}
    assert answer_value(InferResult(body=b"plain words")) == "plain words"
    assert answer_value(InferResult(body=b"\xff\x00")) == {"b64": "/wA="}
