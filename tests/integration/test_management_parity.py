"""The management API answers as stock TorchServe 0.12 does (status codes and semantics seen on it
with the same archives; tests/integration/test_torchserve_oracle.py compares the two live):

- register/unregister need model management (405 on REST while it is off, PERMISSION_DENIED on
  gRPC); scale and set-default do not, as in TorchServe >= 0.11;
- `synchronous=false` answers 202 "Processing worker updates..." at once, and so does a scale
  without `synchronous=true`; a duplicate register is 409 with TorchServe's sentence;
- `customized=true` runs the handler (in its worker process) with `describe: True` and puts its
  answer under customizedMetadata, with the handler's status;
- both HTTP ports serve a valid OpenAPI 3 document; the management port's gRPC health knows its
  own service.

Both the single-process server (in-process, its workers are processes) and `mariner serve`
(supervisor, frontends, workers) are driven; waits are for events, with generous caps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from openapi_spec_validator import validate

from mariner.server import protogen
from tests.e2e.serve_process import ServeProcess
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODEL = "digits_onnx"
BODY = json.dumps([4.0] * 64)
HDR = {"Content-Type": "application/json"}
CAP_S = 180.0  # a cap on waiting for an event, never a performance claim
MANAGEMENT_SERVICE = "org.pytorch.serve.grpc.management.ManagementAPIsService"
# What stock TorchServe 0.12 answers for the same archive (GET /models/digits_onnx?customized=true):
# the digits handler has no describe_handle, so its handle() refuses the empty request with 400.
STOCK_CUSTOMIZED = {"error": "a JSON object input must have a 'data' key holding the 64 pixels", "code": 400}


def wait_for(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + CAP_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def stubs() -> Any:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.torchserve import management_pb2, management_pb2_grpc

    return health_pb2, health_pb2_grpc, management_pb2, management_pb2_grpc


def management_health(target: str) -> int:
    health_pb2, health_pb2_grpc, _, _ = stubs()
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=MANAGEMENT_SERVICE)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=30).status


def grpc_call(target: str, call: str, **fields: Any) -> str:
    _, _, management_pb2, management_pb2_grpc = stubs()
    with grpc.insecure_channel(target) as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        return getattr(stub, call)(getattr(management_pb2, f"{call}Request")(**fields), timeout=120).msg


def assert_openapi(base: str) -> dict[str, Any]:
    doc = requests.options(f"{base}/", timeout=30).json()
    assert requests.get(f"{base}/api-description", timeout=30).json() == doc
    validate(doc)
    return doc


@pytest.fixture(scope="module")
def managed(model_store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(model_store, f"{MODEL}.mar", enable_model_management=True).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_a_duplicate_register_is_409_with_torchserves_sentence(managed: MarinerServe) -> None:
    r = requests.post(f"{managed.management}/models", params={"url": f"{MODEL}.mar"}, timeout=60)
    assert r.status_code == 409, r.text
    assert r.json()["message"] == f"Model version 1.0 is already registered for model {MODEL}"
    with pytest.raises(grpc.RpcError) as info:
        grpc_call(managed.grpc_management_target, "RegisterModel", url=f"{MODEL}.mar")
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert [d["modelVersion"] for d in requests.get(f"{managed.management}/models/{MODEL}/all").json()] == [
        "1.0"
    ]


def test_asynchronous_register_answers_202_then_loads(managed: MarinerServe) -> None:
    mgmt = f"{managed.management}/models"
    r = requests.post(mgmt, params={"url": "digits_torchscript.mar", "synchronous": "false"}, timeout=60)
    assert (r.status_code, r.json()) == (202, {"status": "Processing worker updates..."})
    try:
        # Registered at once (TorchServe opens the archive before answering), ready later.
        assert requests.get(f"{mgmt}/digits_torchscript", timeout=30).status_code == 200

        def ready() -> bool:
            (entry,) = requests.get(f"{mgmt}/digits_torchscript", timeout=30).json()
            return [w["status"] for w in entry["workers"]] == ["READY"]

        wait_for("the asynchronously registered model to be READY", ready)
        answer = requests.post(f"{managed.http}/predictions/digits_torchscript", data=BODY, headers=HDR)
        assert answer.status_code == 200, answer.text
    finally:
        requests.delete(f"{mgmt}/digits_torchscript", timeout=60)


def test_customized_describe_runs_the_handler_in_its_worker(managed: MarinerServe) -> None:
    r = requests.get(f"{managed.management}/models/{MODEL}?customized=true", timeout=60)
    assert r.status_code == 400, r.text  # the handler's own status, as stock TorchServe answers
    (entry,) = r.json()
    assert entry["customizedMetadata"] == STOCK_CUSTOMIZED
    assert list(entry)[-1] == "customizedMetadata"
    over_grpc = json.loads(
        grpc_call(managed.grpc_management_target, "DescribeModel", model_name=MODEL, customized=True)
    )
    assert over_grpc[0]["customizedMetadata"] == STOCK_CUSTOMIZED
    # "all" describes without asking any handler, as TorchServe does.
    every = requests.get(f"{managed.management}/models/{MODEL}/all?customized=true", timeout=60)
    assert every.status_code == 200
    assert "customizedMetadata" not in every.json()[0]


def test_both_ports_serve_a_valid_openapi_document(managed: MarinerServe) -> None:
    inference = assert_openapi(managed.http)
    management = assert_openapi(managed.management)
    assert "/predictions/{model}" in inference["paths"]
    assert "/models/{name}/{version}/set-default" in management["paths"]


def test_management_grpc_health_knows_its_service(managed: MarinerServe) -> None:
    health_pb2, *_ = stubs()
    assert management_health(managed.grpc_management_target) == health_pb2.HealthCheckResponse.SERVING


def test_without_management_only_register_and_unregister_are_refused(model_store: Path) -> None:
    srv = MarinerServe(model_store, f"{MODEL}.mar").start()
    try:
        mgmt = f"{srv.management}/models"
        register = requests.post(mgmt, params={"url": "digits_torchscript.mar"}, timeout=30)
        unregister = requests.delete(f"{mgmt}/{MODEL}", timeout=30)
        assert (register.status_code, unregister.status_code) == (405, 405)
        assert (
            register.json()
            == unregister.json()
            == {  # TorchServe's body, word for word
                "code": 405,
                "type": "MethodNotAllowedException",
                "message": "Requested method is not allowed, please refer to API document.",
            }
        )
        assert "--enable-model-management" in srv.log_text()  # how to turn it on: in the log
        default = requests.put(f"{mgmt}/{MODEL}/1.0/set-default", timeout=30)
        assert default.status_code == 200, default.text
        # Scaling loads no new code: as in TorchServe it is not refused for want of model management.
        scale = requests.put(f"{mgmt}/{MODEL}?min_worker=1&synchronous=true", timeout=30)
        assert scale.status_code == 200, scale.text
        assert scale.json() == {"status": f"Workers scaled to 1 for model: {MODEL}"}
        assert len(srv.worker_pids(MODEL)) == 1
        with pytest.raises(grpc.RpcError) as info:
            grpc_call(srv.grpc_management_target, "RegisterModel", url="digits_torchscript.mar")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        answer = grpc_call(srv.grpc_management_target, "SetDefault", model_name=MODEL, model_version="1.0")
        assert answer.startswith("Default version successfully updated")
        assert requests.post(f"{srv.http}/predictions/{MODEL}", data=BODY, headers=HDR).status_code == 200
    finally:
        srv.stop()


def test_supervisor_scales_and_describes_without_model_management(model_store: Path, tmp_path: Path) -> None:
    """`mariner serve` without --enable-model-management: scale works (sync 200, async 202), the
    handler describes itself from its worker process, register is 405."""
    srv = ServeProcess(model_store, f"{MODEL}.mar", tmp_path / "serve.log")
    try:
        srv.wait_ready()
        mgmt = f"{srv.url('mgmt')}/models"

        def workers() -> list[dict[str, Any]]:
            (entry,) = requests.get(f"{mgmt}/{MODEL}", timeout=30).json()
            return entry["workers"]

        up = requests.put(f"{mgmt}/{MODEL}?min_worker=2&max_worker=2&synchronous=true", timeout=CAP_S)
        assert (up.status_code, up.json()) == (200, {"status": f"Workers scaled to 2 for model: {MODEL}"})
        assert [w["status"] for w in workers()] == ["READY", "READY"]
        down = requests.put(f"{mgmt}/{MODEL}?min_worker=1", timeout=CAP_S)
        assert (down.status_code, down.json()) == (202, {"status": "Processing worker updates..."})
        wait_for("one worker after the asynchronous scale", lambda: len(workers()) == 1)
        too_many = requests.put(f"{mgmt}/{MODEL}?min_worker=100000&synchronous=true", timeout=30)
        assert too_many.status_code == 400, too_many.text  # bounded: scaling needs no management

        described = requests.get(f"{mgmt}/{MODEL}?customized=true", timeout=60)
        assert described.status_code == 400, described.text
        assert described.json()[0]["customizedMetadata"] == STOCK_CUSTOMIZED
        assert requests.post(f"{srv.url()}/predictions/{MODEL}", data=BODY, headers=HDR).status_code == 200

        register = requests.post(mgmt, params={"url": "digits_torchscript.mar"}, timeout=30)
        assert register.status_code == 405, register.text
        health_pb2, *_ = stubs()
        assert management_health(srv.target("grpc_mgmt")) == health_pb2.HealthCheckResponse.SERVING
        assert_openapi(srv.url("mgmt"))
    finally:
        srv.kill()
