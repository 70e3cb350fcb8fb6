"""Admission across the drain, on a real grpc.aio server and a real DataPlane (a fake endpoint):
a call whose metadata arrived before the drain is served even though its message arrives after
it, and counted; a call that starts while draining is refused UNAVAILABLE without its message
being needed. The client holds its message back until the test says so: event-gated, no sleeps.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest

from mariner.server import protogen
from mariner.server.contracts.types import InferRequest, InferResult, ModelInfo, ModelState
from mariner.server.frontend.dataplane import DataPlane
from mariner.server.frontend.protocols.grpc_drain_gate import GrpcDrainGate
from mariner.server.frontend.protocols.grpc_listener import build_grpc_servers
from tests.unit.fakes import DIGITS, QuietMetrics, make_info

PREDICTIONS = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"


@pytest.fixture(scope="module")
def inference_pb() -> object:
    protogen.generate()
    return importlib.import_module("mariner.server._proto.torchserve.inference_pb2")


@dataclass
class FakeEndpoint:
    """Just what DataPlane.enqueue and resolve use of a model version."""

    name: str = "digits"
    version: str = "1"
    state: ModelState = ModelState.READY
    loaded_at_startup: bool = True

    def info(self, is_default: bool) -> ModelInfo:
        return make_info(self.name, self.version, DIGITS)

    def enqueue(self, req: InferRequest, caller: object) -> asyncio.Future[InferResult]:
        answered: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        answered.set_result(InferResult(body=b'{"label": 3}', model_version=self.version))
        return answered


def test_a_call_admitted_before_the_drain_is_served_though_its_message_comes_after(inference_pb) -> None:
    async def main() -> SimpleNamespace:
        dp = DataPlane(QuietMetrics())
        dp.install_endpoint(FakeEndpoint())  # type: ignore[arg-type]
        admitted = asyncio.Event()
        admit = dp.admit

        def admit_and_tell() -> bool:
            ok = admit()
            admitted.set()
            return ok

        dp.admit = admit_and_tell  # type: ignore[method-assign]
        servers = build_grpc_servers(
            dp,  # type: ignore[arg-type]
            inference_address="127.0.0.1:0",
            max_message_bytes=1 << 20,
            health_poll_s=None,
            inference_interceptors=[GrpcDrainGate(dp)],
        )
        await servers.start()
        message = inference_pb.PredictionsRequest(
            model_name="digits", input={"data": b"[0]"}
        ).SerializeToString()
        release = asyncio.Event()

        async def held_back() -> AsyncIterator[bytes]:
            await release.wait()
            yield message

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.inference_port}") as channel:
                # The wire does not tell a unary request from a stream of one: the call's metadata
                # goes out now, its message once released.
                call = channel.stream_unary(PREDICTIONS, request_serializer=None, response_deserializer=None)
                before = call(held_back(), timeout=30)
                await admitted.wait()
                dp.start_draining()
                release.set()
                reply = inference_pb.PredictionResponse.FromString(await before)
                admitted.clear()
                never = asyncio.Event()

                async def never_sent() -> AsyncIterator[bytes]:
                    await never.wait()
                    yield message

                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(never_sent(), timeout=30)
        finally:
            await servers.stop(grace=0)
        return SimpleNamespace(reply=reply, refused=refused.value, dp=dp)

    out = asyncio.run(main())
    assert out.reply.prediction == b'{"label": 3}'
    assert out.refused.code() is grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in out.refused.details()
    assert (out.dp.accepted, out.dp.answered, out.dp.answered_ok) == (1, 1, 1)
