"""`mariner serve --config-file config.properties` with TorchServe's TLS keys, as users run it.

TorchServe serves an `https://` address and, with `enable_grpc_ssl=true`, gRPC over TLS with
`private_key_file` / `certificate_file`. The same file must give the same encryption on every
listener of Mariner (supervisor and frontend alike), never plain HTTP in silence.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mariner.loadtest.servers import pick_free_ports
from mariner.server import protogen
from tests.integration.test_security import _self_signed

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BODY = json.dumps([0.0] * 64).encode()
START_LIMIT_S = 300.0  # a bound for a server that never comes up, not a speed expectation


def _wait_https_ok(url: str, cert: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Readiness poll over TLS; fails with the log tail if the server exits first."""
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mariner serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url, verify=str(cert), timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {START_LIMIT_S:.0f} s:\n{log.read_text()[-3000:]}")


def test_torchserve_tls_keys_encrypt_every_listener(model_store: Path, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    cert, key = _self_signed(tmp_path, "server")
    http, mgmt, metrics, grpc_inf, grpc_mgmt = pick_free_ports().all()
    props = tmp_path / "config.properties"
    props.write_text(
        f"inference_address=https://127.0.0.1:{http}\n"
        f"management_address=https://127.0.0.1:{mgmt}\n"
        f"metrics_address=https://127.0.0.1:{metrics}\n"
        f"grpc_inference_port={grpc_inf}\n"
        f"grpc_management_port={grpc_mgmt}\n"
        "enable_grpc_ssl=true\n"
        f"private_key_file={key}\n"
        f"certificate_file={cert}\n"
        f"model_store={model_store}\n"
        "load_models=digits_onnx.mar\n"
        "number_of_netty_threads=4\n"
    )
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mariner.server.cli",
                "serve",
                "--config-file",
                str(props),
                "--frontends",
                "1",
                "--disable-token-auth",  # no key_file.json in the repository; TLS is what is tested
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_https_ok(f"https://127.0.0.1:{mgmt}/ping", cert, proc, log)
        _wait_https_ok(f"https://127.0.0.1:{http}/readyz", cert, proc, log)
        answer = requests.post(
            f"https://127.0.0.1:{http}/predictions/digits_onnx",
            data=BODY,
            headers={"Content-Type": "application/json"},
            verify=str(cert),
            timeout=30,
        )
        assert answer.status_code == 200
        assert "label" in answer.json()
        assert requests.get(f"https://127.0.0.1:{metrics}/metrics", verify=str(cert), timeout=30).ok
        for port, path in ((http, "/ping"), (mgmt, "/ping"), (metrics, "/metrics")):
            with pytest.raises(requests.ConnectionError):  # plain HTTP to a TLS listener: no answer
                requests.get(f"http://127.0.0.1:{port}{path}", timeout=30)

        protogen.generate()
        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        for port in (grpc_inf, grpc_mgmt):
            with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, port
        with grpc.secure_channel(f"127.0.0.1:{grpc_inf}", creds) as channel:
            reply = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Predictions(
                inference_pb2.PredictionsRequest(model_name="digits_onnx", input={"data": BODY}), timeout=30
            )
            assert "label" in json.loads(reply.prediction)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    text = log.read_text()
    warned = [line for line in text.splitlines() if "number_of_netty_threads" in line]
    assert len(warned) == 1, text[-3000:]
    assert "not used by Mariner" in warned[0]
