"""REST and gRPC management describe/list the same model the same way, in stock TorchServe's shape.

Nothing is started: the REST app is called as an ASGI app and the gRPC servicer's methods are
awaited directly, both over one fake DataPlane, so the comparison is of the two real code paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import pytest

from mariner.server import protogen
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferResult, ModelInfo, WireProtocol, WorkerInfo
from mariner.server.supervisor.management.describe import describe_model, list_models
from mariner.server.supervisor.management.http import management_app
from tests.unit.fakes import make_info

pytestmark = pytest.mark.unit

# Stock TorchServe 0.12's describe-model keys, in its order (GET /models/<name> on a CPU model).
STOCK_KEYS = [
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
    "maxRetryTimeoutInSec",
    "clientTimeoutInMills",
    "parallelType",
    "parallelLevel",
    "deviceType",
    "deviceIds",  # only when set: TorchServe's JSON writer drops null fields
    "continuousBatching",
    "useJobTicket",
    "useVenv",
    "stateful",
    "sequenceMaxIdleMSec",
    "sequenceTimeoutMSec",
    "maxNumSequence",
    "maxSequenceJobQueueSize",
    "loadedAtStartup",
    "workers",
    "jobQueueStatus",
]
STOCK_WORKER_KEYS = ["id", "startTime", "status", "memoryUsage", "pid", "gpu", "gpuUsage"]
# Stock TorchServe 0.12's values for the features Mariner does not have (describe_model's
# docstring): what TorchServe itself answers with each of them off.
TORCHSERVE_DEFAULTS = {
    "maxRetryTimeoutInSec": 300,
    "clientTimeoutInMills": 0,
    "parallelType": "",
    "parallelLevel": 0,
    "continuousBatching": False,
    "useJobTicket": False,
    "useVenv": False,
    "stateful": False,
    "sequenceMaxIdleMSec": 0,
    "sequenceTimeoutMSec": 0,
    "maxNumSequence": 0,
    "maxSequenceJobQueueSize": 0,
}


def info(
    name: str,
    version: str,
    *,
    default: bool = True,
    device: str = "cpu",
    pending: int = 0,
    at_startup: bool = True,
    device_type: str | None = None,
) -> ModelInfo:
    worker = WorkerInfo(
        id=f"{name}-{version}-0",
        device=device,
        status="READY",
        batches=7,
        pid=4242,
        memory_bytes=123_456_789,
        started_at=1_790_000_000.25,
    )
    return make_info(
        name,
        version,
        default=default,
        archive=f"/srv/store/{name}-{version}.mar",
        max_batch_delay_ms=4.6,
        queue_size=100,
        max_workers=2,
        workers=(worker,),
        load_seconds=1.5,
        loaded_at_startup=at_startup,
        pending_requests=pending,
        device_type=device_type,
    )


@dataclass
class Plane:
    """The DataPlane's read side, as both management adapters use it."""

    infos: list[ModelInfo] = field(
        default_factory=lambda: [
            info("echo", "1.0", pending=3),
            info("echo", "2.0", default=False, device="cuda:1", at_startup=False),
            info("alpha", "1", device_type="cpu"),
            info("zeta", "1"),
        ]
    )
    management_enabled: bool = False
    described: list[tuple[str, str | None, dict[str, str]]] = field(default_factory=list)
    handler_answer: InferResult = field(
        default_factory=lambda: InferResult(body=b'{\n  "labels": [0, 1]\n}', status=200)
    )

    def models(self) -> list[ModelInfo]:
        return list(self.infos)

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult:
        self.described.append((model, version, dict(headers)))
        return self.handler_answer

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        found = [i for i in self.infos if i.name == model and version in (None, "all", i.version)]
        if not found:
            raise ServingError(Code.NOT_FOUND, f"model {model!r} version {version!r} is not served here")
        return found


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    return SimpleNamespace(
        management=importlib.import_module("mariner.server._proto.torchserve.management_pb2"),
        grpc=importlib.import_module("mariner.server.supervisor.management.grpc"),
    )


async def rest_get(app: Any, path: str, query: str = "") -> tuple[int, Any]:
    """One GET through the REST app's ASGI interface (no server, no sockets)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [],
        "server": ("test", 8081),
        "client": ("test", 1),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


class AbortCalled(Exception):
    pass


class Context:
    """The part of grpc.aio.ServicerContext the management servicer uses on success and error."""

    async def abort(self, code: Any, details: str) -> None:
        raise AbortCalled(code, details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("x-trace", "t1"),)


def grpc_describe(pb: SimpleNamespace, plane: Plane, name: str, version: str = "") -> Any:
    servicer = pb.grpc.ManagementServicer(plane)
    request = pb.management.DescribeModelRequest(model_name=name, model_version=version)
    return json.loads(asyncio.run(servicer.DescribeModel(request, Context())).msg)


def grpc_list(pb: SimpleNamespace, plane: Plane, limit: int = 0, token: int = 0) -> Any:
    servicer = pb.grpc.ManagementServicer(plane)
    request = pb.management.ListModelsRequest(limit=limit, next_page_token=token)
    return json.loads(asyncio.run(servicer.ListModels(request, Context())).msg)


def assert_same(rest: Any, grpc: Any) -> None:
    """Equal, and when not, the first differing key is named."""
    assert isinstance(rest, list)
    assert isinstance(grpc, list)
    assert len(rest) == len(grpc)
    for r, g in zip(rest, grpc, strict=True):
        assert list(r) == list(g), "key order differs"
        for key in r:
            assert r[key] == g[key], f"{key}: REST {r[key]!r} != gRPC {g[key]!r}"


@pytest.mark.parametrize(
    ("path", "version"),
    [
        ("/models/echo", ""),
        ("/models/echo/all", "all"),
        ("/models/echo/2.0", "2.0"),
        ("/models/alpha", ""),
    ],
)
def test_rest_and_grpc_describe_are_equal_key_by_key(pb: SimpleNamespace, path: str, version: str) -> None:
    plane = Plane()
    status, rest = asyncio.run(rest_get(management_app(plane), path))  # type: ignore[arg-type]
    assert status == 200
    grpc = grpc_describe(pb, plane, path.split("/")[2], version)
    assert rest  # a describe of a served model is never empty
    assert_same(rest, grpc)


def test_rest_and_grpc_list_are_equal(pb: SimpleNamespace) -> None:
    plane = Plane()
    app = management_app(plane)  # type: ignore[arg-type]
    for query, limit, token in [("", 0, 0), ("limit=2", 2, 0), ("limit=2&next_page_token=2", 2, 2)]:
        status, rest = asyncio.run(rest_get(app, "/models", query))
        assert status == 200
        assert rest == grpc_list(pb, plane, limit, token)
    assert rest == {"models": [{"modelName": "zeta", "modelUrl": "zeta-1.mar"}]}
    assert list_models(plane.models(), 2, 0) == {
        "nextPageToken": "2",
        "models": [
            {"modelName": "alpha", "modelUrl": "alpha-1.mar"},
            {"modelName": "echo", "modelUrl": "echo-1.0.mar"},  # the default version's archive
        ],
    }


def test_describe_has_every_stock_torchserve_key_in_its_order() -> None:
    for model in Plane().infos:
        entry = describe_model(model)
        ours = [k for k in entry if k != "mariner"]
        expected = [
            k for k in STOCK_KEYS if k != "deviceIds" or any(w.device != "cpu" for w in model.workers)
        ]
        assert ours == expected
        for key, value in TORCHSERVE_DEFAULTS.items():
            assert entry[key] == value, key
            assert type(entry[key]) is type(value), key
        for worker in entry["workers"]:
            assert list(worker) == STOCK_WORKER_KEYS


def test_startup_timeout_is_the_versions_own(pb: SimpleNamespace) -> None:
    plane = Plane()
    plane.infos = [dataclasses.replace(i, startup_timeout_s=77.0) for i in plane.infos]
    status, rest = asyncio.run(rest_get(management_app(plane), "/models/echo"))  # type: ignore[arg-type]
    assert status == 200
    assert rest[0]["startupTimeout"] == 77
    assert grpc_describe(pb, plane, "echo")[0]["startupTimeout"] == 77


def test_customized_describe_asks_the_handler_on_both_paths(pb: SimpleNamespace) -> None:
    plane = Plane()
    status, rest = asyncio.run(
        rest_get(management_app(plane), "/models/echo/2.0", "customized=true")  # type: ignore[arg-type]
    )
    assert status == 200
    (entry,) = rest
    assert list(entry)[-1] == "customizedMetadata"  # after jobQueueStatus (and ours), as stock
    assert entry["customizedMetadata"] == {"labels": [0, 1]}  # the handler's JSON, parsed
    servicer = pb.grpc.ManagementServicer(plane)
    request = pb.management.DescribeModelRequest(model_name="echo", model_version="2.0", customized=True)
    (g,) = json.loads(asyncio.run(servicer.DescribeModel(request, Context())).msg)
    assert g["customizedMetadata"] == {"labels": [0, 1]}
    assert [(m, v) for m, v, _ in plane.described] == [("echo", "2.0"), ("echo", "2.0")]
    assert plane.described[1][2] == {"x-trace": "t1"}  # the call's metadata reach the handler

    # "all" never asks a handler (TorchServe's rule); customized=false neither.
    asyncio.run(rest_get(management_app(plane), "/models/echo/all", "customized=true"))  # type: ignore[arg-type]
    asyncio.run(rest_get(management_app(plane), "/models/echo", "customized=false"))  # type: ignore[arg-type]
    assert len(plane.described) == 2

    # A handler that is not JSON is kept as text; its status is REST's status, as in TorchServe.
    plane.handler_answer = InferResult(body=b"not json", status=400)
    status, rest = asyncio.run(
        rest_get(management_app(plane), "/models/echo", "customized=true")  # type: ignore[arg-type]
    )
    assert (status, rest[0]["customizedMetadata"]) == (400, "not json")


def test_describe_reports_real_facts_from_model_info() -> None:
    queued, registered, cpu = Plane().infos[0], Plane().infos[1], Plane().infos[2]
    entry = describe_model(queued)
    assert entry["jobQueueStatus"] == {"remainingCapacity": 97, "pendingRequests": 3}
    assert entry["loadedAtStartup"] is True
    assert (entry["maxBatchDelay"], entry["responseTimeout"], entry["mariner"]["maxBatchDelayMs"]) == (
        5,
        30,
        4.6,
    )
    assert entry["modelUrl"] == "echo-1.0.mar"  # never a server-side path
    assert entry["deviceType"] == "cpu"
    (worker,) = entry["workers"]
    assert worker == {
        "id": "echo-1.0-0",
        "startTime": "2026-09-21T14:13:20.250Z",
        "status": "READY",
        "memoryUsage": 123_456_789,
        "pid": 4242,
        "gpu": False,
        "gpuUsage": "N/A",
    }
    on_gpu = describe_model(registered)
    assert on_gpu["loadedAtStartup"] is False
    assert (on_gpu["deviceType"], on_gpu["deviceIds"], on_gpu["workers"][0]["gpu"]) == ("gpu", [1], True)
    assert describe_model(cpu)["deviceType"] == "cpu"
    # A full queue has no capacity left, never a negative one.
    assert describe_model(replace(queued, pending_requests=150))["jobQueueStatus"]["remainingCapacity"] == 0


def test_unknown_worker_facts_are_omitted_not_invented() -> None:
    bare = WorkerInfo(id="w0", device="cpu", status="LOADING", batches=0)
    entry = describe_model(replace(Plane().infos[0], workers=(bare,)))
    assert entry["workers"] == [{"id": "w0", "status": "LOADING", "gpu": False, "gpuUsage": "N/A"}]


def test_describe_errors_are_the_same_on_both_paths(pb: SimpleNamespace) -> None:
    plane = Plane()
    status, body = asyncio.run(rest_get(management_app(plane), "/models/nope"))  # type: ignore[arg-type]
    assert status == 404
    with pytest.raises(AbortCalled) as aborted:
        grpc_describe(pb, plane, "nope")
    code, details = aborted.value.args
    assert code.name == "NOT_FOUND"
    assert details == body["message"]
