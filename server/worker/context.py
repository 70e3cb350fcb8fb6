"""A TorchServe-shaped handler Context that needs no `ts` package.

Handlers written for TorchServe read `context.system_properties`, `context.manifest` and
`context.model_yaml_config`, and per request call `get_request_header`,
`set_response_status` and `set_response_content_type`, and record metrics through
`context.metrics` (TorchServe's metrics API, served on /metrics under the handler's names).
A streaming handler passes the Context to `ts.handler_utils.utils.send_intermediate_predict_response`,
which writes to `context.cl_socket`: here an `IntermediateChannel` that hands each part to
whoever runs the handler (`worker.intermediate`).
This class offers the same surface so the same archive runs unchanged on stock TorchServe and
on Mariner (and in our verification harness).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mariner.server.common.handler_metrics import HandlerMetrics
from mariner.server.worker.intermediate import Deliver, IntermediateChannel


@dataclass
class ResponseMeta:
    """What a handler said about one response: status, reason and headers."""

    status: int = 200
    phrase: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class Context:
    """Per model instance; `begin_batch` resets the per-request parts before each handle()."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: Mapping[str, Any],
        *,
        batch_size: int,
        gpu_id: int | None,
        model_yaml_config: Mapping[str, Any] | None = None,
        server_version: str = "mariner",
    ) -> None:
        self.model_name = model_name
        self.manifest = dict(manifest)
        self.model_yaml_config = dict(model_yaml_config or {})
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu_id,
            "batch_size": batch_size,
            "server_name": "Mariner",
            "server_version": server_version,
            "limit_max_image_pixels": True,
        }
        # TorchServe's `context.metrics` API; the metrics appear on /metrics (see the module).
        self.metrics: Any = HandlerMetrics(model_name)
        self.stopping_criteria = None
        # TorchServe's sequence-batching header names, from the same environment variables.
        self.header_key_sequence_id = os.getenv("TS_REQUEST_SEQUENCE_ID", "ts_request_sequence_id")
        self.header_key_sequence_start = os.getenv("TS_REQUEST_SEQUENCE_START", "ts_request_sequence_start")
        self.header_key_sequence_end = os.getenv("TS_REQUEST_SEQUENCE_END", "ts_request_sequence_end")
        self.request_ids: dict[int, str] = {}
        self._request_headers: list[dict[str, str]] = []
        self._responses: list[ResponseMeta] = []
        # What TorchServe's send_intermediate_predict_response writes to; its `deliver` is set
        # by whoever runs the handler (a worker: to the frontend, ahead of the final result).
        self.cl_socket = IntermediateChannel()

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    # -- per batch ------------------------------------------------------------------------
    def begin_batch(self, request_ids: Sequence[str], headers: Sequence[Mapping[str, str]]) -> None:
        self.request_ids = dict(enumerate(request_ids))
        self._request_headers = [{k.lower(): v for k, v in h.items()} for h in headers]
        self._responses = [ResponseMeta() for _ in request_ids]

    def for_call(
        self, request_ids: Sequence[str], headers: Sequence[Mapping[str, str]], deliver: Deliver | None
    ) -> Context:
        """A Context for one of several handler calls running at once (a coroutine handler):
        the instance's properties, manifest and metrics shared, the per-request parts and the
        intermediate channel its own, as TorchServe's async worker copies its Context per batch."""
        call = copy.copy(self)
        call.begin_batch(request_ids, headers)
        call.cl_socket = IntermediateChannel(deliver)
        return call

    def response_meta(self, idx: int) -> ResponseMeta:
        return self._responses[idx]

    # -- TorchServe's per-request API -----------------------------------------------------
    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self._request_headers[idx].get(key.lower())

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return dict(self._request_headers[idx])

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        if 0 <= idx < len(self._responses):
            self._responses[idx].status = int(code)
            self._responses[idx].phrase = str(phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for idx in range(len(self._responses)):
            self.set_response_status(code, phrase, idx)

    def get_response_status(self, idx: int) -> tuple[int, str]:
        meta = self._responses[idx]
        return meta.status, meta.phrase

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, "content-type", value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.get_response_headers(idx).get("content-type")

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        if 0 <= idx < len(self._responses):
            self._responses[idx].headers[key.lower()] = str(value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return dict(self._responses[idx].headers)

    def get_sequence_id(self, idx: int) -> str | None:
        """TorchServe's sequence-batching id header (`ts_request_sequence_id`)."""
        return self.get_request_header(idx, self.header_key_sequence_id)

    @property
    def request_processor(self) -> list[RequestProcessor]:
        """TorchServe's per-request objects, for handlers that reach past the Context's methods."""
        return [RequestProcessor(self, i) for i in range(len(self._responses))]


class RequestProcessor:
    """`ts.context.RequestProcessor`'s surface over one request of the Context's batch."""

    def __init__(self, context: Context, idx: int) -> None:
        self._context = context
        self._idx = idx

    def get_request_property(self, key: str) -> str | None:
        return self._context.get_request_header(self._idx, key)

    def get_request_properties(self) -> dict[str, str]:
        return self._context.get_all_request_header(self._idx)

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        self._context.set_response_status(code, reason_phrase or "", self._idx)

    def get_response_status_code(self) -> int:
        return self._context.get_response_status(self._idx)[0]

    def get_response_status_phrase(self) -> str | None:
        return self._context.get_response_status(self._idx)[1] or None

    def add_response_property(self, key: str, value: str) -> None:
        self._context.set_response_header(self._idx, key, value)

    def get_response_headers(self) -> dict[str, str]:
        return self._context.get_response_headers(self._idx)

    def get_response_header(self, key: str) -> str | None:
        return self._context.get_response_headers(self._idx).get(key.lower())
