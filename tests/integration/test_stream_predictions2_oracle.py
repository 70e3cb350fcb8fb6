"""Stock TorchServe 0.12 is the oracle for StreamPredictions2: the same requests on one stream,
answered by both with the same prediction bytes and the same in-stream statuses.

Both serve a copy of the digits archive with `sequenceBatching: true`: stock TorchServe fails a
StreamPredictions2 call with UNKNOWN for a model without it (its `getJobGroup` meets no job
groups). The stream is driven in lock-step (write one request, read its answer): stock
TorchServe ends the stream as soon as the client half-closes, dropping answers in flight, and
lock-step keeps every request in a batch of one on both servers, so the bytes compare exactly.

Differences, deliberate and documented: Mariner echoes `sequence_id` (TorchServe leaves it
unset), and after refusing a request with no model name or an unknown model TorchServe's stream
fails with UNKNOWN (the same `getJobGroup`), while Mariner's goes on: those two are compared
on streams of their own, by their in-stream answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mariner.loadtest.servers import StockTorchServe, leftover_processes
from tests.integration.test_stream_predictions2 import METHOD, msg, request, status_of
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

DIGITS = "digits_torchscript"
CAP_S = 120.0


SEQUENCE_CONFIG = (
    b"sequenceBatching: true\nsequenceMaxIdleMSec: 10000\nmaxSequenceJobQueueSize: 10\nmaxNumSequence: 8\n"
)


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits with sequence batching on (the archive's model-config.yaml, four keys appended)."""
    out = tmp_path_factory.mktemp("seq-store")
    with (
        zipfile.ZipFile(model_store / f"{DIGITS}.mar") as src,
        zipfile.ZipFile(out / f"{DIGITS}.mar", "w") as dst,
    ):
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "model-config.yaml":
                data = data.rstrip(b"\n") + b"\n" + SEQUENCE_CONFIG
            dst.writestr(item, data)
    return out


@pytest.fixture(scope="module")
def torchserve(store: Path) -> Iterator[StockTorchServe]:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    with StockTorchServe(store, [DIGITS]) as ts:
        workdir = ts.workdir
        assert workdir is not None
        yield ts
    assert leftover_processes(workdir) == [], "stock TorchServe left processes running after stop()"


@pytest.fixture(scope="module")
def mariner(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(store, f"{DIGITS}.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


def lockstep(target: str, reqs: list[Any]) -> tuple[list[Any], grpc.StatusCode]:
    """Each request's answer, then the stream's status after the half-close."""
    response_cls = msg("org.pytorch.serve.grpc.inference.PredictionResponse")

    async def main() -> tuple[list[Any], grpc.StatusCode]:
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream(
                METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=response_cls.FromString,
            )(timeout=CAP_S)
            answers = []
            for r in reqs:
                await call.write(r)
                answers.append(await call.read())
            await call.done_writing()
            with contextlib.suppress(grpc.aio.AioRpcError):
                assert await call.read() == grpc.aio.EOF
            return answers, await call.code()

    return asyncio.run(main())


def summary(answer: Any) -> tuple[bytes, int, str, str]:
    return bytes(answer.prediction), *status_of(answer)


def test_the_same_stream_gets_the_same_answers_as_on_stock_torchserve(
    torchserve: StockTorchServe, mariner: MarinerServe
) -> None:
    rows = np.random.default_rng(7).integers(0, 17, size=(3, 64)).astype(float).tolist()
    reqs = [
        request(DIGITS, rows[0], "seq-1"),
        request(DIGITS, rows[1], "seq-1"),
        request(DIGITS, rows[2], None),  # no sequence id: refused in-stream, the stream goes on
        request(DIGITS, rows[2], "seq-2"),
    ]
    theirs, their_code = lockstep(torchserve.grpc_target, reqs)
    ours, our_code = lockstep(mariner.grpc_target, reqs)
    assert their_code == our_code == grpc.StatusCode.OK
    assert [summary(a) for a in ours] == [summary(a) for a in theirs]
    for i in (0, 1, 3):
        assert "label" in json.loads(ours[i].prediction)
    assert summary(theirs[2])[1:] == (13, "Parameter sequenceId is required.", "BadRequestException.()")
    assert all(not a.HasField("sequence_id") for a in theirs)
    assert [a.sequence_id for a in ours] == ["seq-1", "seq-1", "", "seq-2"]


@pytest.mark.parametrize(
    ("model", "message", "reason"),
    [
        ("", "Parameter model_name is required.", "BadRequestException.()"),
        (
            "no_such_model",
            "Model not found: no_such_model",
            "org.pytorch.serve.archive.model.ModelNotFoundException",
        ),
    ],
)
def test_a_refused_model_is_answered_as_stock_torchserve_does(
    torchserve: StockTorchServe, mariner: MarinerServe, model: str, message: str, reason: str
) -> None:
    req = request(model, [0.0] * 64, "seq-x")
    (theirs,), _ = lockstep(torchserve.grpc_target, [req])  # its stream then fails: see above
    ours, our_code = lockstep(mariner.grpc_target, [req, request(DIGITS, [0.0] * 64, "seq-x")])
    assert summary(ours[0]) == summary(theirs) == (b"", 13, message, reason)
    assert "label" in json.loads(ours[1].prediction)  # Mariner's stream goes on
    assert our_code == grpc.StatusCode.OK
