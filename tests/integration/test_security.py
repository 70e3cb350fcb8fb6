"""Security by default on a real server: tokens on every API, no exposure without auth, TLS/mTLS,
and the archive allowlist."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import requests

from mariner.server import protogen
from mariner.server.common.config import ServerConfig
from mariner.server.common.listeners import check_exposure
from mariner.server.contracts.errors import Code, ServingError
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

INF, MGMT = "inference-secret-1", "management-secret-2"
BODY = json.dumps([0.0] * 64).encode()


@pytest.fixture(scope="module")
def secured(model_store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(model_store, "digits_onnx.mar", inference_token=INF, management_token=MGMT).start()
    try:
        yield srv
    finally:
        srv.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_http_inference_needs_the_inference_token(secured: MarinerServe) -> None:
    url = f"{secured.http}/predictions/digits_onnx"
    hdr = {"Content-Type": "application/json"}
    missing = requests.post(url, data=BODY, headers=hdr, timeout=10)
    wrong = requests.post(url, data=BODY, headers={**hdr, **bearer("nope")}, timeout=10)
    other = requests.post(url, data=BODY, headers={**hdr, **bearer(MGMT)}, timeout=10)
    for r in (missing, wrong, other):
        assert r.status_code == 401
        assert r.json() == {
            "code": 401,
            "type": "InvalidKeyException",  # TorchServe's name; the status stays 401
            "message": "missing or invalid bearer token",
        }
    assert missing.content == wrong.content, "a refusal must not hint at which part was wrong"
    ok = requests.post(url, data=BODY, headers={**hdr, **bearer(INF)}, timeout=10)
    assert ok.status_code == 200
    assert "label" in ok.json()
    oip = requests.post(
        f"{secured.http}/v2/models/digits_onnx/infer",
        json={"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]},
        timeout=10,
    )
    assert oip.status_code == 401


def test_health_and_metrics_stay_open_management_needs_its_own_token(secured: MarinerServe) -> None:
    for path in ("/ping", "/healthz", "/readyz", "/v2/health/ready"):
        assert requests.get(f"{secured.http}{path}", timeout=10).status_code == 200, path
    assert requests.get(f"{secured.metrics}/metrics", timeout=10).status_code == 200
    models = f"{secured.management}/models"
    assert requests.get(models, timeout=10).status_code == 401
    assert requests.get(models, headers=bearer(INF), timeout=10).status_code == 401
    assert requests.get(models, headers=bearer(MGMT), timeout=10).status_code == 200


def test_grpc_needs_tokens_except_overall_health(secured: MarinerServe) -> None:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.torchserve import (
        inference_pb2,
        inference_pb2_grpc,
        management_pb2,
        management_pb2_grpc,
    )

    request = inference_pb2.PredictionsRequest(model_name="digits_onnx", input={"data": BODY})
    with grpc.insecure_channel(secured.grpc_target) as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        details = set()
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", f"Bearer {MGMT}"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Predictions(request, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            details.add(info.value.details())
        assert details == {"missing or invalid bearer token"}
        reply = stub.Predictions(request, metadata=(("authorization", f"Bearer {INF}"),))
        assert "label" in json.loads(reply.prediction)
        health = health_pb2_grpc.HealthStub(ch)
        overall = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert overall.status == health_pb2.HealthCheckResponse.SERVING, "probes need no token"
        with pytest.raises(grpc.RpcError) as info:  # a model's health names the model: token needed
            health.Check(health_pb2.HealthCheckRequest(service="digits_onnx"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        model = health.Check(
            health_pb2.HealthCheckRequest(service="digits_onnx"),
            metadata=(("authorization", f"Bearer {INF}"),),
            timeout=10,
        )
        assert model.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(secured.grpc_management_target) as ch:
        mgmt = management_pb2_grpc.ManagementAPIsServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            mgmt.ListModels(
                management_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {INF}"),)
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (
            "digits_onnx"
            in mgmt.ListModels(
                management_pb2.ListModelsRequest(), metadata=(("authorization", f"Bearer {MGMT}"),)
            ).msg
        )


@pytest.fixture(scope="module")
def closed(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    """Tokens from rotation files, and health and metrics closed (--no-open-health/--no-open-metrics)."""
    d = tmp_path_factory.mktemp("tokens")
    (d / "inference").write_text(f"# rotating: old and new both valid\n{INF}\n{INF}-new\n")
    (d / "management").write_text(f"{MGMT}\n")
    srv = MarinerServe(
        model_store,
        "digits_onnx.mar",
        inference_token_file=d / "inference",
        management_token_file=d / "management",
        open_health=False,
        open_metrics=False,
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_token_files_accept_every_rotated_token_and_nothing_longer(closed: MarinerServe) -> None:
    url = f"{closed.http}/predictions/digits_onnx"
    hdr = {"Content-Type": "application/json"}
    for token in (INF, f"{INF}-new"):
        r = requests.post(url, data=BODY, headers={**hdr, **bearer(token)}, timeout=10)
        assert r.status_code == 200, token
    for token in (f"{INF}-new-but-longer", f"{INF}x", INF[:-1], MGMT):
        r = requests.post(url, data=BODY, headers={**hdr, **bearer(token)}, timeout=10)
        assert r.status_code == 401, token
    models = f"{closed.management}/models"
    assert requests.get(models, headers=bearer(MGMT), timeout=10).status_code == 200
    assert requests.get(models, headers=bearer(f"{MGMT}2"), timeout=10).status_code == 401
    assert requests.get(models, headers=bearer(INF), timeout=10).status_code == 401


def test_closed_health_and_metrics_need_tokens(closed: MarinerServe) -> None:
    for path in ("/ping", "/healthz", "/readyz", "/v2/health/ready", "/v2/health/live"):
        url = f"{closed.http}{path}"
        assert requests.get(url, timeout=10).status_code == 401, path
        assert requests.get(url, headers=bearer(INF), timeout=10).status_code == 200, path
    # A prediction of this test's own, so the scrape below has a request count to show whichever
    # tests ran before (a labelled counter has no sample until it is first counted).
    predicted = requests.post(
        f"{closed.http}/predictions/digits_onnx",
        data=BODY,
        headers={"Content-Type": "application/json", **bearer(INF)},
        timeout=10,
    )
    assert predicted.status_code == 200
    metrics = f"{closed.metrics}/metrics"
    assert requests.get(metrics, timeout=10).status_code == 401
    assert requests.get(metrics, headers=bearer(INF), timeout=10).status_code == 401
    scraped = requests.get(metrics, headers=bearer(MGMT), timeout=10)
    assert scraped.status_code == 200
    assert "mariner_requests_total" in scraped.text
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    check = health_pb2.HealthCheckRequest(service="digits_onnx")
    with grpc.insecure_channel(closed.grpc_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(check, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Check(check, metadata=(("authorization", f"Bearer {INF}"),), timeout=10)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING


def test_listening_beyond_loopback_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    # Without TorchServe's keys too (on by default; they count as tokens, see below).
    exposed = replace(ServerConfig(), inference_address="0.0.0.0:8080", disable_token_auth=True)
    with pytest.raises(ServingError) as info:
        check_exposure(exposed)
    assert info.value.code is Code.PERMISSION_DENIED
    assert "0.0.0.0:8080" in info.value.message
    assert "--insecure" in info.value.message
    token_file = tmp_path / "tokens"
    token_file.write_text("# inference tokens\nabc\n")
    tokens, _ = check_exposure(replace(exposed, inference_token_file=token_file))
    assert tokens.accepts("Bearer abc")
    check_exposure(replace(exposed, insecure=True))
    check_exposure(replace(exposed, disable_token_auth=False))  # TorchServe's inference key protects it
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mariner.server.cli",
            "serve",
            "--grpc-inference-address",
            "0.0.0.0:0",
            "--disable-token-auth",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to listen beyond loopback" in proc.stderr
    assert INF not in repr(replace(ServerConfig(), inference_token=INF)), "tokens must never reach logs"


def test_only_allowlisted_archives_load(model_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    for name in ("digits_onnx.mar", "digits_torchscript.mar"):
        shutil.copy(model_store / name, store / name)
    index = json.loads((model_store / "index.json").read_text())
    index["archives"] = [a for a in index["archives"] if a["file"] == "digits_onnx.mar"]
    (store / "index.json").write_text(json.dumps(index))
    srv = MarinerServe(store, "all", pin_index=True).start()
    try:
        names = srv.served_models()
        assert names == ["digits_onnx"]
        assert requests.get(f"{srv.http}/readyz", timeout=10).status_code == 200
    finally:
        srv.stop()


def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_and_mutual_tls(model_store: Path, tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    cert, key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "client")
    srv = MarinerServe(
        model_store, "digits_onnx.mar", tls_cert_file=cert, tls_key_file=key, tls_client_ca_file=client_cert
    ).start()
    try:
        url = f"https://127.0.0.1:{srv.ports.inference}/predictions/digits_onnx"
        hdr = {"Content-Type": "application/json"}
        r = requests.post(
            url, data=BODY, headers=hdr, verify=str(cert), cert=(str(client_cert), str(client_key))
        )
        assert r.status_code == 200
        with pytest.raises(requests.exceptions.ConnectionError):  # TLS 1.3 rejects after the handshake
            requests.post(url, data=BODY, headers=hdr, verify=str(cert), timeout=10)  # no client certificate
        protogen.generate()
        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        creds = grpc.ssl_channel_credentials(
            cert.read_bytes(), client_key.read_bytes(), client_cert.read_bytes()
        )
        with grpc.secure_channel(srv.grpc_target, creds) as ch:
            reply = inference_pb2_grpc.InferenceAPIsServiceStub(ch).Predictions(
                inference_pb2.PredictionsRequest(model_name="digits_onnx", input={"data": BODY}), timeout=10
            )
            assert "label" in json.loads(reply.prediction)
        with grpc.secure_channel(srv.grpc_target, grpc.ssl_channel_credentials(cert.read_bytes())) as ch:
            with pytest.raises(grpc.RpcError) as info:
                inference_pb2_grpc.InferenceAPIsServiceStub(ch).Predictions(
                    inference_pb2.PredictionsRequest(model_name="digits_onnx", input={"data": BODY}),
                    timeout=10,
                )
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def _json_or_none(line: str) -> dict | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def test_tls_server_with_an_idle_client_connection_stops_without_waiting_for_it(
    model_store: Path, tmp_path: Path
) -> None:
    """A client that keeps its TLS connection open (as every pooled client does) never answers
    close_notify; shutdown must not wait on it, let alone for the whole grace period."""
    cert, key = _self_signed(tmp_path, "server")
    srv = MarinerServe(
        model_store, "digits_onnx.mar", tls_cert_file=cert, tls_key_file=key, grace_seconds=600.0
    ).start()
    session = requests.Session()
    try:
        r = session.post(
            f"https://127.0.0.1:{srv.ports.inference}/predictions/digits_onnx",
            data=BODY,
            headers={"Content-Type": "application/json"},
            verify=str(cert),
            timeout=10,
        )
        assert r.status_code == 200
        assert srv.open_connections() == 1, "the finished request's connection idles"
        # With the 600 s grace period, waiting on the idle connection would outlast stop()'s 60 s
        # (then it SIGKILLs the group, and the exit code is not 0).
        assert srv.stop(timeout=60.0) == 0, srv.log_tail()
    finally:
        session.close()
    messages = [entry["msg"] for entry in map(_json_or_none, srv.log_text().splitlines()) if entry]
    assert "drained: accepted=1 answered=1 ok=1" in messages, "the frontend drained and said so"
    assert "stopped" in messages, "the supervisor finished its ordered shutdown"
    assert not [m for m in messages if "Waiting for connections" in m or "timeout" in m], messages
