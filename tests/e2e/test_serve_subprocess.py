"""`mariner serve` as users run it: a subprocess, a readiness poll, traffic, then SIGTERM.

Proves the ordered shutdown: every request the server accepted is answered (the server's own
drain accounting equals what clients received), refused calls get UNAVAILABLE, and the
process exits 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
import requests

from server import protogen

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class ServeProcess:
    def __init__(self, model_store: Path, models: str, log_path: Path) -> None:
        self.ports = dict(zip(("http", "mgmt", "metrics", "grpc", "grpc_mgmt"), free_ports(5), strict=True))
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "server.cli", "serve",
            "--model-store", str(model_store), "--models", models,
            "--inference-address", f"127.0.0.1:{self.ports['http']}",
            "--management-address", f"127.0.0.1:{self.ports['mgmt']}",
            "--metrics-address", f"127.0.0.1:{self.ports['metrics']}",
            "--grpc-inference-address", f"127.0.0.1:{self.ports['grpc']}",
            "--grpc-management-address", f"127.0.0.1:{self.ports['grpc_mgmt']}",
            "--grace-seconds", "20",
        ]  # fmt: skip
        self.log = log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 120.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"mariner exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                if (
                    requests.get(f"http://127.0.0.1:{self.ports['http']}/readyz", timeout=1).status_code
                    == 200
                ):
                    return time.monotonic() - t0
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or busy loading
                pass
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def test_sigterm_under_traffic_answers_every_accepted_request(model_store: Path, tmp_path: Path) -> None:
    protogen.generate()
    from server._proto.torchserve import inference_pb2, inference_pb2_grpc

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
        deadline = time.monotonic() + 30
        while sum(outcomes.values()) < 300 and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(30)
        stop.set()
        for t in threads:
            t.join(15)
        assert rc == 0
        log = srv.log_path.read_text()
        m = re.search(r"drained: accepted=(\d+) answered=(\d+) ok=(\d+)", log)
        assert m, log[-2000:]
        accepted, answered, ok = map(int, m.groups())
        assert accepted == answered
        assert outcomes["OK"] == ok, (outcomes, m.group(0))
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
        assert outcomes["OK"] >= 300
    finally:
        srv.kill()
