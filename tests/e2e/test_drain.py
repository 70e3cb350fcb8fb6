"""SIGTERM while clients keep calling: every call the server accepted is answered and counted,
and a refused one is told so cleanly, on a real `mariner serve` subprocess.

- HTTP keep-alive clients: no connection is reset; every response is 200, or 503 carrying
  `Connection: close` (so the client reconnects elsewhere instead of reusing a closing
  connection); a connection attempt after the listener closed is refused, never reset.
- HTTP clients that reconnect after each 503 while the listeners close at once: the connections
  waiting in the accept queue are served, not reset.
- gRPC clients sending 4 MiB tensors: every call ends OK or UNAVAILABLE (refused before it was
  accepted), none CANCELLED, and the frontends' drained accounting counts exactly the OKs.

Verdicts are counts; the test waits on events (every client has been answered, the process
exited), never on a fixed time.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from mariner.server import protogen
from tests.e2e.serve_process import drain_totals
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.e2e

MODEL = "digits_onnx"
CLIENTS = 16
GRPC_CLIENTS = 4
ROWS = (4 << 20) // (64 * 4)  # a 4 MiB FP32 tensor of 64-feature rows
WAIT = 60.0


def _serve(model_store: Path, refuse_seconds: float = 1.0) -> MarinerServe:
    # By default a refusal window of 1 s: clients are refused, with answers, before the listeners
    # close. A batch takes a whole 4 MiB request (its rows are the batch); the queue holds every
    # client's.
    return MarinerServe(
        model_store,
        f"{MODEL}.mar",
        refuse_seconds=refuse_seconds,
        batch_size=ROWS,
        job_queue_size=4 * GRPC_CLIENTS * ROWS,
    ).start()


def _terminate_when(srv: MarinerServe, ready: Callable[[], bool], threads: list[threading.Thread]) -> None:
    """SIGTERM once `ready()` (every client has been answered a few times) or a client stopped."""
    end = time.monotonic() + WAIT
    while not ready() and all(t.is_alive() for t in threads) and time.monotonic() < end:
        time.sleep(0.01)
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGTERM)


def _http_round(model_store: Path, *, refuse_seconds: float, reconnect: bool) -> Counter[str]:
    """One server, CLIENTS keep-alive clients calling until SIGTERM refuses them; their outcomes.

    `reconnect`: a client answered 503 with `Connection: close` calls again on a new connection
    (as load generators and retrying clients do) until a connect is refused; it pauses up to
    20 ms between calls, so connections are opened at every moment of the drain."""
    srv = _serve(model_store, refuse_seconds)
    body = json.dumps(
        {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]}
    ).encode()
    assert srv.ports is not None
    port = srv.ports.inference
    outcomes: Counter[str] = Counter()
    per_client = [0] * CLIENTS
    lock = threading.Lock()

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        end = time.monotonic() + WAIT
        try:
            while time.monotonic() < end:
                fresh = conn.sock is None
                try:
                    conn.request(
                        "POST", f"/v2/models/{MODEL}/infer", body, {"content-type": "application/json"}
                    )
                    response = conn.getresponse()
                    response.read()
                except ConnectionRefusedError:
                    outcome = "refused on connect" if fresh else "reset"
                except (ConnectionError, http.client.HTTPException, OSError) as exc:
                    outcome = f"reset ({type(exc).__name__}{', fresh connection' if fresh else ''})"
                else:
                    close = (response.getheader("connection") or "").lower() == "close"
                    outcome = f"{response.status}{' close' if close else ''}"
                with lock:
                    outcomes[outcome] += 1
                    per_client[index] += 1
                if not outcome.startswith("200") and not (reconnect and outcome == "503 close"):
                    return  # refused: a real client goes to another replica
                if reconnect:
                    time.sleep(0.02 * (index + 1) / CLIENTS)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        _terminate_when(srv, lambda: min(per_client) >= 3, threads)
        for t in threads:
            t.join(WAIT)
        assert srv.proc is not None
        srv.proc.wait(WAIT)
    finally:
        srv.stop()
    accepted, answered, ok, frontends = drain_totals(srv.log_text())
    assert frontends == srv.frontends
    assert accepted == answered
    assert ok == outcomes["200"] + outcomes["200 close"], (ok, dict(outcomes))
    return outcomes


ANSWERED = {"200", "200 close", "503 close", "refused on connect"}


def test_http_keep_alive_clients_through_sigterm_see_answers_never_resets(model_store: Path) -> None:
    outcomes = _http_round(model_store, refuse_seconds=1.0, reconnect=False)
    print(f"\nHTTP outcomes through SIGTERM: {dict(outcomes)}")
    assert set(outcomes) <= ANSWERED, dict(outcomes)
    assert outcomes["503 close"] > 0, "no client was refused while the frontend drained"


def test_clients_reconnecting_through_sigterm_are_answered_or_refused_not_reset(
    model_store: Path,
) -> None:
    """Listeners closing at once (no refusal window) while clients keep reconnecting: closing a
    listening socket resets the connections in its accept queue, whose requests were already
    sent (a review saw 11 of 4,631; here 1 to 8 in most rounds of ~250 calls). The frontend now
    serves its queue before it closes. What is left is a kernel race this test does not pin down
    (a handshake completing as the listener closes: 0 or 1 reset in three rounds here, against
    10 in three rounds without the fix), so three rounds allow two resets in all."""
    total: Counter[str] = Counter()
    for _ in range(3):
        total.update(_http_round(model_store, refuse_seconds=0.0, reconnect=True))
    print(f"\nHTTP outcomes of clients reconnecting through SIGTERM, 3 rounds: {dict(total)}")
    resets = sum(n for outcome, n in total.items() if outcome not in ANSWERED)
    assert resets <= 2, dict(total)
    assert total["refused on connect"] > 0, dict(total)
    assert total["503 close"] > 0, dict(total)


@pytest.fixture(scope="module")
def pb() -> SimpleNamespace:
    protogen.generate()
    from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc

    return SimpleNamespace(m=grpc_service_pb2, stub=grpc_service_pb2_grpc.GRPCInferenceServiceStub)


def test_grpc_large_tensors_through_sigterm_are_answered_and_counted(
    model_store: Path, pb: SimpleNamespace
) -> None:
    srv = _serve(model_store)
    started = time.monotonic()
    pixels = np.zeros((ROWS, 64), np.float32)
    tensor = pb.m.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=pixels.shape)
    request = pb.m.ModelInferRequest(model_name=MODEL, inputs=[tensor], raw_input_contents=[pixels.tobytes()])
    codes: Counter[str] = Counter()
    details: list[str] = []
    per_client = [0] * GRPC_CLIENTS
    lock = threading.Lock()

    def client(index: int) -> None:
        with grpc.insecure_channel(srv.grpc_target) as channel:
            stub = pb.stub(channel)
            end = time.monotonic() + WAIT
            while time.monotonic() < end:
                try:
                    stub.ModelInfer(request, timeout=WAIT)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
                    details.append(f"{code.name}: {exc.details()}")
                with lock:
                    codes[code.name] += 1
                    per_client[index] += 1
                if code is not grpc.StatusCode.OK:
                    return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(GRPC_CLIENTS)]
    try:
        for t in threads:
            t.start()
        _terminate_when(srv, lambda: min(per_client) >= 1, threads)
        for t in threads:
            t.join(WAIT)
        assert srv.proc is not None
        srv.proc.wait(WAIT)
    finally:
        srv.stop()
    took = time.monotonic() - started
    size = len(request.SerializeToString()) / 2**20
    print(f"\ngRPC {size:.1f} MiB calls through SIGTERM: {dict(codes)} ({took:.1f} s)")
    assert set(codes) <= {"OK", "UNAVAILABLE"}, (dict(codes), details[:3])
    assert codes["UNAVAILABLE"] > 0, "no call was refused while the frontend drained"
    accepted, answered, ok, frontends = drain_totals(srv.log_text())
    assert frontends == srv.frontends
    assert accepted == answered
    assert ok == codes["OK"], (ok, dict(codes))
