"""How `ModelHost` calls a handler: a plain one on the calling thread, a coroutine one awaited
(several calls at once, each with its own Context), a coroutine returned by a plain `handle`
run to its end, and intermediate answers handed to the caller's `deliver` as they are sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from tests.unit.test_failures import host_for

pytestmark = pytest.mark.unit


def req(i: int, body: Any = None) -> InferRequest:
    return InferRequest("m", "1", {"body": body if body is not None else i}, WireProtocol.TS_HTTP, f"r{i}")


ASYNC_CLASS = """
import asyncio

class Handler:
    def initialize(self, context):
        self.gates = {}

    async def handle(self, data, context):
        out = []
        for i, row in enumerate(data):
            op = row["body"]
            if isinstance(op, dict) and "wait" in op:
                gate = self.gates.setdefault(op["wait"], asyncio.Event())
                await gate.wait()
                out.append(f"{context.get_request_id(i)} released")
            elif isinstance(op, dict) and "set" in op:
                self.gates.setdefault(op["set"], asyncio.Event()).set()
                out.append(f"{context.get_request_id(i)} set")
            else:
                await asyncio.sleep(0)
                out.append(f"{context.get_request_id(i)} {op}")
        return out
"""


def test_a_coroutine_handler_is_detected_and_its_calls_overlap(tmp_path: Path) -> None:
    host = host_for(tmp_path, ASYNC_CLASS)
    assert host.is_async

    async def both() -> list[list[InferResult]]:
        waiting = asyncio.ensure_future(host.run_batch_async([req(0, {"wait": "g"})]))
        await asyncio.sleep(0)  # the first call is now waiting for an event only the second sets
        assert not waiting.done()
        setting = await host.run_batch_async([req(1, {"set": "g"})])
        return [await waiting, setting]

    first, second = asyncio.run(both())
    assert [r.body for r in first + second] == [b"r0 released", b"r1 set"]


def test_a_coroutine_handler_called_synchronously_is_run_to_its_end(tmp_path: Path) -> None:
    host = host_for(tmp_path, ASYNC_CLASS)
    results = host.run_batch([req(0, "a"), req(1, "b")])
    assert [r.body for r in results] == [b"r0 a", b"r1 b"]


def test_a_plain_handle_that_returns_a_coroutine_is_awaited(tmp_path: Path) -> None:
    code = """
import asyncio

async def _answer(data):
    await asyncio.sleep(0)
    return [row["body"] * 2 for row in data]

def handle(data, context):
    if data is None:
        return None
    return _answer(data)
"""
    host = host_for(tmp_path, code)
    assert not host.is_async
    assert [json.loads(r.body) for r in host.run_batch([req(2), req(3)])] == [4, 6]


def test_an_async_function_entry_point_is_initialised_and_served(tmp_path: Path) -> None:
    code = """
state = {}

async def handle(data, context):
    if data is None:  # TorchServe initialises a function entry point with handle(None, ctx)
        state["ready"] = True
        return None
    return [state.get("ready", False) for _ in data]
"""
    host = host_for(tmp_path, code)
    assert host.is_async
    assert [r.body for r in asyncio.run(host.run_batch_async([req(0)]))] == [b"true"]


STREAMING = """
from ts.handler_utils.utils import send_intermediate_predict_response

def handle(data, context):
    if data is None:
        return None
    for n in range(2):
        send_intermediate_predict_response([f"p{n}"] * len(data), context.request_ids, "", 200, context)
    return ["end"] * len(data)
"""

ASYNC_STREAMING = STREAMING.replace("def handle", "async def handle")


@pytest.mark.parametrize("code", [STREAMING, ASYNC_STREAMING])
def test_intermediate_answers_reach_deliver_before_the_final_results(tmp_path: Path, code: str) -> None:
    host = host_for(tmp_path, code)
    got: list[tuple[str, bytes]] = []

    def deliver(request_id: str, part: InferResult) -> None:
        got.append((request_id, part.body))

    if host.is_async:
        results = asyncio.run(host.run_batch_async([req(0), req(1)], deliver))
    else:
        results = host.run_batch([req(0), req(1)], deliver)
    assert got == [("r0", b"p0"), ("r1", b"p0"), ("r0", b"p1"), ("r1", b"p1")]
    assert [r.body for r in results] == [b"end", b"end"]
    assert all("ts_stream_next" not in r.headers for r in results)


def test_a_part_sent_after_the_call_has_no_request_to_go_to(tmp_path: Path) -> None:
    code = """
from ts.handler_utils.utils import send_intermediate_predict_response
kept = {}

def handle(data, context):
    if data is None:
        return None
    kept["ctx"] = context
    return ["done"] * len(data)
"""
    host = host_for(tmp_path, code)
    got: list[str] = []
    host.run_batch([req(0)], lambda rid, part: got.append(rid))
    ctx = host._handle.__globals__["kept"]["ctx"]
    from ts.handler_utils.utils import send_intermediate_predict_response

    send_intermediate_predict_response(["late"], ctx.request_ids, "", 200, ctx)
    assert got == []


def test_an_out_of_memory_batch_is_split_on_the_async_path_too(tmp_path: Path) -> None:
    code = """
async def handle(data, context):
    if data is None:
        return None
    if len(data) > 1:
        raise MemoryError("out of memory")
    return [row["body"] for row in data]
"""
    host = host_for(tmp_path, code)
    splits: list[int] = []
    host.on_oom = lambda: splits.append(1)
    results = asyncio.run(host.run_batch_async([req(0), req(1), req(2)]))
    assert [json.loads(r.body) for r in results] == [0, 1, 2]
    assert splits
