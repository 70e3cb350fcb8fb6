"""The Python client and the `mariner predict|infer` CLI against a live Mariner, plus stub servers.

Answers are judged against the eager model (predict: its label; infer: its logits). Retry and
deadline behaviour needs a server that misbehaves on purpose, so small stub servers (a real
grpc server and a real HTTP server on port 0) answer UNAVAILABLE / 503 a set number of times,
or stall, and count what reached them.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
from PIL import Image

from mariner.client import (
    DeadlineExceededError,
    GrpcClient,
    HttpClient,
    InvalidArgumentError,
    MarinerError,
    NotFoundError,
    ResourceExhaustedError,
    RetryPolicy,
    Status,
    UnavailableError,
)
from mariner.client.retry import Deadline, call_with_retry
from mariner.server import protogen
from tests.mariner_serve import MarinerServe

if TYPE_CHECKING:
    from tests.conftest import EagerReference

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MODEL = "digits_torchscript"
N_ROWS = 8
LOGIT_TOL = 1e-4
TRANSPORTS = ("grpc", "http")
Client = GrpcClient | HttpClient


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mariner(shared_digits_torchscript: MarinerServe) -> MarinerServe:
    """The session's shared server (tests/integration/conftest.py): these tests only send requests."""
    protogen.generate()
    return shared_digits_torchscript.alive()


def _make_client(mariner: MarinerServe, transport: str, **kw: Any) -> Client:
    if transport == "grpc":
        return GrpcClient(mariner.grpc_target, management_target=mariner.grpc_management_target, **kw)
    return HttpClient(mariner.http, management_url=mariner.management, **kw)


@pytest.fixture(params=TRANSPORTS)
def client(request: pytest.FixtureRequest, mariner: MarinerServe) -> Iterator[Client]:
    with _make_client(mariner, request.param, timeout_s=30.0) as c:
        yield c


def _eager_logits(ref: EagerReference, pixels: np.ndarray) -> np.ndarray:
    import torch

    from mariner.training.data import to_model_input

    with torch.inference_mode():
        return ref.model(to_model_input(np.atleast_2d(pixels), ref.norm)).float().numpy()


def _png(pixels: np.ndarray) -> bytes:
    """An 8x8 grayscale PNG of one row, light digit on dark ground like the training data."""
    img = Image.fromarray(np.round(pixels.reshape(8, 8) * 255.0 / 16.0).astype(np.uint8), mode="L")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _png_pixels(pixels: np.ndarray) -> np.ndarray:
    """What the handler decodes from `_png(pixels)`: the 8-bit quantisation, scaled back to 0..16."""
    return (np.round(pixels * 255.0 / 16.0).astype(np.uint8).astype(np.float32) * (16.0 / 255.0)).astype(
        np.float32
    )


# -- against the live server: TorchServe API ---------------------------------------------------
def test_predict_matches_the_eager_label(client: Client, eager_reference: EagerReference) -> None:
    pixels = eager_reference.test_pixels[:N_ROWS]
    expected = _eager_logits(eager_reference, pixels).argmax(axis=1)
    for row, label in zip(pixels, expected, strict=True):
        answer = client.predict(MODEL, row)  # an ndarray goes as JSON
        assert answer.json()["label"] == int(label)


def test_predict_sends_image_bytes_as_they_are(client: Client, eager_reference: EagerReference) -> None:
    row = eager_reference.test_pixels[0]
    expected = int(_eager_logits(eager_reference, _png_pixels(row)).argmax())
    assert client.predict(MODEL, _png(row)).json()["label"] == expected


def test_predict_unknown_model_is_not_found_without_retries(client: Client) -> None:
    with pytest.raises(NotFoundError) as info:
        client.predict("no_such_model", [0.0] * 64)
    err = info.value
    assert err.status is Status.NOT_FOUND
    assert "no_such_model" in err.message  # the server's own message reaches the caller
    assert err.attempts == 1  # NOT_FOUND is final: no retry
    if isinstance(client, HttpClient):
        assert err.http_status == 404


def test_predict_bad_payload_is_invalid_argument_with_the_handlers_reason(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.predict(MODEL, [1.0, 2.0, 3.0])
    assert "64" in info.value.message
    assert info.value.attempts == 1


def test_list_models_names_the_loaded_model(client: Client) -> None:
    assert client.list_models() == [MODEL]


# -- against the live server: Open Inference Protocol -------------------------------------------
def test_health_and_readiness(client: Client) -> None:
    assert client.health() is True
    assert client.ready() is True
    assert client.ready(MODEL) is True
    assert client.ready("no_such_model") is False  # polling for a model that is not there yet


def test_metadata_is_the_declared_signature_and_the_same_on_both_transports(
    mariner: MarinerServe,
) -> None:
    with _make_client(mariner, "grpc") as g, _make_client(mariner, "http") as h:
        meta = g.metadata(MODEL)
        assert meta == h.metadata(MODEL)
        assert g.metadata()["name"] == h.metadata()["name"]
    assert meta["name"] == MODEL
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    assert {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]} == {
        "logits": ("FP32", [-1, 10]),
        "probabilities": ("FP32", [-1, 10]),
        "label": ("INT64", [-1]),
    }


def test_infer_matches_the_eager_logits(client: Client, eager_reference: EagerReference) -> None:
    pixels = eager_reference.test_pixels[:N_ROWS]
    expected = _eager_logits(eager_reference, pixels)
    out = client.infer(MODEL, {"pixels": pixels}, request_id="req-1")
    assert set(out) == {"logits", "probabilities", "label"}
    assert out["logits"].dtype == np.float32
    assert out["logits"].shape == (N_ROWS, 10)
    np.testing.assert_allclose(out["logits"], expected, atol=LOGIT_TOL, rtol=0)
    assert out["label"].dtype == np.int64
    np.testing.assert_array_equal(out["label"], expected.argmax(axis=1))
    np.testing.assert_allclose(out["probabilities"].sum(axis=1), 1.0, atol=1e-5)


def test_infer_over_plain_json_tensors(mariner: MarinerServe, eager_reference: EagerReference) -> None:
    pixels = eager_reference.test_pixels[:3]
    with HttpClient(mariner.http, binary=False) as c:
        out = c.infer(MODEL, {"pixels": pixels})
    np.testing.assert_allclose(out["logits"], _eager_logits(eager_reference, pixels), atol=LOGIT_TOL, rtol=0)


def test_infer_returns_only_the_requested_outputs(client: Client, eager_reference: EagerReference) -> None:
    out = client.infer(MODEL, {"pixels": eager_reference.test_pixels[:2]}, outputs=["label"])
    assert list(out) == ["label"]
    assert out["label"].shape == (2,)


def test_infer_wrong_shape_is_invalid_argument(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.infer(MODEL, {"pixels": np.zeros((2, 63), dtype=np.float32)})
    assert "pixels" in info.value.message
    assert info.value.attempts == 1
    if isinstance(client, HttpClient):
        assert info.value.http_status == 400


def test_infer_unknown_model_is_not_found(client: Client) -> None:
    with pytest.raises(NotFoundError):
        client.infer("no_such_model", {"pixels": np.zeros((1, 64), dtype=np.float32)})


# -- retries and deadlines, against stub servers ---------------------------------------------------
FAST_RETRY = RetryPolicy(
    max_attempts=3, initial_backoff_s=0.05, max_backoff_s=1.0, multiplier=2.0, jitter=0.5
)
OK_BODY = b'{"label": 7}'


class _Script:
    """What a stub answers: `failures` times the failure, then OK; arrival times are recorded."""

    def __init__(self, failures: int, stall_s: float = 0.0) -> None:
        self.failures = failures
        self.stall_s = stall_s
        self.arrivals: list[float] = []
        self.answered = 0  # answers the stub finished (a stalled one finishes only when released)
        self.lock = threading.Lock()
        self.release = threading.Event()

    def arrive(self) -> int:
        with self.lock:
            self.arrivals.append(time.monotonic())
            return len(self.arrivals)

    def finish(self) -> None:
        with self.lock:
            self.answered += 1

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@pytest.fixture
def grpc_stub() -> Iterator[Callable[[_Script, grpc.StatusCode], str]]:
    """A real grpc server whose Predictions follows a `_Script`; yields a factory -> target."""
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    servers: list[grpc.Server] = []
    scripts: list[_Script] = []

    def start(script: _Script, failure: grpc.StatusCode) -> str:
        class Servicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
            def Predictions(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
                n = script.arrive()
                if script.stall_s:
                    script.release.wait(script.stall_s)
                script.finish()
                if n <= script.failures:
                    context.abort(failure, f"stub busy (attempt {n})")
                return inference_pb2.PredictionResponse(prediction=OK_BODY)

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        scripts.append(script)
        return f"127.0.0.1:{port}"

    yield start
    for script in scripts:
        script.release.set()
    for server in servers:
        server.stop(grace=None)


@pytest.fixture
def http_stub() -> Iterator[Callable[[_Script, int, dict[str, str]], str]]:
    """A real HTTP server whose POST /predictions/... follows a `_Script`; factory -> base URL."""
    servers: list[ThreadingHTTPServer] = []
    scripts: list[_Script] = []

    def start(script: _Script, status: int, headers: dict[str, str]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length", "0")))
                n = script.arrive()
                if script.stall_s:
                    script.release.wait(script.stall_s)
                script.finish()
                if n <= script.failures:
                    kind = "RESOURCE_EXHAUSTED" if "Retry-After" in headers else "UNAVAILABLE"
                    body = json.dumps({"code": status, "type": kind, "message": f"stub busy ({n})"}).encode()
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                else:
                    body = OK_BODY
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        scripts.append(script)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for script in scripts:
        script.release.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def _assert_backoff(script: _Script, policy: RetryPolicy) -> None:
    """Each gap is at least the jittered lower bound of its backoff step, and the steps grow."""
    for k, gap in enumerate(script.gaps(), start=1):
        cap = min(policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier ** (k - 1))
        assert gap >= cap * (1 - policy.jitter) - 0.005, (
            f"retry {k} came after {gap:.3f}s, before its backoff"
        )


@pytest.mark.parametrize("failure", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_grpc_retries_busy_answers_with_backoff_then_succeeds(grpc_stub, failure: grpc.StatusCode) -> None:
    script = _Script(failures=2)
    with GrpcClient(grpc_stub(script, failure), retry=FAST_RETRY, timeout_s=10) as c:
        assert c.predict("m", [0]).body == OK_BODY
    assert len(script.arrivals) == 3
    _assert_backoff(script, FAST_RETRY)


def test_grpc_gives_up_after_the_attempt_limit(grpc_stub) -> None:
    script = _Script(failures=100)
    with (
        GrpcClient(grpc_stub(script, grpc.StatusCode.UNAVAILABLE), retry=FAST_RETRY, timeout_s=10) as c,
        pytest.raises(UnavailableError) as info,
    ):
        c.predict("m", [0])
    assert len(script.arrivals) == FAST_RETRY.max_attempts
    assert info.value.attempts == FAST_RETRY.max_attempts
    assert "stub busy (attempt 3)" in info.value.message  # the last answer's message is kept
    assert "gave up after 3 attempts" in str(info.value)


def test_grpc_does_not_retry_a_final_error(grpc_stub) -> None:
    script = _Script(failures=100)
    with (
        GrpcClient(grpc_stub(script, grpc.StatusCode.INVALID_ARGUMENT), retry=FAST_RETRY) as c,
        pytest.raises(InvalidArgumentError),
    ):
        c.predict("m", [0])
    assert len(script.arrivals) == 1


def test_grpc_deadline_exceeded_is_a_clear_error(grpc_stub) -> None:
    script = _Script(failures=0, stall_s=300.0)  # stalls until the fixture releases it
    with (
        GrpcClient(grpc_stub(script, grpc.StatusCode.UNAVAILABLE), retry=FAST_RETRY, timeout_s=0.3) as c,
        pytest.raises(DeadlineExceededError) as info,
    ):
        c.predict("m", [0])
    assert script.answered == 0, "the client waited for the stalled answer instead of its deadline"
    assert info.value.status is Status.DEADLINE_EXCEEDED
    assert "0.3s" in info.value.message
    assert "predict m" in info.value.message
    assert len(script.arrivals) == 1  # a deadline is final: no retry


def test_grpc_unreachable_server_is_unavailable_after_retries() -> None:
    with socket_closed_port() as target, GrpcClient(target, retry=FAST_RETRY, timeout_s=5) as c:
        with pytest.raises(UnavailableError) as info:
            c.predict("m", [0])
        assert info.value.attempts == FAST_RETRY.max_attempts
        assert c.health() is False
        assert c.ready() is False


def test_http_retries_503_with_backoff_then_succeeds(http_stub) -> None:
    script = _Script(failures=2)
    with HttpClient(http_stub(script, 503, {}), retry=FAST_RETRY, timeout_s=10) as c:
        assert c.predict("m", [0]).body == OK_BODY
    assert len(script.arrivals) == 3
    _assert_backoff(script, FAST_RETRY)


def test_http_retry_after_is_a_floor_capped_by_max_backoff(http_stub) -> None:
    policy = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=0.3, jitter=0.0)
    script = _Script(failures=1)
    with HttpClient(http_stub(script, 503, {"Retry-After": "1"}), retry=policy, timeout_s=10) as c:
        assert c.predict("m", [0]).body == OK_BODY
    (gap,) = script.gaps()
    assert gap >= 0.29, "the retry came before the server's hint (capped at max_backoff_s)"
    # How long it slept, exactly, without a clock: the hint from the answer, capped.
    busy = ResourceExhaustedError(Status.RESOURCE_EXHAUSTED, "busy", transport="test")
    busy.retry_after_s = 1.0
    slept = _sleeps_for([busy], policy)
    assert slept == [0.3], "Retry-After is a floor, but never beyond max_backoff_s"
    policy_long = RetryPolicy(max_attempts=2, initial_backoff_s=0.01, max_backoff_s=5.0, jitter=0.0)
    assert _sleeps_for([busy], policy_long) == [1.0]


def _sleeps_for(
    errors: list[Exception], policy: RetryPolicy, deadline: Deadline | None = None
) -> list[float]:
    """The sleeps call_with_retry asks for when the attempts raise `errors`, then succeed."""
    slept: list[float] = []
    pending = list(errors)

    def attempt(_left: float | None) -> str:
        if pending:
            raise pending.pop(0)
        return "ok"

    assert (
        call_with_retry(
            attempt,
            policy,
            Deadline(None),
            transport="test",
            what="x",
            sleep=slept.append,
            rand=lambda: 0.0,
        )
        == "ok"
    )
    return slept


def test_http_gives_up_after_the_attempt_limit_with_the_servers_message(http_stub) -> None:
    script = _Script(failures=100)
    with (
        HttpClient(http_stub(script, 503, {"Retry-After": "0"}), retry=FAST_RETRY, timeout_s=10) as c,
        pytest.raises(ResourceExhaustedError) as info,
    ):
        c.predict("m", [0])
    assert len(script.arrivals) == FAST_RETRY.max_attempts
    err = info.value
    assert (err.http_status, err.attempts, err.message) == (503, 3, "stub busy (3)")
    assert err.retry_after_s == 0.0, "the Retry-After header reaches the error"


def test_http_deadline_exceeded_is_a_clear_error(http_stub) -> None:
    script = _Script(failures=0, stall_s=300.0)  # stalls until the fixture releases it
    with (
        HttpClient(http_stub(script, 503, {}), retry=FAST_RETRY, timeout_s=0.3) as c,
        pytest.raises(DeadlineExceededError) as info,
    ):
        c.predict("m", [0])
    assert script.answered == 0, "the client waited for the stalled answer instead of its deadline"
    assert info.value.status is Status.DEADLINE_EXCEEDED
    assert "no answer within 0.3s" in info.value.message
    assert len(script.arrivals) == 1


def test_retries_stop_at_the_deadline_not_the_attempt_limit(http_stub) -> None:
    policy = RetryPolicy(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.2, jitter=0.0)
    script = _Script(failures=100)
    with (
        HttpClient(http_stub(script, 503, {}), retry=policy, timeout_s=2.0) as c,
        pytest.raises(UnavailableError) as info,  # sleeping into the deadline would be DEADLINE_EXCEEDED
    ):
        c.predict("m", [0])
    # Every attempt but the last is followed by a 0.2 s sleep inside 2 s: at most 10, however slow.
    assert 2 <= len(script.arrivals) <= 10
    assert info.value.attempts == len(script.arrivals)


class _FakeClock:
    """Time that passes only when the code under test sleeps or an attempt says it took long."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _FakeDeadline(Deadline):
    def __init__(self, timeout_s: float, clock: _FakeClock) -> None:
        super().__init__(None)
        self.timeout_s, self._clock = timeout_s, clock

    def remaining(self) -> float | None:
        return self.timeout_s - self._clock.now


def test_retries_never_sleep_past_the_deadline_on_a_fake_clock() -> None:
    policy = RetryPolicy(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.2, jitter=0.0)
    clock = _FakeClock()
    slept: list[float] = []
    started: list[float] = []

    def busy(_left: float | None) -> None:
        started.append(clock.now)
        clock.now += 0.05  # each attempt takes 50 ms
        raise UnavailableError(Status.UNAVAILABLE, "busy", transport="test")

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.sleep(seconds)

    with pytest.raises(UnavailableError) as info:
        call_with_retry(
            busy, policy, _FakeDeadline(0.7, clock), transport="test", what="x", sleep=sleep, rand=lambda: 0.0
        )
    # 0.00 try, 0.05 sleep 0.2, 0.25 try, 0.30 sleep 0.2, 0.50 try, 0.55: 0.15 s left < 0.2 -> give up now
    assert started == pytest.approx([0.0, 0.25, 0.5])
    assert slept == pytest.approx([0.2, 0.2])
    assert info.value.attempts == 3
    assert clock.now <= 0.7


def test_backoff_schedule_is_exponential_bounded_and_jittered() -> None:
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.1, max_backoff_s=0.5, multiplier=2.0, jitter=0.5)
    assert [policy.backoff(k, 0.0) for k in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert policy.backoff(1, 0.999) == pytest.approx(0.05, abs=1e-3)  # jitter takes off up to half
    slept: list[float] = []

    def always_busy(_left: float | None) -> None:
        raise UnavailableError(Status.UNAVAILABLE, "busy", transport="test")

    with pytest.raises(UnavailableError) as info:
        call_with_retry(
            always_busy,
            policy,
            Deadline(None),
            transport="test",
            what="x",
            sleep=slept.append,
            rand=lambda: 0.0,
        )
    assert info.value.attempts == 6
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])  # no sleep after the last attempt


class socket_closed_port:  # noqa: N801 - used like a function in `with`
    """A loopback address nothing listens on (bound then closed), for connection-refused paths."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        pass


# -- the CLI, as users run it ---------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mariner.server.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _where(mariner: MarinerServe, transport: str) -> list[str]:
    return ["--grpc", mariner.grpc_target] if transport == "grpc" else ["--url", mariner.http]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_predict_prints_the_label_for_json_and_png(
    mariner: MarinerServe, eager_reference: EagerReference, tmp_path: Path, transport: str
) -> None:
    row = eager_reference.test_pixels[1]
    json_file = tmp_path / "digit.json"
    json_file.write_text(json.dumps(row.tolist()))
    png_file = tmp_path / "digit.png"
    png_file.write_bytes(_png(row))
    cases = [
        (json_file, int(_eager_logits(eager_reference, row).argmax())),
        (png_file, int(_eager_logits(eager_reference, _png_pixels(row)).argmax())),
    ]
    for path, expected in cases:
        done = _cli("predict", MODEL, str(path), *_where(mariner, transport))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["label"] == expected


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cli_infer_prints_every_output(
    mariner: MarinerServe, eager_reference: EagerReference, tmp_path: Path, transport: str
) -> None:
    rows = eager_reference.test_pixels[:3]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows.tolist()))
    done = _cli("infer", MODEL, str(path), *_where(mariner, transport))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    expected = _eager_logits(eager_reference, rows)
    assert out["label"] == expected.argmax(axis=1).tolist()
    np.testing.assert_allclose(np.asarray(out["logits"]), expected, atol=LOGIT_TOL, rtol=0)


def test_cli_infer_takes_a_single_row_and_named_inputs(
    mariner: MarinerServe, eager_reference: EagerReference, tmp_path: Path
) -> None:
    row = eager_reference.test_pixels[2]
    single = tmp_path / "row.json"
    single.write_text(json.dumps(row.tolist()))
    named = tmp_path / "named.json"
    named.write_text(json.dumps({"pixels": [row.tolist()]}))
    expected = [int(_eager_logits(eager_reference, row).argmax())]
    for path in (single, named):
        done = _cli("infer", MODEL, str(path), "--url", mariner.http, "--output", "label")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"label": expected}


def test_cli_reports_server_errors_and_bad_files_with_distinct_exit_codes(
    mariner: MarinerServe, tmp_path: Path
) -> None:
    good = tmp_path / "zeros.json"
    good.write_text(json.dumps([0] * 64))
    done = _cli("predict", "no_such_model", str(good), "--url", mariner.http)
    assert done.returncode == 1
    assert "NOT_FOUND/404" in done.stderr
    assert "no_such_model" in done.stderr
    assert done.stdout == ""

    done = _cli("predict", MODEL, str(tmp_path / "missing.json"), "--grpc", mariner.grpc_target)
    assert done.returncode == 2
    assert "cannot read" in done.stderr

    broken = tmp_path / "broken.json"
    broken.write_text("[1, 2,")
    done = _cli("infer", MODEL, str(broken), "--url", mariner.http)
    assert done.returncode == 2
    assert "not valid JSON" in done.stderr


def test_cli_serve_usage_still_lists_the_client_commands() -> None:
    done = _cli("--help")
    assert done.returncode == 0
    assert "serve" in done.stdout
    assert "predict" in done.stdout
    assert "infer" in done.stdout
    assert _cli("bogus").returncode == 2


def test_errors_render_status_transport_and_message() -> None:
    err = MarinerError(Status.UNAVAILABLE, "model loading", transport="http", http_status=503, attempts=4)
    assert str(err) == "UNAVAILABLE/503 over http: model loading (gave up after 4 attempts)"
