"""Mariner's gRPC client: TorchServe's InferenceAPIsService and the Open Inference Protocol.

One channel to the inference port carries both APIs (Mariner serves them on the same port);
`list_models` uses TorchServe's management service on the management port. Every call has a
deadline (the client's default unless given) that covers its retries, and UNAVAILABLE /
RESOURCE_EXHAUSTED are retried per `RetryPolicy`. Failures are `mariner.client.errors.MarinerError`s.

Stubs come from `mariner.server._proto` (generated from proto/ at build time). The OIP stubs are imported
only when an OIP method is first used, so the TorchServe API works without them.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeVar

import grpc
import numpy as np

from mariner.client import tensors
from mariner.client.errors import MarinerError, Status, make_error, status_from_grpc_name
from mariner.client.retry import Deadline, RetryPolicy, call_with_retry
from mariner.client.types import (
    DEFAULT_GRPC_MANAGEMENT_PORT,
    DEFAULT_GRPC_TARGET,
    DEFAULT_TIMEOUT_S,
    Prediction,
    encode_payload,
    with_port,
)
from mariner.server.contracts.tensors import CONTENTS_FIELD

T = TypeVar("T")
TRANSPORT = "grpc"
# Digits requests are tiny, but a batch of big tensors is not: raise gRPC's 4 MiB default.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How the TorchServe API names the handler's input (the handler reads "data" or "body").
PREDICT_INPUT_KEY = "data"

# `contents` field of InferTensorContents per datatype, for servers that answer without raw bytes.


def _stubs(module: str) -> ModuleType:
    try:
        return importlib.import_module(f"mariner.server._proto.{module}")
    except ImportError as exc:
        raise ImportError(
            f"gRPC stubs mariner.server._proto.{module} are not generated ({exc}); "
            "run `python -m mariner.server.protogen` (or `make protos`)"
        ) from None


def _list_page(stub: Any, request: Any, left: float | None) -> Any:
    """One ListModels page within `left` seconds (bound per page with functools.partial)."""
    return stub.ListModels(request, timeout=left)


def _error(exc: grpc.RpcError, what: str, timeout_s: float | None) -> MarinerError:
    """A grpc failure as a MarinerError that keeps the server's message."""
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    status = status_from_grpc_name(code.name)
    if status is Status.DEADLINE_EXCEEDED:
        limit = f"within {timeout_s:g}s " if timeout_s is not None else ""
        details = f"{what}: no answer {limit}(deadline exceeded){': ' + details if details else ''}"
    elif not details:
        details = f"{what} failed"
    return make_error(status, details, transport=TRANSPORT)


class GrpcClient:
    """Synchronous gRPC client with the same methods as `HttpClient`.

    `target` is the inference address (`host:7070`); `management_target` defaults to the same
    host on port 7071. `timeout_s` is each call's default deadline, retries included (None: no
    deadline). Use as a context manager, or call `close()`, to release the channels.
    """

    def __init__(
        self,
        target: str = DEFAULT_GRPC_TARGET,
        *,
        management_target: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self.management_target = management_target or with_port(target, DEFAULT_GRPC_MANAGEMENT_PORT)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._channel = grpc.insecure_channel(target, options=options)
        self._mgmt_channel: grpc.Channel | None = None
        self._options = options
        self._ts: Any = None
        self._oip: Any = None
        self._mgmt: Any = None
        self._oip_pb: ModuleType | None = None

    # -- plumbing ------------------------------------------------------------------------------
    def close(self) -> None:
        self._channel.close()
        if self._mgmt_channel is not None:
            self._mgmt_channel.close()

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ts_stub(self) -> tuple[ModuleType, Any]:
        pb = _stubs("torchserve.inference_pb2")
        if self._ts is None:
            self._ts = _stubs("torchserve.inference_pb2_grpc").InferenceAPIsServiceStub(self._channel)
        return pb, self._ts

    def _oip_stub(self) -> tuple[ModuleType, Any]:
        if self._oip is None:
            self._oip_pb = _stubs("inference.grpc_service_pb2")
            self._oip = _stubs("inference.grpc_service_pb2_grpc").GRPCInferenceServiceStub(self._channel)
        assert self._oip_pb is not None
        return self._oip_pb, self._oip

    def _mgmt_stub(self) -> tuple[ModuleType, Any]:
        pb = _stubs("torchserve.management_pb2")
        if self._mgmt is None:
            self._mgmt_channel = grpc.insecure_channel(self.management_target, options=self._options)
            self._mgmt = _stubs("torchserve.management_pb2_grpc").ManagementAPIsServiceStub(
                self._mgmt_channel
            )
        return pb, self._mgmt

    def _call(
        self, what: str, rpc: Callable[[float | None], T], timeout_s: float | None, *, retry: bool = True
    ) -> T:
        """Run `rpc(seconds_left)` under one deadline with the retry policy; errors mapped once."""
        limit = self.timeout_s if timeout_s is None else timeout_s

        def attempt(left: float | None) -> T:
            try:
                return rpc(left)
            except grpc.RpcError as exc:
                raise _error(exc, what, limit) from None

        policy = self.retry if retry else RetryPolicy(max_attempts=1)
        return call_with_retry(attempt, policy, Deadline(limit), transport=TRANSPORT, what=what)

    # -- TorchServe API ------------------------------------------------------------------------
    def predict(
        self, model: str, data: Any, *, version: str | None = None, timeout_s: float | None = None
    ) -> Prediction:
        """TorchServe `Predictions`: `data` (bytes, str, or a JSON-able value) as the handler's input."""
        pb, stub = self._ts_stub()
        body, _ = encode_payload(data)
        request = pb.PredictionsRequest(
            model_name=model, model_version=version or "", input={PREDICT_INPUT_KEY: body}
        )
        answer = self._call(
            f"predict {model}", lambda left: stub.Predictions(request, timeout=left), timeout_s
        )
        return Prediction(bytes(answer.prediction))

    def list_models(self, *, timeout_s: float | None = None) -> list[str]:
        """Names of the registered models (default versions), following the management API's pages."""
        pb, stub = self._mgmt_stub()
        names: list[str] = []
        token = 0
        while True:
            request = pb.ListModelsRequest(limit=100, next_page_token=token)
            answer = self._call("list models", functools.partial(_list_page, stub, request), timeout_s)
            page = json.loads(answer.msg)
            entries = page.get("models") or []
            names.extend(str(e["modelName"]) for e in entries)
            next_token = page.get("nextPageToken")
            if not entries or next_token is None:
                return names
            token = int(next_token)

    # -- Open Inference Protocol ---------------------------------------------------------------
    def health(self, *, timeout_s: float | None = None) -> bool:
        """Server liveness (OIP ServerLive). False when the server cannot be reached."""
        pb, stub = self._oip_stub()
        try:
            answer = self._call(
                "server live",
                lambda left: stub.ServerLive(pb.ServerLiveRequest(), timeout=left),
                timeout_s,
                retry=False,
            )
        except MarinerError as err:
            if err.status is Status.UNAVAILABLE:
                return False
            raise
        return bool(answer.live)

    def ready(
        self, model: str | None = None, *, version: str | None = None, timeout_s: float | None = None
    ) -> bool:
        """Server readiness, or one model's (OIP ServerReady / ModelReady).

        False, not an error, when the server cannot be reached or the model is unknown, so a
        readiness poll can loop on it while a server starts or a model registers.
        """
        pb, stub = self._oip_stub()
        if model is None:
            request: Any = pb.ServerReadyRequest()
            rpc, what = stub.ServerReady, "server ready"
        else:
            request = pb.ModelReadyRequest(name=model, version=version or "")
            rpc, what = stub.ModelReady, f"model ready {model}"
        try:
            answer = self._call(what, lambda left: rpc(request, timeout=left), timeout_s, retry=False)
        except MarinerError as err:
            if err.status in (Status.UNAVAILABLE, Status.NOT_FOUND):
                return False
            raise
        return bool(answer.ready)

    def metadata(
        self, model: str | None = None, *, version: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Server metadata, or a model's signature, as the REST API's JSON shape (same for both clients)."""
        pb, stub = self._oip_stub()
        if model is None:
            s = self._call(
                "server metadata",
                lambda left: stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=left),
                timeout_s,
            )
            return {"name": s.name, "version": s.version, "extensions": list(s.extensions)}
        request = pb.ModelMetadataRequest(name=model, version=version or "")
        m = self._call(
            f"model metadata {model}", lambda left: stub.ModelMetadata(request, timeout=left), timeout_s
        )

        def tensor(t: Any) -> dict[str, Any]:
            return {"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]}

        return {
            "name": m.name,
            "versions": list(m.versions),
            "platform": m.platform,
            "inputs": [tensor(t) for t in m.inputs],
            "outputs": [tensor(t) for t in m.outputs],
        }

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
        """OIP ModelInfer: input name -> array in, output name -> array out (all, or `outputs`).

        Inputs travel as `raw_input_contents` (the fast path tritonclient uses); each array's
        dtype decides its datatype, so pass float32 for an FP32 input.
        """
        pb, stub = self._oip_stub()
        request = pb.ModelInferRequest(model_name=model, model_version=version or "", id=request_id)
        for name, value in inputs.items():
            arr = tensors.as_input(name, value)
            request.inputs.add(name=name, datatype=tensors.datatype_of(arr), shape=list(arr.shape))
            request.raw_input_contents.append(tensors.to_raw(arr))
        for name in outputs or ():
            request.outputs.add(name=name)
        answer = self._call(f"infer {model}", lambda left: stub.ModelInfer(request, timeout=left), timeout_s)
        return self._decode_outputs(answer)

    @staticmethod
    def _decode_outputs(answer: Any) -> dict[str, np.ndarray]:
        result: dict[str, np.ndarray] = {}
        raw = list(answer.raw_output_contents)
        for i, out in enumerate(answer.outputs):
            shape = [int(d) for d in out.shape]
            if raw:
                if i >= len(raw):
                    raise make_error(
                        Status.INTERNAL,
                        f"server answered {len(answer.outputs)} outputs but {len(raw)} raw contents",
                        transport=TRANSPORT,
                    )
                result[out.name] = tensors.from_raw(raw[i], out.datatype, shape, out.name)
            else:
                field = CONTENTS_FIELD.get(out.datatype)
                if field is None:
                    raise make_error(
                        Status.INTERNAL,
                        f"output {out.name!r}: {out.datatype} has no `contents` field; expected raw bytes",
                        transport=TRANSPORT,
                    )
                values = list(getattr(out.contents, field))
                result[out.name] = tensors.from_list(values, out.datatype, shape, out.name)
        return result
