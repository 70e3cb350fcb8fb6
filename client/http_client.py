"""Mariner's HTTP client: TorchServe's REST API and the Open Inference Protocol's /v2 REST API.

Same methods and semantics as `GrpcClient`. OIP tensors use the binary-tensor extension by
default (a JSON header, its length in `Inference-Header-Content-Length`, then raw bytes), as
tritonclient does: no float-to-text round trip, and the bytes are exactly what the model
produced. `binary=False` sends and asks for plain JSON tensors instead.

Every call has a deadline covering its retries; UNAVAILABLE / RESOURCE_EXHAUSTED (HTTP 503,
429) and refused connections are retried per `RetryPolicy`, honouring Retry-After as a floor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import numpy as np
import requests

from mariner.client import tensors
from mariner.client.errors import MarinerError, Status, make_error, status_from_http
from mariner.client.retry import Deadline, RetryPolicy, call_with_retry
from mariner.client.types import (
    DEFAULT_HTTP_URL,
    DEFAULT_MANAGEMENT_PORT,
    DEFAULT_TIMEOUT_S,
    JSON_TYPE,
    OCTET_TYPE,
    Prediction,
    encode_payload,
    with_port,
)

TRANSPORT = "http"
HEADER_LENGTH = "Inference-Header-Content-Length"
# Connection set-up gets at most this long even under a long deadline, so a dead host fails fast
# into a retry instead of eating the whole budget.
CONNECT_TIMEOUT_S = 5.0


def _q(segment: str) -> str:
    """A model name or version as one URL path segment."""
    return quote(segment, safe="")


def _error_from_response(response: requests.Response) -> MarinerError:
    """The server's message and status from either error shape it uses.

    TorchServe's API answers `{"code", "type", "message"}`; the OIP answers `{"error": ...}`;
    anything else (a proxy's HTML page) is quoted briefly.
    """
    message, type_hint = "", None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        type_hint = body.get("type") if isinstance(body.get("type"), str) else None
        message = str(body.get("message") or body.get("error") or "")
    if not message:
        message = response.text.strip()[:500] or response.reason or f"HTTP {response.status_code}"
    status = status_from_http(response.status_code, type_hint)
    if response.status_code == 503 and type_hint is None and response.headers.get("retry-after"):
        status = Status.RESOURCE_EXHAUSTED  # the server sends Retry-After only when overloaded
    return make_error(status, message, transport=TRANSPORT, http_status=response.status_code)


class HttpClient:
    """Synchronous HTTP client with the same methods as `GrpcClient`.

    `url` is the inference API (`http://host:8080`); `management_url` defaults to the same host on
    port 8081. `timeout_s` is each call's default deadline, retries included (None: no deadline).
    """

    def __init__(
        self,
        url: str = DEFAULT_HTTP_URL,
        *,
        management_url: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        binary: bool = True,
        session: requests.Session | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        if management_url is None:
            parts = urlsplit(self.url)
            management_url = urlunsplit(
                parts._replace(netloc=with_port(parts.netloc, DEFAULT_MANAGEMENT_PORT), path="")
            )
        self.management_url = management_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.binary = binary
        self._session = session or requests.Session()

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------
    def _request(
        self,
        what: str,
        method: str,
        url: str,
        timeout_s: float | None,
        *,
        ok: Callable[[requests.Response], bool] = lambda r: r.ok,
        retry: bool = True,
        **kwargs: Any,
    ) -> requests.Response:
        """One logical call: attempts under one deadline, errors mapped to MarinerError once."""
        limit = self.timeout_s if timeout_s is None else timeout_s

        def attempt(left: float | None) -> requests.Response:
            timeout = None if left is None else (min(CONNECT_TIMEOUT_S, left), left)
            try:
                response = self._session.request(method, url, timeout=timeout, **kwargs)
            except requests.Timeout:
                raise make_error(
                    Status.DEADLINE_EXCEEDED,
                    f"{what}: no answer within {limit:g}s (deadline exceeded)",
                    transport=TRANSPORT,
                ) from None
            except requests.ConnectionError as exc:
                raise make_error(
                    Status.UNAVAILABLE, f"{what}: cannot reach {url}: {exc}", transport=TRANSPORT
                ) from None
            if ok(response):
                return response
            err = _error_from_response(response)
            hint = response.headers.get("retry-after", "")
            if hint.isdigit():
                err.retry_after_s = float(hint)
            raise err

        policy = self.retry if retry else RetryPolicy(max_attempts=1)
        return call_with_retry(attempt, policy, Deadline(limit), transport=TRANSPORT, what=what)

    def _probe(self, what: str, url: str, timeout_s: float | None) -> bool:
        """GET a health endpoint: 200 -> True; not reachable, 404 or 503 -> False."""
        try:
            self._request(what, "GET", url, timeout_s, retry=False)
        except MarinerError as err:
            if err.status in (Status.UNAVAILABLE, Status.RESOURCE_EXHAUSTED, Status.NOT_FOUND):
                return False
            raise
        return True

    def _model_path(self, model: str, version: str | None) -> str:
        path = f"{self.url}/v2/models/{_q(model)}"
        return f"{path}/versions/{_q(version)}" if version else path

    # -- TorchServe API ------------------------------------------------------------------------
    def predict(
        self, model: str, data: Any, *, version: str | None = None, timeout_s: float | None = None
    ) -> Prediction:
        """POST /predictions/{model}[/{version}] with `data` (bytes, str or a JSON-able value)."""
        body, content_type = encode_payload(data)
        url = f"{self.url}/predictions/{_q(model)}" + (f"/{_q(version)}" if version else "")
        response = self._request(
            f"predict {model}", "POST", url, timeout_s, data=body, headers={"Content-Type": content_type}
        )
        return Prediction(response.content, response.headers.get("content-type"))

    def list_models(self, *, timeout_s: float | None = None) -> list[str]:
        """Names of the registered models (default versions), following the management API's pages."""
        names: list[str] = []
        token = 0
        while True:
            response = self._request(
                "list models",
                "GET",
                f"{self.management_url}/models",
                timeout_s,
                params={"limit": 100, "next_page_token": token},
            )
            page = response.json()
            entries = page.get("models") or []
            names.extend(str(e["modelName"]) for e in entries)
            next_token = page.get("nextPageToken")
            if not entries or next_token is None:
                return names
            token = int(next_token)

    # -- Open Inference Protocol ---------------------------------------------------------------
    def health(self, *, timeout_s: float | None = None) -> bool:
        """Server liveness (GET /v2/health/live). False when the server cannot be reached."""
        return self._probe("server live", f"{self.url}/v2/health/live", timeout_s)

    def ready(
        self, model: str | None = None, *, version: str | None = None, timeout_s: float | None = None
    ) -> bool:
        """Server readiness, or one model's; False (not an error) when unreachable or unknown."""
        if model is None:
            return self._probe("server ready", f"{self.url}/v2/health/ready", timeout_s)
        return self._probe(f"model ready {model}", f"{self._model_path(model, version)}/ready", timeout_s)

    def metadata(
        self, model: str | None = None, *, version: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """GET /v2 (server) or /v2/models/{model}[/versions/{v}] (signature), as JSON."""
        if model is None:
            return self._request("server metadata", "GET", f"{self.url}/v2", timeout_s).json()
        return self._request(
            f"model metadata {model}", "GET", self._model_path(model, version), timeout_s
        ).json()

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        outputs: Sequence[str] | None = None,
        version: str | None = None,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """POST /v2/models/{model}/infer: input name -> array in, output name -> array out."""
        header: dict[str, Any] = {}
        if request_id:
            header["id"] = request_id
        arrays = {name: tensors.as_input(name, value) for name, value in inputs.items()}
        header["inputs"] = []
        blobs: list[bytes] = []
        for name, arr in arrays.items():
            entry: dict[str, Any] = {
                "name": name,
                "shape": list(arr.shape),
                "datatype": tensors.datatype_of(arr),
            }
            if self.binary:
                blob = tensors.to_raw(arr)
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = tensors.to_list(arr)
            header["inputs"].append(entry)
        if outputs:
            header["outputs"] = [
                {"name": name, "parameters": {"binary_data": self.binary}} for name in outputs
            ]
        elif self.binary:
            header["parameters"] = {"binary_data_output": True}
        head = json.dumps(header).encode("utf-8")
        if self.binary:
            body = b"".join([head, *blobs])
            headers = {"Content-Type": OCTET_TYPE, HEADER_LENGTH: str(len(head))}
        else:
            body, headers = head, {"Content-Type": JSON_TYPE}
        response = self._request(
            f"infer {model}",
            "POST",
            f"{self._model_path(model, version)}/infer",
            timeout_s,
            data=body,
            headers=headers,
        )
        return _decode_infer_response(response)


def _decode_infer_response(response: requests.Response) -> dict[str, np.ndarray]:
    """Outputs from a JSON answer or a binary-extension answer (JSON header, then raw tensors)."""
    content = response.content
    header_len = response.headers.get(HEADER_LENGTH)
    if header_len is not None:
        n = int(header_len)
        header, binary = json.loads(content[:n]), memoryview(content)[n:]
    else:
        header, binary = json.loads(content), memoryview(b"")
    result: dict[str, np.ndarray] = {}
    offset = 0
    for out in header.get("outputs", []):
        name, datatype, shape = out["name"], out["datatype"], out["shape"]
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if offset + int(size) > len(binary):
                raise make_error(
                    Status.INTERNAL,
                    f"output {name!r}: binary data is shorter than its declared {size} bytes",
                    transport=TRANSPORT,
                )
            result[name] = tensors.from_raw(bytes(binary[offset : offset + int(size)]), datatype, shape, name)
            offset += int(size)
        else:
            result[name] = tensors.from_list(out.get("data", []), datatype, shape, name)
    return result
