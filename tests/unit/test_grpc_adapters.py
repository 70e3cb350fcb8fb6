"""The TorchServe gRPC adapters against real grpc.aio servers on 127.0.0.1 port 0.

A fake DataPlane stands in for models (its behaviour is chosen by model name), and the
generated stubs are the client, so these tests exercise the real wire path: serialization,
status mapping, message limits, health and reflection. pytest-asyncio is not used: each test
runs its coroutine with asyncio.run.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import grpc
import pytest

from mariner.server import protogen
from mariner.server.common.metrics import Metrics
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import (
    InferRequest,
    InferResult,
    ModelInfo,
    WireProtocol,
    WorkerInfo,
)
from tests.unit.fakes import make_info

pytestmark = pytest.mark.unit

T = TypeVar("T")
MAX_MESSAGE = 1 << 20  # small, so the oversize test stays cheap


@pytest.fixture(scope="module", autouse=True)
def pb() -> SimpleNamespace:
    """Generate the stubs if needed, then import everything that depends on them."""
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    return SimpleNamespace(
        inference=importlib.import_module("mariner.server._proto.torchserve.inference_pb2"),
        inference_grpc=importlib.import_module("mariner.server._proto.torchserve.inference_pb2_grpc"),
        management=importlib.import_module("mariner.server._proto.torchserve.management_pb2"),
        management_grpc=importlib.import_module("mariner.server._proto.torchserve.management_pb2_grpc"),
        grpc_server=importlib.import_module("mariner.server.frontend.protocols.grpc_listener"),
        health=health_pb2,
        health_grpc=health_pb2_grpc,
        reflection=reflection_pb2,
        reflection_grpc=reflection_pb2_grpc,
        empty=importlib.import_module("google.protobuf.empty_pb2"),
    )


def _info(name: str, version: str, *, default: bool = True, device: str = "cpu") -> ModelInfo:
    return make_info(
        name,
        version,
        default=default,
        archive=f"/srv/store/{name}.mar",
        handler="handlers/digits_handler.py",
        max_batch_delay_ms=5.0,
        queue_size=128,
        max_workers=2,
        workers=(WorkerInfo(id="w0", device=device, status="READY", batches=3),),
        load_seconds=1.5,
    )


@dataclass
class FakePlane:
    """The DataPlane surface the gRPC adapters use. Model names choose what `infer` does."""

    metrics: Metrics = field(default_factory=Metrics)
    management_enabled: bool = False
    draining: bool = False
    infos: list[ModelInfo] = field(
        default_factory=lambda: [
            _info("echo", "1.0"),
            _info("echo", "2.0", default=False),
            _info("bad", "1.0"),
            _info("boom", "1.0"),
            _info("reject", "1.0"),
        ]
    )
    ready: set[str] = field(default_factory=set)
    seen: list[InferRequest] = field(default_factory=list)
    registered: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    async def infer(self, req: InferRequest) -> InferResult:
        self.seen.append(req)
        self._resolve(req.model, req.version)
        if req.model == "bad":
            raise ServingError(Code.INVALID_ARGUMENT, "input 'data' must be a 28x28 PNG image")
        if req.model == "reject":  # the handler called set_response_status(400) for this request
            return InferResult(body=b'{"error": "image must be 28x28"}', status=400, model_version="1.0")
        if req.model == "boom":
            raise RuntimeError("secret /home/user/model.py line 42 traceback")
        return InferResult(body=b"echo:" + req.data.get("data", b""), model_version=req.version or "1.0")

    def _resolve(self, model: str, version: str | None) -> ModelInfo:
        versions = [i for i in self.infos if i.name == model]
        if not versions:
            raise ServingError(Code.NOT_FOUND, f"model {model!r} is not served here")
        for info in versions:
            if (version is None and info.is_default) or info.version == version:
                return info
        raise ServingError(Code.NOT_FOUND, f"model {model!r} has no version {version!r}")

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            info = self._resolve(model, version)
        except ServingError:
            return "unknown", "unknown"
        return info.name, info.version

    def models(self) -> list[ModelInfo]:
        return list(self.infos)

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        if version is None:
            self._resolve(model, None)
            return [i for i in self.infos if i.name == model]
        return [self._resolve(model, version)]

    def is_ready(self) -> bool:
        return not self.draining and {i.name for i in self.infos} <= self.ready

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return not self.draining and model in self.ready

    def _require_management(self) -> None:
        if not self.management_enabled:
            raise ServingError(Code.PERMISSION_DENIED, "model management is disabled on this server")

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]:
        self._require_management()
        self.registered.append((archive_name, overrides))
        info = _info(overrides.get("name") or Path(archive_name).stem, "1.0")
        self.infos.append(info)
        return [info]

    async def unregister(self, model: str, version: str | None = None) -> None:
        self._require_management()
        info = self._resolve(model, version)
        self.infos.remove(info)

    async def set_default(self, model: str, version: str) -> None:  # not gated, as in TorchServe
        self._resolve(model, version)

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        raise ServingError(Code.UNIMPLEMENTED, "scaling is not supported yet")


@dataclass
class Harness:
    plane: FakePlane
    servers: Any
    inference: grpc.aio.Channel
    management: grpc.aio.Channel
    pb: SimpleNamespace

    @property
    def infer_stub(self) -> Any:
        return self.pb.inference_grpc.InferenceAPIsServiceStub(self.inference)

    @property
    def mgmt_stub(self) -> Any:
        return self.pb.management_grpc.ManagementAPIsServiceStub(self.management)

    def health_stub(self, channel: grpc.aio.Channel) -> Any:
        return self.pb.health_grpc.HealthStub(channel)

    def predict(self, model: str, data: bytes = b"", version: str = "") -> Any:
        request = self.pb.inference.PredictionsRequest(
            model_name=model, model_version=version, input={"data": data}
        )
        return self.infer_stub.Predictions(request)


@asynccontextmanager
async def serving(pb: SimpleNamespace, plane: FakePlane) -> AsyncIterator[Harness]:
    servers = pb.grpc_server.build_grpc_servers(
        plane,
        inference_address="127.0.0.1:0",
        max_message_bytes=MAX_MESSAGE,
        health_poll_s=None,  # tests drive refresh_health themselves
    )
    # The management server as the supervisor builds it, sharing the inference server's health.
    from mariner.server.common.grpc_server import bind
    from mariner.server.supervisor.management.grpc import build_management_server

    management_server = build_management_server(
        plane, max_message_bytes=MAX_MESSAGE, health=servers.health, on_change=servers.refresh_health
    )
    management_port = bind(management_server, "127.0.0.1:0", "management", None)
    await servers.start()
    await management_server.start()
    options = [
        ("grpc.max_send_message_length", 8 * MAX_MESSAGE),
        ("grpc.max_receive_message_length", 8 * MAX_MESSAGE),
    ]
    inference = grpc.aio.insecure_channel(f"127.0.0.1:{servers.inference_port}", options=options)
    management = grpc.aio.insecure_channel(f"127.0.0.1:{management_port}", options=options)
    try:
        yield Harness(plane, servers, inference, management, pb)
    finally:
        await inference.close()
        await management.close()
        await servers.stop(grace=0)
        await management_server.stop(0)


def run_with(pb: SimpleNamespace, plane: FakePlane, body: Callable[[Harness], Awaitable[T]]) -> T:
    async def main() -> T:
        async with serving(pb, plane) as h:
            return await body(h)

    return asyncio.run(main())


async def rpc_error(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def count(plane: FakePlane, model: str, version: str, code: str) -> float:
    labels = {"model": model, "version": version, "protocol": WireProtocol.TS_GRPC.value, "code": code}
    return plane.metrics.registry.get_sample_value("mariner_requests_total", labels) or 0.0


# -- inference ------------------------------------------------------------------------------


def test_ping_reports_torchserve_health_json(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> None:
        before = await h.infer_stub.Ping(pb.empty.Empty())
        assert json.loads(before.health) == {"status": "Unhealthy"}
        plane.ready = {"echo", "bad", "boom", "reject"}
        after = await h.infer_stub.Ping(pb.empty.Empty())
        assert after.health == '{\n  "status": "Healthy"\n}'

    run_with(pb, plane, body)


def test_predictions_round_trips_bytes_and_builds_the_request(pb: SimpleNamespace) -> None:
    plane = FakePlane()
    payload = bytes(range(256)) * 4

    async def body(h: Harness) -> None:
        reply = await h.infer_stub.Predictions(
            pb.inference.PredictionsRequest(model_name="echo", input={"data": payload}),
            metadata=(("x-trace", "abc"), ("blob-bin", b"\x00")),
            timeout=30,
        )
        assert reply.prediction == b"echo:" + payload
        versioned = await h.predict("echo", b"v2", version="2.0")
        assert versioned.prediction == b"echo:v2"

    run_with(pb, plane, body)
    first, second = plane.seen
    assert first.model == "echo"
    assert first.version is None
    assert first.protocol is WireProtocol.TS_GRPC
    assert dict(first.data) == {"data": payload}
    assert first.headers["x-trace"] == "abc"
    assert "blob-bin" not in first.headers
    assert len(first.request_id) == 32
    assert first.request_id != second.request_id
    assert first.deadline is not None
    assert time.monotonic() < first.deadline <= time.monotonic() + 31  # grpc rounds timeouts up
    assert second.version == "2.0"
    assert second.deadline is None
    assert count(plane, "echo", "1.0", "200") == 1
    assert count(plane, "echo", "2.0", "200") == 1


def test_serving_error_maps_to_its_status_and_message(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> None:
        bad = await rpc_error(h.predict("bad", b"x"))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.details() == "input 'data' must be a 28x28 PNG image"
        missing = await rpc_error(h.predict("no-such-model-" + "x" * 40))
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        unnamed = await rpc_error(h.predict(""))
        assert unnamed.code() == grpc.StatusCode.INVALID_ARGUMENT

    run_with(pb, plane, body)
    assert count(plane, "bad", "1.0", "400") == 1
    # A model that is not loaded never becomes a label value.
    assert count(plane, "unknown", "unknown", "404") == 1
    assert count(plane, "unknown", "unknown", "400") == 1
    samples = [s for m in plane.metrics.registry.collect() for s in m.samples]
    assert not any("no-such-model" in str(s.labels) for s in samples)


def test_handler_error_status_becomes_the_grpc_status(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> grpc.aio.AioRpcError:
        return await rpc_error(h.predict("reject", b"x"))

    err = run_with(pb, plane, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == '{"error": "image must be 28x28"}'
    assert count(plane, "reject", "1.0", "400") == 1


def test_unexpected_exception_is_internal_and_sanitized(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> grpc.aio.AioRpcError:
        return await rpc_error(h.predict("boom"))

    err = run_with(pb, plane, body)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in err.details()
    assert "traceback" not in err.details()
    assert "internal error" in err.details()
    assert count(plane, "boom", "1.0", "500") == 1


def test_stream_predictions_sends_one_message(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> list[Any]:
        call = h.infer_stub.StreamPredictions(
            pb.inference.PredictionsRequest(model_name="echo", input={"data": b"s"})
        )
        return [msg async for msg in call]

    messages = run_with(pb, plane, body)
    assert [m.prediction for m in messages] == [b"echo:s"]


def test_stream_predictions_error_aborts_the_stream(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> grpc.aio.AioRpcError:
        call = h.infer_stub.StreamPredictions(pb.inference.PredictionsRequest(model_name="bad"))

        async def drain() -> None:
            async for _ in call:
                pass

        return await rpc_error(drain())

    assert run_with(pb, plane, body).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stream_predictions2_answers_every_request_in_stream(pb: SimpleNamespace) -> None:
    """Good requests are answered with their prediction and sequence id; a request without a
    sequence id, an unknown model and a handler's own error are answered in-stream and the
    stream goes on to the next request."""
    plane = FakePlane()

    async def body(h: Harness) -> list[Any]:
        def req(model: str, seq: str | None, data: bytes) -> Any:
            r = pb.inference.PredictionsRequest(model_name=model, input={"data": data})
            if seq is not None:
                r.sequence_id = seq
            return r

        async def requests() -> AsyncIterator[Any]:
            yield req("echo", "s1", b"a")
            yield req("echo", None, b"b")
            yield req("nope", "s2", b"c")
            yield req("reject", "s3", b"d")
            yield req("echo", "s1", b"e")

        return [m async for m in h.infer_stub.StreamPredictions2(requests())]

    answers = run_with(pb, plane, body)
    by_seq: dict[str, list[Any]] = {}
    for a in answers:
        by_seq.setdefault(a.sequence_id, []).append(a)
    assert len(answers) == 5
    assert [a.prediction for a in by_seq["s1"]] == [b"echo:a", b"echo:e"]  # one sequence: in order
    assert all(not a.HasField("status") for a in by_seq["s1"])
    (missing,) = by_seq[""]
    assert (missing.status.code, missing.status.message) == (13, "Parameter sequenceId is required.")
    (unknown,) = by_seq["s2"]
    assert unknown.status.code == grpc.StatusCode.NOT_FOUND.value[0]  # ours: no TorchServe answer in the fake
    (rejected,) = by_seq["s3"]
    assert rejected.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "image must be 28x28" in rejected.status.message
    headers = [r.headers for r in plane.seen if r.model == "echo"]
    assert [hd["ts_request_sequence_id"] for hd in headers] == ["s1", "s1"]
    assert all(hd["ts_request_sequence_end"] == "true" for hd in headers)


def test_oversized_request_is_resource_exhausted(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> grpc.aio.AioRpcError:
        return await rpc_error(h.predict("echo", b"x" * (MAX_MESSAGE + 1024)))

    assert run_with(pb, plane, body).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert plane.seen == []


# -- health and reflection ------------------------------------------------------------------


def test_health_follows_model_readiness_on_both_servers(pb: SimpleNamespace) -> None:
    plane = FakePlane()
    serving_, not_serving = pb.health.HealthCheckResponse.SERVING, pb.health.HealthCheckResponse.NOT_SERVING

    async def status(h: Harness, service: str, channel: grpc.aio.Channel | None = None) -> int:
        reply = await h.health_stub(channel or h.inference).Check(
            pb.health.HealthCheckRequest(service=service)
        )
        return reply.status

    async def body(h: Harness) -> None:
        assert await status(h, "") == not_serving
        assert await status(h, "echo") == not_serving
        plane.ready = {"echo"}
        await h.servers.refresh_health()
        assert await status(h, "echo") == serving_
        assert await status(h, "echo", h.management) == serving_
        assert await status(h, "bad") == not_serving
        assert await status(h, "") == not_serving
        plane.ready = {"echo", "bad", "boom", "reject"}
        await h.servers.refresh_health()
        assert await status(h, "") == serving_
        assert await status(h, "org.pytorch.serve.grpc.inference.InferenceAPIsService") == serving_
        unknown = await rpc_error(status(h, "never-loaded"))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND
        await h.servers.set_not_serving()
        await h.servers.refresh_health()  # ignored once shutting down
        assert await status(h, "") == not_serving
        assert await status(h, "echo", h.management) == not_serving

    run_with(pb, plane, body)


def test_reflection_lists_the_services(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def list_services(channel: grpc.aio.Channel) -> set[str]:
        stub = pb.reflection_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([pb.reflection.ServerReflectionRequest(list_services="")]))
        replies = [r async for r in call]
        return {s.name for s in replies[0].list_services_response.service}

    async def body(h: Harness) -> tuple[set[str], set[str]]:
        return await list_services(h.inference), await list_services(h.management)

    inference, management = run_with(pb, plane, body)
    assert "org.pytorch.serve.grpc.inference.InferenceAPIsService" in inference
    assert "grpc.health.v1.Health" in inference
    assert "org.pytorch.serve.grpc.management.ManagementAPIsService" in management


def test_port_in_use_fails_instead_of_sharing(pb: SimpleNamespace) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        async def main() -> None:
            plane = FakePlane()
            pb.grpc_server.build_grpc_servers(
                plane,
                inference_address=f"127.0.0.1:{port}",
                max_message_bytes=MAX_MESSAGE,
            )

        with pytest.raises(RuntimeError, match="inference"):
            asyncio.run(main())


# -- management -----------------------------------------------------------------------------


def test_list_models_matches_torchserve_json(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> tuple[Any, Any]:
        everything = await h.mgmt_stub.ListModels(pb.management.ListModelsRequest())
        page = await h.mgmt_stub.ListModels(pb.management.ListModelsRequest(limit=2))
        return json.loads(everything.msg), json.loads(page.msg)

    everything, page = run_with(pb, plane, body)
    assert everything == {
        "models": [
            {"modelName": "bad", "modelUrl": "bad.mar"},
            {"modelName": "boom", "modelUrl": "boom.mar"},
            {"modelName": "echo", "modelUrl": "echo.mar"},
            {"modelName": "reject", "modelUrl": "reject.mar"},
        ]
    }
    assert page == {"nextPageToken": "2", "models": everything["models"][:2]}


def test_describe_model_matches_torchserve_shape(pb: SimpleNamespace) -> None:
    plane = FakePlane()

    async def body(h: Harness) -> tuple[Any, Any, Any, grpc.aio.AioRpcError]:
        describe = h.mgmt_stub.DescribeModel
        default = await describe(pb.management.DescribeModelRequest(model_name="echo"))
        every = await describe(pb.management.DescribeModelRequest(model_name="echo", model_version="all"))
        one = await describe(pb.management.DescribeModelRequest(model_name="echo", model_version="2.0"))
        missing = await rpc_error(describe(pb.management.DescribeModelRequest(model_name="nope")))
        return json.loads(default.msg), json.loads(every.msg), json.loads(one.msg), missing

    default, every, one, missing = run_with(pb, plane, body)
    assert [d["modelVersion"] for d in default] == ["1.0"]
    assert [d["modelVersion"] for d in every] == ["1.0", "2.0"]
    assert [d["modelVersion"] for d in one] == ["2.0"]
    entry = default[0]
    assert list(entry)[:10] == [
        "modelName",
        "modelVersion",
        "modelUrl",
        "runtime",
        "minWorkers",
        "maxWorkers",
        "batchSize",
        "maxBatchDelay",
        "responseTimeout",
        "startupTimeout",
    ]
    assert list(entry)[14] == "deviceType"  # after startupTimeout .. parallelLevel, as stock TorchServe
    assert entry["modelName"] == "echo"
    assert entry["modelUrl"] == "echo.mar"  # no server paths
    assert (entry["batchSize"], entry["maxBatchDelay"], entry["responseTimeout"]) == (8, 5, 30)
    assert (entry["minWorkers"], entry["maxWorkers"], entry["deviceType"]) == (1, 2, "cpu")
    assert entry["loadedAtStartup"] is True
    assert entry["workers"][0]["id"] == "w0"
    assert entry["workers"][0]["status"] == "READY"
    assert "memoryUsage" not in entry["workers"][0]  # the fake's WorkerInfo does not know it
    assert entry["jobQueueStatus"] == {"remainingCapacity": 128, "pendingRequests": 0}
    assert missing.code() == grpc.StatusCode.NOT_FOUND


def test_changing_calls_are_refused_when_management_is_disabled(pb: SimpleNamespace) -> None:
    plane = FakePlane(management_enabled=False)

    async def body(h: Harness) -> tuple[list[grpc.aio.AioRpcError], str]:
        m, stub = pb.management, h.mgmt_stub
        refused = [
            await rpc_error(
                stub.RegisterModel(m.RegisterModelRequest(url="https://evil.example/x.mar", handler="x"))
            ),
            await rpc_error(stub.UnregisterModel(m.UnregisterModelRequest(model_name="echo"))),
        ]
        # Scale and set-default load no code: TorchServe allows them with its model API off.
        allowed = await stub.SetDefault(m.SetDefaultRequest(model_name="echo", model_version="2.0"))
        return refused, allowed.msg

    errors, allowed = run_with(pb, plane, body)
    assert [e.code() for e in errors] == [grpc.StatusCode.PERMISSION_DENIED] * 2
    assert allowed.startswith("Default version successfully updated")
    assert len(plane.infos) == 5


def test_register_and_unregister_when_enabled_update_health(pb: SimpleNamespace) -> None:
    plane = FakePlane(management_enabled=True)

    async def body(h: Harness) -> tuple[str, str, grpc.aio.AioRpcError, int]:
        m, stub = pb.management, h.mgmt_stub
        registered = await stub.RegisterModel(
            m.RegisterModelRequest(url="extra.mar", batch_size=4, initial_workers=1)
        )
        plane.ready.add("extra")
        gone = await stub.UnregisterModel(m.UnregisterModelRequest(model_name="echo", model_version="2.0"))
        # TorchServe's fields: the handler replaces the manifest's; a number <= 0 is "not given"
        await stub.RegisterModel(
            m.RegisterModelRequest(url="y.mar", handler="h.py", startup_timeout=30, max_batch_delay=-5)
        )
        # register/unregister refreshed health: the new model is known and its status current
        check = await h.health_stub(h.inference).Check(pb.health.HealthCheckRequest(service="extra"))
        return registered.msg, gone.msg, check.status

    registered, gone, extra_status = run_with(pb, plane, body)
    assert registered == 'Model "extra" Version: 1.0 registered with 1 initial workers'
    assert gone == 'Model "echo" unregistered'
    assert plane.registered == [
        ("extra.mar", {"batch_size": 4, "min_workers": 1, "max_workers": 1}),
        ("y.mar", {"startup_timeout_s": 30.0, "handler": "h.py"}),
    ]
    assert extra_status == pb.health.HealthCheckResponse.SERVING


# -- stub generation ------------------------------------------------------------------------


def test_fix_imports_rewrites_only_our_modules() -> None:
    generated = {"torchserve.inference_pb2", "google.rpc.status_pb2", "top_pb2"}
    source = textwrap.dedent(
        """\
        from google.protobuf import empty_pb2 as google_dot_protobuf_dot_empty__pb2
        from google.rpc import status_pb2 as google_dot_rpc_dot_status__pb2
        from torchserve import inference_pb2 as torchserve_dot_inference__pb2
        import top_pb2 as top__pb2
        """
    )
    assert protogen.fix_imports(source, generated).splitlines() == [
        "from google.protobuf import empty_pb2 as google_dot_protobuf_dot_empty__pb2",
        "from mariner.server._proto.google.rpc import status_pb2 as google_dot_rpc_dot_status__pb2",
        "from mariner.server._proto.torchserve import inference_pb2 as torchserve_dot_inference__pb2",
        "from mariner.server._proto import top_pb2 as top__pb2",
    ]


def test_generate_is_idempotent_and_regenerates_when_a_proto_changes(tmp_path: Path) -> None:
    protos, out = tmp_path / "proto", tmp_path / "out"
    (protos / "demo").mkdir(parents=True)
    src = protos / "demo" / "demo.proto"
    src.write_text('syntax = "proto3";\npackage demo;\nmessage Ping { string a = 1; }\n')
    assert protogen.generate(proto_dir=protos, out_dir=out) is True
    assert protogen.generate(proto_dir=protos, out_dir=out) is False
    assert (out / "demo" / "__init__.py").exists()
    assert (out / "__init__.py").exists()
    later = (out / "demo" / "demo_pb2.py").stat().st_mtime + 5
    os.utime(src, (later, later))
    assert protogen.is_stale(protos, out)
    assert protogen.generate(proto_dir=protos, out_dir=out) is True


def test_bundled_status_proto_yields_to_googleapis(tmp_path: Path) -> None:
    """With googleapis-common-protos installed, its google.rpc.status_pb2 is used, not ours.

    Both register the file name google/rpc/status.proto and protobuf refuses a second,
    different registration; here a stand-in googleapis module is put on the path first.
    """
    fake = tmp_path / "google" / "rpc"
    fake.mkdir(parents=True)
    (fake / "status_pb2.py").write_text(
        textwrap.dedent(
            """\
            from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool
            from google.protobuf.internal import builder
            fd = descriptor_pb2.FileDescriptorProto(
                name="google/rpc/status.proto", package="google.rpc", syntax="proto3",
                dependency=["google/protobuf/any.proto"],
            )
            msg = fd.message_type.add(name="Status")
            msg.field.add(name="code", number=1, type=5, label=1, json_name="code")
            msg.field.add(name="message", number=2, type=9, label=1, json_name="message")
            msg.field.add(name="details", number=3, type=11, label=3, type_name=".google.protobuf.Any")
            DESCRIPTOR = descriptor_pool.Default().AddSerializedFile(fd.SerializeToString())
            builder.BuildMessageAndEnumDescriptors(DESCRIPTOR, globals())
            builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, "google.rpc.status_pb2", globals())
            """
        )
    )
    check = textwrap.dedent(
        """\
        import sys
        import google.rpc.status_pb2 as upstream
        from mariner.server._proto.torchserve import inference_pb2
        field = inference_pb2.PredictionResponse.DESCRIPTOR.fields_by_name["status"]
        assert field.message_type.file is upstream.DESCRIPTOR
        assert "mariner.server._proto.google.rpc.status_bundled_pb2" not in sys.modules
        """
    )
    repo = Path(protogen.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}
    done = subprocess.run([sys.executable, "-c", check], env=env, cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
