"""TorchServe's `send_intermediate_predict_response`, unchanged, against Mariner's Context.

The real `ts` function builds its backend's frame and writes it to `context.cl_socket`; the
Context's channel decodes it back into one part per request it names and hands each to whoever
runs the handler. A Context made for one of several concurrent calls keeps its own per-request
state and channel.
"""

from __future__ import annotations

import struct

import pytest
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.protocol.otf_message_handler import create_predict_response

from mariner.server.contracts.types import InferResult
from mariner.server.worker.context import Context
from mariner.server.worker.intermediate import FrameFormatError, IntermediateChannel, decode_frame

pytestmark = pytest.mark.unit


def context(ids: list[str]) -> Context:
    ctx = Context("m", "/nowhere", {"model": {}}, batch_size=len(ids), gpu_id=None)
    ctx.begin_batch(ids, [{} for _ in ids])
    return ctx


def test_the_real_ts_function_reaches_the_deliver_hook_part_by_part() -> None:
    ctx = context(["r0", "r1"])
    got: list[tuple[str, InferResult]] = []
    ctx.cl_socket.deliver = lambda rid, part: got.append((rid, part))
    ctx.set_response_content_type(1, "text/plain")
    ctx.set_response_header(1, "X-Mine", "yes")
    send_intermediate_predict_response(["a", {"b": 1}], ctx.request_ids, "ok", 200, ctx)
    assert [rid for rid, _ in got] == ["r0", "r1"]
    first, second = got[0][1], got[1][1]
    assert (first.body, first.status, first.content_type) == (b"a", 200, None)
    assert second.body == b'{\n  "b": 1\n}'  # TorchServe's JSON for a non-str answer
    assert (second.content_type, second.headers) == ("text/plain", {"x-mine": "yes"})
    # TorchServe's stream marker is the codec's, not an answer header.
    assert "ts_stream_next" not in first.headers
    assert ctx.get_response_headers(0)["ts_stream_next"] == "true"  # left where ts set it


def test_only_the_requests_named_get_a_part() -> None:
    ctx = context(["r0", "r1", "r2"])
    got: list[str] = []
    ctx.cl_socket.deliver = lambda rid, part: got.append(rid)
    send_intermediate_predict_response(["x", "y", "z"], {2: "r2"}, "", 200, ctx)
    assert got == ["r2"]


def test_a_frame_that_fails_its_requests_carries_its_code_and_message() -> None:
    frame = decode_frame(create_predict_response(["x"], {0: "r0"}, "Prediction failed", 503, context(["r0"])))
    ((rid, part),) = frame.parts
    assert (rid, part.status, part.body) == ("r0", 503, b"Prediction failed")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        struct.pack("!i", 200),  # no message length
        struct.pack("!ii", 200, 99) + b"short",  # a field running past the end
        bytes(create_predict_response(["x"], {0: "r0"}, "", 200)) + b"extra",  # bytes after the end
    ],
)
def test_bytes_that_are_not_one_frame_are_refused(data: bytes) -> None:
    with pytest.raises(FrameFormatError):
        IntermediateChannel(lambda rid, part: None).sendall(data)


def test_without_a_listener_parts_are_dropped_not_raised() -> None:
    ctx = context(["r0"])
    send_intermediate_predict_response(["x"], ctx.request_ids, "", 200, ctx)  # no deliver hook


def test_a_context_for_one_of_several_calls_keeps_its_own_requests_and_channel() -> None:
    base = context(["a0"])
    base.system_properties["shared"] = 1
    seen: list[tuple[str, str]] = []
    one = base.for_call(["c1"], [{"X": "1"}], lambda rid, part: seen.append(("one", rid)))
    two = base.for_call(["c2", "c3"], [{}, {}], lambda rid, part: seen.append(("two", rid)))
    one.set_response_status(404, "no", 0)
    assert (one.get_request_id(0), two.get_request_id(1), base.get_request_id(0)) == ("c1", "c3", "a0")
    assert one.get_request_header(0, "x") == "1"
    assert two.get_response_status(0) == (200, "")
    assert base.get_response_status(0) == (200, "")
    assert one.system_properties is base.system_properties  # the instance's, shared
    send_intermediate_predict_response(["p"], one.request_ids, "", 200, one)
    send_intermediate_predict_response(["p", "q"], two.request_ids, "", 200, two)
    assert seen == [("one", "c1"), ("two", "c2"), ("two", "c3")]
