"""A worker runs its handler on the thread of its event loop, and the handler cannot tell.

TorchServe calls a handler from a plain thread with no event loop running, and handlers rely on
that (one that calls `asyncio.run` itself). The thread count torch was given applies on the
thread that calls the handler (OpenMP keeps it per thread). Frames that arrive while a batch
runs are read before the next one, so batches sent meanwhile from several frontends are merged
into one handler call, and each answer goes back to the connection that asked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mariner.server.contracts.types import InferRequest, WireProtocol
from mariner.server.contracts.worker_api import WorkerSpec
from mariner.server.frontend.worker_client import WorkerConnection
from mariner.server.supervisor import zygote_client as zygote
from mariner.server.supervisor.worker_process import WorkerProcess

pytestmark = pytest.mark.integration

HANDLER = """
import asyncio
import json
import threading
import time

import torch


async def _answer(n):
    await asyncio.sleep(0)
    return 40 + n


def handle(data, context):
    if data is None:
        return None
    bodies = [row["body"] for row in data]
    if b"sleep" in bodies:
        time.sleep(0.6)
    return [
        json.dumps({
            "body": body.decode(),
            "n": len(data),
            "from_asyncio_run": asyncio.run(_answer(len(data))),
            "torch_threads": torch.get_num_threads(),
            "main_thread": threading.current_thread() is threading.main_thread(),
        })
        for body in bodies
    ]
"""


@pytest.fixture(autouse=True)
def _close_zygotes() -> Iterator[None]:
    yield
    zygote.shutdown()


def _spec(tmp_path: Path, batch_size: int) -> WorkerSpec:
    d = tmp_path / "model"
    d.mkdir()
    (d / "probe.py").write_text(HANDLER)
    return WorkerSpec(
        model="probe", version="1.0", instance=0, generation=0, model_dir=str(d),
        archive_file=str(tmp_path / "probe.mar"), sha256="0" * 64,
        manifest={"model": {"modelName": "probe", "handler": "probe.py", "modelVersion": "1.0"}},
        model_config={}, batch_size=batch_size, gpu_id=None, torch_threads=1,
        socket_path=str(tmp_path / "w.sock"),
    )  # fmt: skip


def _req(body: str) -> InferRequest:
    return InferRequest("probe", "1.0", {"body": body.encode()}, WireProtocol.TS_HTTP, body)


async def _with_worker(tmp_path: Path, batch_size: int, scenario: Any) -> Any:
    process = WorkerProcess(_spec(tmp_path, batch_size))
    endpoint = await process.start(120.0)
    conns = [WorkerConnection(endpoint, batch_size=batch_size) for _ in range(2)]
    try:
        for c in conns:
            await c.start()
        return await scenario(conns)
    finally:
        for c in conns:
            c.close()
        await process.stop(10.0)


def _answers(results: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in results]


def test_the_handler_runs_as_torchserve_runs_it_with_no_loop_and_the_thread_count_it_was_given(
    tmp_path: Path,
) -> None:
    async def scenario(conns: list[WorkerConnection]) -> list[Any]:
        return await conns[0].run([_req("a"), _req("b")])

    got = _answers(asyncio.run(_with_worker(tmp_path, 4, scenario)))
    assert [a["body"] for a in got] == ["a", "b"]
    # asyncio.run inside handle() works: no loop is running on the handler's thread for it.
    assert [a["from_asyncio_run"] for a in got] == [42, 42]
    # torch_threads=1 holds on the thread that calls the handler (this machine has 2 cores).
    assert {a["torch_threads"] for a in got} == {1}
    assert {a["main_thread"] for a in got} == {True}


def test_batches_sent_while_the_handler_runs_are_merged_into_the_next_call(tmp_path: Path) -> None:
    async def scenario(conns: list[WorkerConnection]) -> tuple[list[Any], ...]:
        first = asyncio.ensure_future(conns[0].run([_req("sleep")]))
        await asyncio.sleep(0.3)  # the worker is inside its 0.6 s handler call now
        t0 = time.monotonic()
        rest = await asyncio.gather(
            conns[0].run([_req("x1")]), conns[1].run([_req("y1"), _req("y2")]), conns[0].run([_req("x2")])
        )
        assert time.monotonic() - t0 < 5.0
        return (await first, *rest)

    sleep, x1, y, x2 = asyncio.run(_with_worker(tmp_path, 4, scenario))
    assert [a["body"] for a in _answers(sleep)] == ["sleep"]
    # The three batches (4 requests, from two connections) that waited ran as one handler call,
    # and each connection got back its own answers.
    assert [(a["body"], a["n"]) for a in _answers(x1)] == [("x1", 4)]
    assert [(a["body"], a["n"]) for a in _answers(y)] == [("y1", 4), ("y2", 4)]
    assert [(a["body"], a["n"]) for a in _answers(x2)] == [("x2", 4)]
