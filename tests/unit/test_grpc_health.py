"""grpc.health.v1 on the real gRPC listeners (port 0, a fake DataPlane serving "digits").

With tokens, a probe without one still reads the overall status (service ""), but per-model
statuses name the models, so Check/Watch of a named service and List need the token. List is
answered (no ERROR traceback per call), and Watch streams are capped per health servicer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mariner.server.common.health import MAX_HEALTH_WATCHERS
from mariner.server.common.security import GrpcTokenAuth, Tokens
from mariner.server.frontend.protocols.grpc_listener import GrpcServers, build_grpc_servers
from tests.unit.fakes import FakePlane

pytestmark = pytest.mark.unit

TOKEN = "health-test-token"
WITH_TOKEN = (("authorization", f"Bearer {TOKEN}"),)
SERVING = health_pb2.HealthCheckResponse.SERVING


@asynccontextmanager
async def health_stub(
    *, open_health: bool = True
) -> AsyncIterator[tuple[health_pb2_grpc.HealthStub, GrpcServers]]:
    servers = build_grpc_servers(
        FakePlane(),
        inference_address="127.0.0.1:0",
        max_message_bytes=1 << 20,
        health_poll_s=None,
        inference_interceptors=[GrpcTokenAuth(Tokens((TOKEN,)), open_health=open_health)],
    )
    await servers.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.inference_port}") as channel:
            yield health_pb2_grpc.HealthStub(channel), servers
    finally:
        await servers.stop(grace=0)


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_overall_health_is_open_per_model_health_needs_the_token() -> None:
    async def scenario() -> None:
        async with health_stub() as (stub, _):
            overall = await stub.Check(health_pb2.HealthCheckRequest(service=""))
            assert overall.status == SERVING
            for service in ("digits", "no-such-model"):
                # Unknown and known names look the same without a token: nothing to enumerate.
                check = stub.Check(health_pb2.HealthCheckRequest(service=service))
                assert await _code(check) == grpc.StatusCode.UNAUTHENTICATED, service
                bad = stub.Check(
                    health_pb2.HealthCheckRequest(service=service), metadata=(("authorization", "Bearer no"),)
                )
                assert await _code(bad) == grpc.StatusCode.UNAUTHENTICATED, service
            ok = await stub.Check(health_pb2.HealthCheckRequest(service="digits"), metadata=WITH_TOKEN)
            assert ok.status == SERVING
            unknown = stub.Check(health_pb2.HealthCheckRequest(service="no-such-model"), metadata=WITH_TOKEN)
            assert await _code(unknown) == grpc.StatusCode.NOT_FOUND

            watch = stub.Watch(health_pb2.HealthCheckRequest(service="digits"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await watch.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            open_watch = stub.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await open_watch.read()).status == SERVING
            open_watch.cancel()
            model_watch = stub.Watch(health_pb2.HealthCheckRequest(service="digits"), metadata=WITH_TOKEN)
            assert (await model_watch.read()).status == SERVING
            model_watch.cancel()

    asyncio.run(scenario())


def test_closed_health_needs_the_token_even_for_the_overall_status() -> None:
    async def scenario() -> None:
        async with health_stub(open_health=False) as (stub, _):
            assert await _code(stub.Check(health_pb2.HealthCheckRequest())) == grpc.StatusCode.UNAUTHENTICATED
            ok = await stub.Check(health_pb2.HealthCheckRequest(), metadata=WITH_TOKEN)
            assert ok.status == SERVING

    asyncio.run(scenario())


def test_list_is_answered_behind_the_token_without_an_error_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        async with health_stub() as (stub, _):
            assert await _code(stub.List(health_pb2.HealthListRequest())) == grpc.StatusCode.UNAUTHENTICATED
            listed = await stub.List(health_pb2.HealthListRequest(), metadata=WITH_TOKEN)
            assert {name: s.status for name, s in listed.statuses.items()} == {
                "": SERVING,
                "digits": SERVING,
                "org.pytorch.serve.grpc.inference.InferenceAPIsService": SERVING,
                "inference.GRPCInferenceService": SERVING,
            }

    with caplog.at_level(logging.WARNING):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_watch_streams_are_capped_and_a_freed_slot_is_reused() -> None:
    async def scenario() -> None:
        async with health_stub() as (stub, servers):
            request = health_pb2.HealthCheckRequest(service="")
            watches = [stub.Watch(request) for _ in range(MAX_HEALTH_WATCHERS)]
            for watch in watches:  # each stream is open once its first status arrives
                assert (await watch.read()).status == SERVING
            assert servers.health.watchers == MAX_HEALTH_WATCHERS
            one_too_many = stub.Watch(request)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await one_too_many.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Watch" in (info.value.details() or "")
            watches.pop().cancel()
            while servers.health.watchers == MAX_HEALTH_WATCHERS:  # the server sees the cancel
                await asyncio.sleep(0.01)
            again = stub.Watch(request)
            assert (await again.read()).status == SERVING
            for watch in (*watches, again):
                watch.cancel()

    asyncio.run(scenario())
