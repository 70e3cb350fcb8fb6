"""`mariner serve` as users run it: a subprocess, a readiness poll, traffic, then SIGTERM.

Proves the ordered shutdown: every request the server accepted is answered (the server's own
drain accounting equals what clients received), refused calls get UNAVAILABLE, and the
process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from mariner.server import protogen
from tests.e2e.serve_process import ServeProcess, drain_totals

pytestmark = pytest.mark.e2e


def test_sigterm_under_traffic_answers_every_accepted_request(model_store: Path, tmp_path: Path) -> None:
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    srv = ServeProcess(model_store, "digits_torchscript.mar", tmp_path / "serve.log")
    try:
        srv.wait_ready()
        body = json.dumps([4.0] * 64).encode()
        outcomes: Counter[str] = Counter()
        lock = threading.Lock()
        stop = threading.Event()

        def client() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{srv.ports['grpc']}") as ch:
                stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
                for _ in range(5000):  # bounded
                    if stop.is_set():
                        return
                    try:
                        stub.Predictions(
                            inference_pb2.PredictionsRequest(
                                model_name="digits_torchscript", input={"data": body}
                            ),
                            timeout=10,
                        )
                        code = "OK"
                    except grpc.RpcError as err:
                        code = err.code().name
                    with lock:
                        outcomes[code] += 1
                    if code == "UNAVAILABLE":
                        return

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        # SIGTERM after 300 answers, however long a slow machine takes; the cap only turns a
        # stalled server into a failure (the OK >= 300 check below) instead of a hang.
        deadline = time.monotonic() + 600
        while sum(outcomes.values()) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        stop.set()
        for t in threads:
            t.join(15)
        assert rc == 0
        log = srv.log_path.read_text()
        accepted, answered, ok, frontends = drain_totals(log)
        assert frontends >= 1, log[-2000:]
        assert accepted == answered
        assert outcomes["OK"] == ok, (outcomes, accepted, answered, ok)
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
        assert outcomes["OK"] >= 300
    finally:
        srv.kill()
