"""The TorchServe REST apps against real uvicorn servers on port 0, with a fake DataPlane.

The servers run in background threads (each with its own event loop); tests talk to them with
`requests`, as TorchServe clients do. The fake records what reached `infer`, so tests can check
that bad requests fail before they are queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import requests

from mariner.server.common.http_common import TrailingSlashes
from mariner.server.contracts.errors import RETRY_AFTER_SECONDS, TORCHSERVE_TYPES, Code, ServingError
from mariner.server.contracts.types import (
    InferRequest,
    InferResult,
    ModelInfo,
    WireProtocol,
    WorkerInfo,
)
from mariner.server.frontend.protocols.http_listener import inference_app
from mariner.server.supervisor.management.http import management_app
from mariner.server.supervisor.metrics_http import metrics_app
from tests.unit import fakes
from tests.unit.fakes import PREDICTION_PATHS, QuietMetrics, TransportCalls, serve, serve_inference

pytestmark = pytest.mark.unit

MAX_BODY = 512 * 1024
TIMEOUT = 10


def make_info(name: str, version: str, *, default: bool = True, device: str = "cpu") -> ModelInfo:
    worker = WorkerInfo(id=f"{name}-{version}-0", device=device, status="READY", batches=3, pid=4242)
    return fakes.make_info(
        name,
        version,
        default=default,
        max_batch_delay_ms=5.0,
        response_timeout_s=120.0,
        queue_size=1024,
        workers=(worker,),
        load_seconds=0.5,
    )


Answer = Callable[[InferRequest], Awaitable[InferResult]]


async def ok_answer(req: InferRequest) -> InferResult:
    return InferResult(body=b'{\n  "ok": true\n}', model_version="1.0")


class FakePlane(TransportCalls):
    """DataPlane's surface, driven by the test: `answer` decides what infer does."""

    def __init__(self) -> None:
        self.metrics = QuietMetrics()
        self.reset()

    def reset(self) -> None:
        self.ready = True
        self.draining = False
        self.management_enabled = False
        self.answer: Answer = ok_answer
        self.calls: list[InferRequest] = []
        self.management_calls: list[tuple[Any, ...]] = []
        self.cancelled = threading.Event()
        self.infos = [
            make_info("digits", "1.0"),
            make_info("digits", "2.0", default=False, device="cuda:1"),
            make_info("other", "1"),
        ]

    async def infer(self, req: InferRequest) -> InferResult:
        self.calls.append(req)
        return await self.answer(req)

    def models(self) -> list[ModelInfo]:
        return list(self.infos)

    def _find(self, model: str, version: str | None) -> ModelInfo:
        for i in self.infos:
            if i.name == model and (i.version == version if version else i.is_default):
                return i
        raise ServingError(Code.NOT_FOUND, f"model {model!r} is not served here; see GET /models for what is")

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]:
        if version is None or version == "all":
            self._find(model, None)
            return [i for i in self.infos if i.name == model]
        return [self._find(model, version)]

    def is_live(self) -> bool:
        return True

    def is_ready(self) -> bool:
        return self.ready and not self.draining

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return self.is_ready()

    def known_label(self, model: str, version: str | None) -> tuple[str, str]:
        try:
            i = self._find(model, version)
        except ServingError:
            return "unknown", "unknown"
        return i.name, i.version

    def _require_management(self, what: str) -> None:
        if not self.management_enabled:
            raise ServingError(
                Code.PERMISSION_DENIED, f"{what} is disabled: start with --enable-model-management"
            )

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]:
        self._require_management("model registration")
        self.management_calls.append(("register", archive_name, overrides))
        info = make_info(overrides.get("name", archive_name.removesuffix(".mar")), "3.0")
        workers = overrides.get("min_workers", 0)  # the registry's default for a register: none
        info = dataclasses.replace(  # as the DataPlane marks it
            info, loaded_at_startup=False, min_workers=workers, workers=info.workers[:workers]
        )
        self.infos.append(info)
        return [info]

    async def unregister(self, model: str, version: str | None = None) -> None:
        self._require_management("model unregistration")
        self.management_calls.append(("unregister", model, version))

    async def set_default(self, model: str, version: str) -> None:  # not gated, as in TorchServe
        self.management_calls.append(("set_default", model, version))

    async def scale(self, model: str, version: str | None, min_workers: int, max_workers: int) -> None:
        self.management_calls.append(("scale", model, version, min_workers, max_workers))


@pytest.fixture(scope="module")
def shared_plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def plane(shared_plane: FakePlane) -> FakePlane:
    shared_plane.reset()
    return shared_plane


@pytest.fixture(scope="module", params=PREDICTION_PATHS)
def inference_url(shared_plane: FakePlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """The inference listener, answering predictions on its fast path and through the app."""
    app = inference_app(shared_plane, max_body_bytes=MAX_BODY)
    with serve_inference(shared_plane, app, request.param, max_body_bytes=MAX_BODY) as url:
        yield url


@pytest.fixture(scope="module")
def management_url(shared_plane: FakePlane) -> Iterator[str]:
    with serve(management_app(shared_plane)) as url:
        yield url


@pytest.fixture(scope="module")
def metrics_url(shared_plane: FakePlane) -> Iterator[str]:
    with serve(metrics_app(shared_plane)) as url:
        yield url


def count(plane: FakePlane, model: str, version: str, code: str) -> float:
    labels = {"model": model, "version": version, "protocol": "torchserve-http", "code": code}
    return plane.metrics.registry.get_sample_value("mariner_requests_total", labels) or 0.0


def assert_error(resp: requests.Response, status: int, code: Code) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert body["code"] == status
    assert body["type"] == TORCHSERVE_TYPES[code]  # TorchServe's exception name for the code
    assert body["message"]
    return body


# -- health -----------------------------------------------------------------------------------
def test_ping_is_torchserve_shaped(plane: FakePlane, inference_url: str) -> None:
    resp = requests.get(f"{inference_url}/ping", timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.json() == {"status": "Healthy"}
    plane.ready = False
    resp = requests.get(f"{inference_url}/ping", timeout=TIMEOUT)
    assert resp.status_code == 500
    assert resp.json() == {"status": "Unhealthy"}


def test_healthz_answers_while_not_ready(plane: FakePlane, inference_url: str) -> None:
    plane.ready = False
    assert requests.get(f"{inference_url}/healthz", timeout=TIMEOUT).status_code == 200


def test_readyz_follows_readiness_and_draining(plane: FakePlane, inference_url: str) -> None:
    assert requests.get(f"{inference_url}/readyz", timeout=TIMEOUT).status_code == 200
    plane.ready = False
    assert requests.get(f"{inference_url}/readyz", timeout=TIMEOUT).status_code == 503
    plane.ready = True
    plane.draining = True
    resp = requests.get(f"{inference_url}/readyz", timeout=TIMEOUT)
    assert resp.status_code == 503
    assert resp.json() == {"status": "draining"}


# -- predictions: decoding ----------------------------------------------------------------------
def test_json_body_is_parsed_and_answer_passes_through(plane: FakePlane, inference_url: str) -> None:
    resp = requests.post(
        f"{inference_url}/predictions/digits",
        json={"pixels": [0, 16, 3]},
        headers={"X-Trace": "t1"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200
    assert resp.content == b'{\n  "ok": true\n}'
    assert resp.headers["content-type"] == "application/json"
    (req,) = plane.calls
    assert req.data == {"body": {"pixels": [0, 16, 3]}}
    assert (req.model, req.version, req.protocol, req.items) == ("digits", None, WireProtocol.TS_HTTP, 1)
    assert re.fullmatch(r"[0-9a-f]{32}", req.request_id)
    assert resp.headers["x-request-id"] == req.request_id
    assert req.headers["x-trace"] == "t1"  # names lower-cased, as TorchServe's context shows them
    assert req.headers["content-type"] == "application/json"


def test_version_in_path_and_put_like_torchserve(plane: FakePlane, inference_url: str) -> None:
    resp = requests.put(f"{inference_url}/predictions/digits/2.0", data=b"\x01", timeout=TIMEOUT)
    assert resp.status_code == 200
    assert (plane.calls[0].model, plane.calls[0].version) == ("digits", "2.0")


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("image/png", b"\x89PNG\r\n\x1a\n\x00\xff"),
        ("application/octet-stream", b"\x89PNG\r\n\x1a\n\x00\xff"),
        (None, b"\x89PNG\r\n\x1a\n\x00\xff"),
        ("text/plain; charset=utf-8", "\x89PNG"),
    ],
)
def test_body_decoding_by_content_type(
    plane: FakePlane, inference_url: str, content_type: str | None, expected: Any
) -> None:
    body = expected.encode("utf-8") if isinstance(expected, str) else expected
    headers = {"Content-Type": content_type} if content_type else {}
    resp = requests.post(f"{inference_url}/predictions/digits", data=body, headers=headers, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert plane.calls[0].data == {"body": expected}
    assert type(plane.calls[0].data["body"]) is type(expected)


def test_large_json_body_is_decoded(plane: FakePlane, inference_url: str) -> None:
    rows = [[float(i)] * 64 for i in range(600)]  # ~300 KB: decoded off the event loop
    body = json.dumps(rows).encode()
    assert 256 * 1024 < len(body) < MAX_BODY
    resp = requests.post(
        f"{inference_url}/predictions/digits",
        data=body,
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200
    assert plane.calls[0].data["body"] == rows


def test_multipart_form_like_torchserve(plane: FakePlane, inference_url: str) -> None:
    png = bytes(range(256)) * 4 + b"\r\n--not-a-boundary\r\n\r\n"
    resp = requests.post(
        f"{inference_url}/predictions/digits",
        files={
            "data": ("digit.png", png, "image/png"),
            "meta": ("meta.json", b'{"k": 1}', "application/json"),
        },
        data={"field": "v"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert plane.calls[0].data == {"data": png, "meta": {"k": 1}, "field": b"v"}


def test_urlencoded_form_fields_are_bytes(plane: FakePlane, inference_url: str) -> None:
    resp = requests.post(f"{inference_url}/predictions/digits", data={"a": "1", "b": "é x"}, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert plane.calls[0].data == {"a": b"1", "b": "é x".encode()}


# -- predictions: rejected before queueing ---------------------------------------------------
def test_malformed_json_is_400_before_infer(plane: FakePlane, inference_url: str) -> None:
    resp = requests.post(
        f"{inference_url}/predictions/digits",
        data=b'{"pixels": [1, 2,',
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    body = assert_error(resp, 400, Code.INVALID_ARGUMENT)
    assert "line 1 column" in body["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])
    assert plane.calls == []


def test_invalid_utf8_text_is_400(plane: FakePlane, inference_url: str) -> None:
    resp = requests.post(
        f"{inference_url}/predictions/digits",
        data=b"ab\xff",
        headers={"Content-Type": "text/plain"},
        timeout=TIMEOUT,
    )
    assert "byte 2" in assert_error(resp, 400, Code.INVALID_ARGUMENT)["message"]
    assert plane.calls == []


def test_empty_body_is_400(plane: FakePlane, inference_url: str) -> None:
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"", timeout=TIMEOUT)
    assert "empty body" in assert_error(resp, 400, Code.INVALID_ARGUMENT)["message"]
    assert plane.calls == []


def test_oversized_body_is_413_naming_the_limit(plane: FakePlane, inference_url: str) -> None:
    before = count(plane, "digits", "1.0", "413")
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"x" * (MAX_BODY + 1), timeout=TIMEOUT)
    assert str(MAX_BODY) in assert_error(resp, 413, Code.INVALID_ARGUMENT)["message"]
    # Without Content-Length (chunked upload) the limit is enforced while reading.
    chunks = (b"y" * 65536 for _ in range(MAX_BODY // 65536 + 1))
    resp = requests.post(f"{inference_url}/predictions/digits", data=chunks, timeout=TIMEOUT)
    assert_error(resp, 413, Code.INVALID_ARGUMENT)
    assert plane.calls == []
    assert count(plane, "digits", "1.0", "413") == before + 2
    # The connection stays usable for the next request.
    assert requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT).status_code == 200


# -- predictions: answers and errors ------------------------------------------------------------
def test_handler_error_status_and_body_pass_through(plane: FakePlane, inference_url: str) -> None:
    async def bad_input(req: InferRequest) -> InferResult:
        return InferResult(body=b'{"error": "expected 64 pixels"}', status=400)

    plane.answer = bad_input
    before = count(plane, "digits", "1.0", "400")
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"[1]", timeout=TIMEOUT)
    assert resp.status_code == 400
    assert resp.content == b'{"error": "expected 64 pixels"}'
    assert resp.headers["content-type"] == "application/json"
    assert count(plane, "digits", "1.0", "400") == before + 1


def test_handler_content_type_and_headers_are_kept(plane: FakePlane, inference_url: str) -> None:
    async def csv(req: InferRequest) -> InferResult:
        return InferResult(
            body=b"a,b\n1,2\n",
            content_type="text/csv",
            headers={"x-model-note": "hi", "content-length": "999"},
        )

    plane.answer = csv
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.content == b"a,b\n1,2\n"
    assert resp.headers["content-type"] == "text/csv"
    assert resp.headers["x-model-note"] == "hi"
    assert resp.headers["content-length"] == "8"


def test_plain_answer_has_no_content_type_like_torchserve(plane: FakePlane, inference_url: str) -> None:
    async def text(req: InferRequest) -> InferResult:
        return InferResult(body=b"7")

    plane.answer = text
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT)
    assert resp.content == b"7"
    assert "content-type" not in resp.headers


def test_unknown_model_is_404_and_counted_as_unknown(plane: FakePlane, inference_url: str) -> None:
    async def not_found(req: InferRequest) -> InferResult:
        raise ServingError(Code.NOT_FOUND, f"model {req.model!r} is not served here")

    plane.answer = not_found
    before = count(plane, "unknown", "unknown", "404")
    resp = requests.post(f"{inference_url}/predictions/no-such-model-xyz", data=b"1", timeout=TIMEOUT)
    assert "no-such-model-xyz" in assert_error(resp, 404, Code.NOT_FOUND)["message"]
    assert count(plane, "unknown", "unknown", "404") == before + 1


def test_overload_is_503_with_retry_after(plane: FakePlane, inference_url: str) -> None:
    async def full(req: InferRequest) -> InferResult:
        raise ServingError(Code.RESOURCE_EXHAUSTED, "queue of digits is full (1024 items)")

    plane.answer = full
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT)
    assert (
        assert_error(resp, 503, Code.RESOURCE_EXHAUSTED)["message"] == "queue of digits is full (1024 items)"
    )
    assert resp.headers["retry-after"] == str(RETRY_AFTER_SECONDS)


def test_unexpected_exception_is_sanitized_500(plane: FakePlane, inference_url: str) -> None:
    async def broken(req: InferRequest) -> InferResult:
        raise RuntimeError("secret detail at /srv/secret.py")

    plane.answer = broken
    resp = requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT)
    body = assert_error(resp, 500, Code.INTERNAL)
    assert "secret" not in resp.text
    assert "Traceback" not in resp.text
    assert "server log" in body["message"]


@pytest.fixture(scope="module")
def limited_inference_url(shared_plane: FakePlane) -> Iterator[str]:
    """The same app behind Mariner's own HTTP protocol (its limits, its disconnect hook)."""
    from mariner.server.common.http_limits import HttpLimits, limited_protocol

    with serve(
        inference_app(shared_plane, max_body_bytes=MAX_BODY), http=limited_protocol(HttpLimits())
    ) as url:
        yield url


@pytest.mark.parametrize("server", ["uvicorn's protocol: a watcher task", "Mariner's protocol: its hook"])
def test_client_disconnect_cancels_inference(
    plane: FakePlane, inference_url: str, limited_inference_url: str, server: str
) -> None:
    """Under stock uvicorn a task waits for `http.disconnect`; under Mariner's listeners the
    protocol's connection_lost calls back (no task per request). Either way the inference is
    cancelled and counted 499."""
    if server.startswith("Mariner"):
        inference_url = limited_inference_url
    started = threading.Event()

    async def hang(req: InferRequest) -> InferResult:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            plane.cancelled.set()
            raise
        raise AssertionError("unreachable")

    plane.answer = hang
    before = count(plane, "digits", "1.0", "499")
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=(TIMEOUT, 0.3))
    assert started.is_set()
    assert plane.cancelled.wait(TIMEOUT), "inference was not cancelled when the client went away"
    deadline = time.monotonic() + TIMEOUT
    while count(plane, "digits", "1.0", "499") == before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert count(plane, "digits", "1.0", "499") == before + 1


def test_unknown_route_and_method_are_json(plane: FakePlane, inference_url: str) -> None:
    """Stock TorchServe's bodies for an unknown path and a wrong method, word for word."""
    resp = requests.get(f"{inference_url}/nope", timeout=TIMEOUT)
    assert (resp.status_code, resp.json()) == (
        404,
        {
            "code": 404,
            "type": "ResourceNotFoundException",
            "message": "Requested resource is not found, please refer to API document.",
        },
    )
    resp = requests.get(f"{inference_url}/predictions/digits", timeout=TIMEOUT)
    assert (resp.status_code, resp.json()) == (
        405,
        {
            "code": 405,
            "type": "MethodNotAllowedException",
            "message": "Requested method is not allowed, please refer to API document.",
        },
    )


# -- the prediction fast path ---------------------------------------------------------------------
def test_prediction_paths_are_matched_as_starlettes_routes_match_them() -> None:
    from mariner.server.frontend.protocols.http_listener import prediction_params

    assert prediction_params("/predictions/digits") == {"model": "digits"}
    assert prediction_params("/predictions/digits/2.0") == {"model": "digits", "version": "2.0"}
    # What follows the version is the url_path, as the route's path convertor takes it.
    assert prediction_params("/predictions/a/b/c") == {"model": "a", "version": "b", "url_path": "c"}
    assert prediction_params("/predictions/a/b/v1/chat/") == {
        "model": "a",
        "version": "b",
        "url_path": "v1/chat/",
    }
    assert prediction_params("/predictions/a/b/") == {"model": "a", "version": "b", "url_path": ""}
    others = ("/predictions", "/predictions/", "/predictions/digits/", "/predictions//1", "/predictions/a//c")
    others += ("/explanations/digits", "predictions/digits", "//predictions/x")
    for other in others:
        assert prediction_params(other) is None, other


@pytest.fixture(scope="module")
def starlette_url(shared_plane: FakePlane) -> Iterator[str]:
    """The same routes through Starlette alone (behind the listener's trailing-slash rule): what
    the listener's fast path must equal."""
    with serve(TrailingSlashes(inference_app(shared_plane, max_body_bytes=MAX_BODY).app)) as url:
        yield url


def test_the_fast_path_answers_what_starlette_answers(
    plane: FakePlane, inference_url: str, starlette_url: str
) -> None:
    async def by_body(req: InferRequest) -> InferResult:
        body = req.data.get("body")
        if body == {"fail": True}:
            raise RuntimeError("secret")
        if body == {"status": 507}:
            return InferResult(body=b"handler says no", status=507, content_type="text/x-mine")
        answer = {"got": body, "v": req.version, "url_path": req.headers.get("url_path")}
        return InferResult(body=json.dumps(answer).encode(), model_version="1.0")

    json_type = {"content-type": "application/json"}
    cases: list[tuple[str, str, bytes, dict[str, str]]] = [
        ("POST", "/predictions/digits", b'{"x": [1, 2]}', json_type),
        ("PUT", "/predictions/digits/2.0", b'{"x": 1}', json_type),
        ("POST", "/predictions/digits", b"plain text", {"content-type": "text/plain"}),
        ("POST", "/predictions/digits", b'{"status": 507}', json_type),
        ("POST", "/predictions/digits", b'{"fail": true}', json_type),
        ("POST", "/predictions/digits", b"{not json", json_type),
        ("POST", "/predictions/digits", b"", {}),
        ("POST", "/predictions/digits", b"x" * (MAX_BODY + 1), {}),
        ("POST", "/predictions/nope", b"1", {}),
        ("POST", "/predictions/digits/", b"1", {}),
        ("POST", "/predictions/", b"1", {}),
        ("GET", "/predictions/digits", b"", {}),
        ("DELETE", "/predictions/digits", b"", {}),
        ("POST", "/predictions/digits?x=1", b"1", {}),
        ("POST", "/predictions/digits/2.0/v1/chat/completion", b"1", {}),
        ("POST", "/predictions/digits/2.0/v1/", b"1", {}),
        ("POST", "/predictions/digits/2.0/", b"1", {}),
        ("POST", "/predictions/digits/2.0/a%0Ab", b"1", {}),
        ("POST", "/predictions/digits/2.0/a%01b", b"1", {}),
        ("POST", "/predictions/digits//v1", b"1", {}),
    ]
    plane.answer = by_body
    for method, path, body, headers in cases:
        got = [
            requests.request(method, base + path, data=body, headers=headers, timeout=TIMEOUT)
            for base in (inference_url, starlette_url)
        ]
        fast, slow = (
            {k: v for k, v in r.headers.items() if k.lower() not in ("date", "x-request-id")} for r in got
        )
        assert (got[0].status_code, got[0].content, fast) == (got[1].status_code, got[1].content, slow), (
            method, path, body[:20],
        )  # fmt: skip
    assert "secret" not in requests.post(f"{inference_url}/predictions/digits", json={"fail": True}).text


# -- metrics ----------------------------------------------------------------------------------
def test_metrics_expose_bounded_labels(plane: FakePlane, inference_url: str, metrics_url: str) -> None:
    async def not_found(req: InferRequest) -> InferResult:
        if req.model == "digits":
            return InferResult(body=b"1")
        raise ServingError(Code.NOT_FOUND, "not served")

    plane.answer = not_found
    requests.post(f"{inference_url}/predictions/digits", data=b"1", timeout=TIMEOUT)
    requests.post(f"{inference_url}/predictions/attacker-chosen-label", data=b"1", timeout=TIMEOUT)
    resp = requests.get(f"{metrics_url}/metrics", timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    ok = 'mariner_requests_total{code="200",model="digits",protocol="torchserve-http",version="1.0"}'
    unknown = (
        'mariner_requests_total{code="404",model="unknown",protocol="torchserve-http",version="unknown"}'
    )
    assert re.search(re.escape(ok) + " [1-9]", text)
    assert re.search(re.escape(unknown) + " [1-9]", text)
    assert "mariner_request_duration_seconds_bucket" in text
    assert "attacker-chosen-label" not in text


# -- management -------------------------------------------------------------------------------
def test_list_models_torchserve_shape_and_pages(plane: FakePlane, management_url: str) -> None:
    resp = requests.get(f"{management_url}/models", timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.json() == {
        "models": [
            {"modelName": "digits", "modelUrl": "digits.mar"},
            {"modelName": "other", "modelUrl": "other.mar"},
        ]
    }
    page = requests.get(f"{management_url}/models?limit=1", timeout=TIMEOUT).json()
    assert page == {"nextPageToken": "1", "models": [{"modelName": "digits", "modelUrl": "digits.mar"}]}
    page = requests.get(f"{management_url}/models?limit=1&next_page_token=1", timeout=TIMEOUT).json()
    assert page["models"] == [{"modelName": "other", "modelUrl": "other.mar"}]
    # Malformed numbers fall back to the defaults, as in TorchServe.
    page = requests.get(f"{management_url}/models?limit=abc&next_page_token=-4", timeout=TIMEOUT).json()
    assert [m["modelName"] for m in page["models"]] == ["digits", "other"]


def test_describe_model_torchserve_shape(plane: FakePlane, management_url: str) -> None:
    resp = requests.get(f"{management_url}/models/digits", timeout=TIMEOUT)
    assert resp.status_code == 200
    (entry,) = resp.json()  # the default version only, like TorchServe
    assert {k: entry[k] for k in ("modelName", "modelVersion", "modelUrl", "runtime")} == {
        "modelName": "digits",
        "modelVersion": "1.0",
        "modelUrl": "digits.mar",
        "runtime": "python",
    }
    assert (entry["minWorkers"], entry["maxWorkers"], entry["batchSize"]) == (1, 1, 8)
    assert (entry["maxBatchDelay"], entry["responseTimeout"], entry["loadedAtStartup"]) == (5, 120, True)
    (worker,) = entry["workers"]
    assert worker["id"] == "digits-1.0-0"
    assert worker["status"] == "READY"
    assert worker["gpu"] is False
    assert worker["pid"] == 4242

    every = requests.get(f"{management_url}/models/digits/all", timeout=TIMEOUT).json()
    assert [e["modelVersion"] for e in every] == ["1.0", "2.0"]
    (v2,) = requests.get(f"{management_url}/models/digits/2.0", timeout=TIMEOUT).json()
    assert v2["workers"][0]["gpu"] is True
    assert (v2["deviceType"], v2["deviceIds"]) == ("gpu", [1])

    assert_error(requests.get(f"{management_url}/models/nope", timeout=TIMEOUT), 404, Code.NOT_FOUND)


def test_changes_are_refused_unless_management_is_enabled(plane: FakePlane, management_url: str) -> None:
    # TorchServe's answer while its model API is off: 405 for register and unregister only.
    for method, path in [
        ("POST", "/models?url=digits.mar"),
        ("DELETE", "/models/digits"),
        ("DELETE", "/models/digits/2.0"),
    ]:
        resp = requests.request(method, f"{management_url}{path}", timeout=TIMEOUT)
        assert resp.status_code == 405, resp.text
        assert resp.json() == {  # TorchServe's body, word for word (its clients compare it)
            "code": 405,
            "type": "MethodNotAllowedException",
            "message": "Requested method is not allowed, please refer to API document.",
        }
    assert plane.management_calls == []
    # Scale and set-default load no code: TorchServe allows them with the model API off.
    resp = requests.put(f"{management_url}/models/digits?min_worker=2&synchronous=true", timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    resp = requests.put(f"{management_url}/models/digits/2.0/set-default", timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert plane.management_calls == [("scale", "digits", None, 2, 2), ("set_default", "digits", "2.0")]


def test_register_from_url_is_always_refused(plane: FakePlane, management_url: str) -> None:
    """TorchServe's answer to a URL no allowed_urls pattern matches: 404 ModelNotFoundException;
    Mariner allows none, and never fetches one."""
    plane.management_enabled = True
    for url in ["https://example.com/digits.mar", "file:///etc/passwd", "s3://bucket/x.mar"]:
        resp = requests.post(f"{management_url}/models", params={"url": url}, timeout=TIMEOUT)
        body = assert_error(resp, 404, Code.NOT_FOUND)
        assert body["message"] == f"Given URL {url} does not match any allowed URL(s)"
    resp = requests.post(f"{management_url}/models", json={"url": "http://x/y.mar"}, timeout=TIMEOUT)
    assert_error(resp, 404, Code.NOT_FOUND)
    assert plane.management_calls == []


def test_register_when_enabled(plane: FakePlane, management_url: str) -> None:
    plane.management_enabled = True
    resp = requests.post(
        f"{management_url}/models",
        params={"url": "fresh.mar", "batch_size": "4", "max_batch_delay": "10", "initial_workers": "2"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "status": 'Model "fresh" Version: 3.0 registered with 1 initial workers'
    }  # READY ones
    assert plane.management_calls == [
        (
            "register",
            "fresh.mar",
            {"batch_size": 4, "max_batch_delay_ms": 10.0, "min_workers": 2, "max_workers": 2},
        )
    ]
    (entry,) = requests.get(f"{management_url}/models/fresh", timeout=TIMEOUT).json()
    assert entry["loadedAtStartup"] is False

    # TorchServe's register parameters, read as it reads them: the handler replaces the manifest's,
    # a value that is no number is "not given", an unknown parameter is ignored; no worker count
    # registers the model with none, answered at once (200) even when asynchronous.
    plane.management_calls.clear()
    resp = requests.post(
        f"{management_url}/models",
        params={
            "url": "x.mar",
            "handler": "h.py",
            "batch_size": "two",
            "startup_timeout": "0",
            "synchronous": "-1",
            "number_gpu": "1",
        },  # fmt: skip
        timeout=TIMEOUT,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "status": 'Model "x" Version: 3.0 registered with 0 initial workers. '
        "Use scale workers API to add workers for the model."
    }
    assert plane.management_calls == [
        ("register", "x.mar", {"synchronous": False, "startup_timeout_s": 0.0, "handler": "h.py"})
    ]
    resp = requests.post(  # with workers, synchronous=false is TorchServe's 202
        f"{management_url}/models",
        params={"url": "y.mar", "initial_workers": "1", "synchronous": "false"},
        timeout=TIMEOUT,
    )
    assert resp.status_code == 202, resp.text
    body = assert_error(
        requests.post(f"{management_url}/models", timeout=TIMEOUT), 400, Code.INVALID_ARGUMENT
    )
    assert body["message"] == "Parameter url is required."


def test_scale_unregister_set_default_when_enabled(plane: FakePlane, management_url: str) -> None:
    plane.management_enabled = True
    resp = requests.put(
        f"{management_url}/models/digits?min_worker=2&max_worker=3&synchronous=true", timeout=TIMEOUT
    )
    assert resp.json() == {"status": "Workers scaled to 2 for model: digits"}
    resp = requests.put(f"{management_url}/models/digits?min_worker=3&max_worker=2", timeout=TIMEOUT)
    assert_error(resp, 400, Code.INVALID_ARGUMENT)
    resp = requests.put(f"{management_url}/models/digits/2.0/set-default", timeout=TIMEOUT)
    assert resp.json() == {"status": 'Default version successfully updated for model "digits" to "2.0"'}
    resp = requests.delete(f"{management_url}/models/digits/2.0", timeout=TIMEOUT)
    assert resp.json() == {"status": 'Model "digits" unregistered'}
    assert plane.management_calls == [
        ("scale", "digits", None, 2, 3),
        ("set_default", "digits", "2.0"),
        ("unregister", "digits", "2.0"),
    ]


def test_inference_paths_may_end_in_a_slash(plane: FakePlane, inference_url: str) -> None:
    """As on TorchServe, `/predictions/m/` is `/predictions/m` (on the fast path too), and so on
    for every inference route."""
    plane.answer = _echo_version
    for path, version in (("/predictions/digits/", None), ("/predictions/digits/2.0//", "2.0")):
        resp = requests.post(f"{inference_url}{path}", data=b"1", timeout=TIMEOUT)
        assert resp.status_code == 200, (path, resp.text)
        assert resp.json() == {"version": version}
    assert requests.get(f"{inference_url}/ping/", timeout=TIMEOUT).json() == {"status": "Healthy"}


async def _echo_version(req: InferRequest) -> InferResult:
    return InferResult(body=json.dumps({"version": req.version}).encode())


def test_management_paths_may_end_in_a_slash(plane: FakePlane, management_url: str) -> None:
    """TorchServe's router drops trailing slashes: `DELETE /models/m/?synchronous=true` works."""
    plane.management_enabled = True
    resp = requests.delete(f"{management_url}/models/digits/?synchronous=true&timeout=true", timeout=TIMEOUT)
    assert resp.json() == {"status": 'Model "digits" unregistered'}
    resp = requests.get(f"{management_url}/models/digits/2.0//", timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert resp.json()[0]["modelVersion"] == "2.0"
    assert requests.get(f"{management_url}/models/", timeout=TIMEOUT).json()["models"]
    resp = requests.put(f"{management_url}/models/digits/2.0/set-default/", timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    assert plane.management_calls == [("unregister", "digits", None), ("set_default", "digits", "2.0")]


def test_scale_reads_its_values_as_torchserve_does(
    plane: FakePlane, management_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """min_worker that is no number is 1 (getIntParameter); 0 scales to no worker (202 unless
    synchronous); number_gpu and timeout are not TorchServe's scale parameters. A value TorchServe
    reads silently as something else is named in one warning."""
    url = f"{management_url}/models/digits"
    with caplog.at_level(logging.WARNING, logger="mariner.http"):
        assert requests.put(f"{url}?min_worker=nan&synchronous=nan", timeout=TIMEOUT).status_code == 202
    said = [r.getMessage() for r in caplog.records if r.name == "mariner.http"]
    assert said == [
        "parameter min_worker='nan' is not an integer (TorchServe accepts it): using 1 instead",
        "parameter synchronous='nan' is not true or false (TorchServe accepts it): read as false",
    ]
    assert requests.put(f"{url}?min_worker=0", timeout=TIMEOUT).status_code == 202
    assert requests.put(f"{url}?number_gpu=-1&timeout=0", timeout=TIMEOUT).status_code == 202
    resp = requests.put(f"{url}?min_worker=0&synchronous=true", timeout=TIMEOUT)
    assert resp.json() == {"status": "Workers scaled to 0 for model: digits"}
    body = assert_error(requests.put(f"{url}?max_worker=-1", timeout=TIMEOUT), 400, Code.INVALID_ARGUMENT)
    assert body["message"] == "max_worker cannot be less than min_worker."
    assert plane.management_calls == [
        ("scale", "digits", None, 1, 1),
        ("scale", "digits", None, 0, 0),
        ("scale", "digits", None, 1, 1),
        ("scale", "digits", None, 0, 0),
    ]


def test_management_internal_error_is_sanitized(plane: FakePlane, management_url: str) -> None:
    def explode() -> list[ModelInfo]:
        raise RuntimeError("secret")

    plane.models = explode  # type: ignore[method-assign]
    try:
        resp = requests.get(f"{management_url}/models", timeout=TIMEOUT)
    finally:
        del plane.models
    assert_error(resp, 500, Code.INTERNAL)
    assert "secret" not in resp.text
