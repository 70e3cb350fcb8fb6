"""Locust users for Mariner (and stock TorchServe): one user class per wire protocol.

    locust -f loadtest/locustfile.py --headless -u 16 -r 16 -t 30s \\
        --host http://127.0.0.1:8080 --grpc-target 127.0.0.1:7070 --model digits_torchscript \\
        --p99-ms 50 --max-fail-ratio 0.01 --csv build/loadtest/stats --html build/loadtest/report.html

`make loadtest` wraps this (see `python -m mariner.loadtest.gate --help`): it starts Mariner, runs the
command above against it and stops it again.

- `TorchServeGrpcUser`: TorchServe's gRPC `Predictions`, built the way locust documents gRPC
  users: gRPC is made gevent-cooperative (`grpc.experimental.gevent.init_gevent()`, before any
  channel exists) and a client interceptor fires locust's `request` event for every call, so
  gRPC calls land in the same statistics, CSV and HTML report as HTTP requests.
- `PredictionsHttpUser`: `POST /predictions/{model}` over HTTP/1.1 keep-alive (FastHttpUser).
- `OipGrpcUser`: the Open Inference Protocol's gRPC `ModelInfer` (package `inference`), one
  digit per call as a raw FP32 `pixels` tensor.
- `OipHttpUser`: the Open Inference Protocol's REST `POST /v2/models/{model}/infer`, JSON tensors.

`mariner.loadtest.gate.USER_CLASS_NAMES` maps `--protocols` names to these classes.

Every request carries a real digit from the held-out test split (`mariner.loadtest.payloads`), picked
at random per request, and an answer only counts as a success when it is a prediction (a
`label` in 0..9; for OIP, a `label` tensor that is the argmax of the `logits` tensor, see
`mariner.loadtest.oip`): a server answering 200 with garbage fails the run. The payloads are
prepared on locust's `init` event, before any run clock starts.

The p99 gate (`mariner.loadtest.gate`) is installed on locust's `quitting` event: the process exits
non-zero when p99 exceeds `--p99-ms` or the failure ratio exceeds `--max-fail-ratio`.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, ClassVar

# Import order matters: importing locust monkey-patches the standard library for gevent, and
# gRPC must then be switched to gevent before any channel is created, or a blocking call would
# stall every user in the process.
import gevent
from locust import FastHttpUser, User, events, task
from locust.env import Environment

import grpc  # isort: skip
import grpc.experimental.gevent as grpc_gevent  # isort: skip

import numpy as np

from mariner.loadtest import gate, oip
from mariner.loadtest.payloads import test_digit_bodies, test_digits

grpc_gevent.init_gevent()

DEFAULT_MODEL = "digits_torchscript"
GRPC_TIMEOUT_S = 10.0
HTTP_TIMEOUT_S = 10.0


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any, **_kw: Any) -> None:
    """Our options; they show in `locust --help` and in the web UI, and can come from env/config."""
    parser.add_argument(
        "--grpc-target",
        default="127.0.0.1:7070",
        help="host:port of the TorchServe gRPC inference API (the HTTP side uses --host)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name to send requests to")
    gate.add_arguments(parser)


gate.install(events)


# -- payloads ----------------------------------------------------------------------------------
@cache
def _bodies() -> tuple[bytes, ...]:
    return test_digit_bodies()


@cache
def _pixels() -> np.ndarray:
    return test_digits()[0]


@cache
def _oip_rest_bodies() -> tuple[bytes, ...]:
    return tuple(oip.rest_body(row) for row in _pixels())


def prepare_payloads() -> None:
    """Build every user's payloads now (seconds: imports torch and scikit-learn, rebuilds the split).

    Runs on locust's `init` event, which fires once per process before any run starts and before
    the CLI's `--run-time` clock: done on `test_start` instead, the work would block the gevent
    hub after the clock started, and a short run would complete nothing.
    """
    _bodies()
    _oip_rest_bodies()


@events.init.add_listener
def _load_payloads(**_kw: Any) -> None:
    prepare_payloads()
    # That work blocked the gevent hub for seconds, and libev only reads the clock when its loop
    # runs: a timer set next (the CLI's --run-time) would count from before the work and fire at
    # once, ending the run after a handful of requests. Read the clock now.
    gevent.get_hub().loop.update_now()


def check_prediction(body: bytes) -> None:
    """Raise ValueError unless `body` is the handler's answer: {"label": 0..9, "topk": [...]}."""
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"answer is not JSON: {body[:80]!r}") from exc
    label = answer.get("label") if isinstance(answer, dict) else None
    if not isinstance(label, int) or not 0 <= label <= 9:
        raise ValueError(f"answer is not a digit prediction: {body[:80]!r}")


# -- gRPC, the way locust documents it ---------------------------------------------------------
@cache
def _torchserve_stubs() -> Any:
    from mariner.server import protogen

    protogen.generate()  # a no-op when the stubs are fresh
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    return inference_pb2, inference_pb2_grpc


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Fires locust's `request` event for every unary call: timing, size, and the error if any.

    `check` turns a wrong answer (an OK status with a bad body) into a failure too. The
    exception is reported here, once; the calling task then ignores it.
    """

    def __init__(self, environment: Environment, check: Callable[[Any], None] | None = None) -> None:
        self.env = environment
        self.check = check

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        name = str(client_call_details.method).rsplit("/", 1)[-1]
        start = time.perf_counter()
        exception: BaseException | None = None
        response_length = 0
        call = continuation(client_call_details, request)
        try:
            response = call.result()
            response_length = response.ByteSize()
            if self.check is not None:
                self.check(response)
        except (grpc.RpcError, ValueError) as exc:
            exception = exc
        self.env.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1e3,
            response_length=response_length,
            response=call,
            context=None,
            exception=exception,
        )
        return call


class GrpcUser(User):
    """A locust user holding one gRPC channel (with the interceptor) and a stub on it.

    Subclasses set `stub_class` (or override `make_stub`, to import generated stubs lazily)
    and, optionally, `check_response`.
    """

    abstract = True
    stub_class: ClassVar[Any] = None

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        target = environment.parsed_options.grpc_target if environment.parsed_options else None
        if not target:
            raise ValueError("--grpc-target is required for gRPC users")
        self._raw_channel = grpc.insecure_channel(target)
        channel = grpc.intercept_channel(
            self._raw_channel, LocustInterceptor(environment, check=self.check_response)
        )
        self.stub = self.make_stub(channel)

    def make_stub(self, channel: grpc.Channel) -> Any:
        if self.stub_class is None:
            raise ValueError(f"{type(self).__name__} must set stub_class or override make_stub")
        return self.stub_class(channel)

    def check_response(self, response: Any) -> None:
        """Raise ValueError when an OK response is not a valid answer; default: accept."""

    def on_stop(self) -> None:
        self._raw_channel.close()


class TorchServeGrpcUser(GrpcUser):
    """TorchServe gRPC `Predictions` with a random test-set digit per call."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._pb2 = _torchserve_stubs()[0]
        self.model = environment.parsed_options.model if environment.parsed_options else DEFAULT_MODEL

    def make_stub(self, channel: grpc.Channel) -> Any:
        return _torchserve_stubs()[1].InferenceAPIsServiceStub(channel)

    def check_response(self, response: Any) -> None:
        check_prediction(response.prediction)

    @task
    def predictions(self) -> None:
        body = random.choice(_bodies())
        request = self._pb2.PredictionsRequest(model_name=self.model, input={"data": body})
        with contextlib.suppress(grpc.RpcError):  # already reported to locust by the interceptor
            self.stub.Predictions(request, timeout=GRPC_TIMEOUT_S)


class _JsonPostUser(FastHttpUser):
    """POSTs a random prepared JSON body to one path per user and checks every answer's content."""

    abstract = True
    network_timeout = HTTP_TIMEOUT_S
    connection_timeout = HTTP_TIMEOUT_S

    def path_for(self, model: str) -> str:
        raise NotImplementedError

    def bodies(self) -> Sequence[bytes]:
        raise NotImplementedError

    def check(self, content: bytes) -> None:
        """Raise ValueError when the answer is not a correct prediction."""
        raise NotImplementedError

    def on_start(self) -> None:
        model = self.environment.parsed_options.model if self.environment.parsed_options else DEFAULT_MODEL
        self.path = self.path_for(model)

    @task
    def post(self) -> None:
        with self.client.post(
            self.path,
            data=random.choice(self.bodies()),
            headers={"Content-Type": "application/json"},
            catch_response=True,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:120]}")
                return
            try:
                self.check(resp.content or b"")
            except ValueError as exc:
                resp.failure(str(exc))


class PredictionsHttpUser(_JsonPostUser):
    """TorchServe REST `POST /predictions/{model}` with a random test-set digit per request."""

    def path_for(self, model: str) -> str:
        return f"/predictions/{model}"

    def bodies(self) -> Sequence[bytes]:
        return _bodies()

    def check(self, content: bytes) -> None:
        check_prediction(content)


class OipGrpcUser(GrpcUser):
    """Open Inference Protocol gRPC `ModelInfer` with a random test-set digit per call."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self._pb2 = oip.grpc_messages()[0]
        self.model = environment.parsed_options.model if environment.parsed_options else DEFAULT_MODEL
        # Requests are built once per user: the timed part is the call, not protobuf assembly.
        self._requests = [oip.grpc_request(self._pb2, self.model, row) for row in _pixels()]

    def make_stub(self, channel: grpc.Channel) -> Any:
        return oip.grpc_messages()[1].GRPCInferenceServiceStub(channel)

    def check_response(self, response: Any) -> None:
        oip.label_from_grpc(response)

    @task
    def model_infer(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # already reported to locust by the interceptor
            self.stub.ModelInfer(random.choice(self._requests), timeout=GRPC_TIMEOUT_S)


class OipHttpUser(_JsonPostUser):
    """Open Inference Protocol REST `POST /v2/models/{model}/infer` with a random test-set digit."""

    def path_for(self, model: str) -> str:
        return oip.infer_path(model)

    def bodies(self) -> Sequence[bytes]:
        return _oip_rest_bodies()

    def check(self, content: bytes) -> None:
        oip.label_from_rest(content)
