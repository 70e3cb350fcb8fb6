"""TorchServe's token authorization on a real `mariner serve`: key_file.json, the keys on HTTP and
gRPC next to Mariner's own tokens, the token API, expiry, and no key in any child's reach.

The server runs in a directory of its own (the key file goes in the working directory, as
TorchServe writes it) and serves an archive whose handler dumps its environment.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import requests

from mariner.server import protogen
from tests.integration.fault_archive import write_handler_archive
from tests.integration.test_secrets_env import CONFIG, HANDLER
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

INF_TOKEN, MGMT_TOKEN = "mariner-inference-token-5b7e", "mariner-management-token-c2d9"
REFUSED = {
    "code": 400,
    "type": "InvalidKeyException",
    "message": "Token Authorization failed. Token either incorrect, expired, or not provided correctly",
}


def _store(root: Path) -> Path:
    store = root / "store"
    write_handler_archive(
        store / "envdump.mar",
        "envdump",
        "env_handler.py",
        {"env_handler.py": HANDLER, "model-config.yaml": CONFIG},
    )
    return store


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    root = tmp_path_factory.mktemp("keys")
    (root / "cwd").mkdir()
    srv = MarinerServe(
        _store(root),
        "envdump.mar",
        cwd=root / "cwd",
        disable_token_auth=False,
        inference_token=INF_TOKEN,
        management_token=MGMT_TOKEN,
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def keys(srv: MarinerServe) -> dict[str, Any]:
    return json.loads((srv.cwd / "key_file.json").read_text())


def key(srv: MarinerServe, which: str) -> str:
    return str(keys(srv)[which]["key"])


def bearer(value: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {value}"}


def predict(srv: MarinerServe, headers: dict[str, str]) -> requests.Response:
    return requests.post(f"{srv.http}/predictions/envdump", data=b"{}", headers=headers, timeout=30)


def describe(srv: MarinerServe, headers: dict[str, str]) -> requests.Response:
    return requests.get(f"{srv.management}/models/envdump", headers=headers, timeout=30)


def regenerate(srv: MarinerServe, kind: str, api_key: str) -> requests.Response:
    return requests.get(f"{srv.management}/token", params={"type": kind}, headers=bearer(api_key), timeout=30)


def test_the_key_file_is_torchserves_private_and_no_key_is_logged(server: MarinerServe) -> None:
    path = server.cwd / "key_file.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = keys(server)
    assert set(written) == {"management", "inference", "API"}
    assert set(written["management"]) == set(written["inference"]) == {"key", "expiration time"}
    assert set(written["API"]) == {"key"}
    log = server.log_text()
    assert str(path) in log, "the log says where the keys are"
    for value in (written["management"]["key"], written["inference"]["key"], written["API"]["key"]):
        assert value not in log


def test_inference_takes_the_inference_key_or_mariners_token(server: MarinerServe) -> None:
    assert predict(server, bearer(key(server, "inference"))).status_code == 200
    assert predict(server, bearer(INF_TOKEN)).status_code == 200
    for headers in ({}, bearer("abcd1234"), bearer(key(server, "management")), bearer(key(server, "API"))):
        refused = predict(server, headers)
        assert refused.status_code == 400, headers
        assert refused.json() == REFUSED
    assert requests.get(f"{server.http}/ping", timeout=30).status_code == 200, "health stays open"


def test_management_takes_the_management_key_or_mariners_token(server: MarinerServe) -> None:
    assert describe(server, bearer(key(server, "management"))).status_code == 200
    assert describe(server, bearer(MGMT_TOKEN)).status_code == 200
    for headers in ({}, bearer(key(server, "inference")), bearer(INF_TOKEN)):
        refused = describe(server, headers)
        assert refused.status_code == 400, headers
        assert refused.json() == REFUSED


def test_grpc_takes_the_keys_from_its_metadata(server: MarinerServe) -> None:
    protogen.generate()
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mariner.server._proto.torchserve import (
        inference_pb2,
        inference_pb2_grpc,
        management_pb2,
        management_pb2_grpc,
    )

    request = inference_pb2.PredictionsRequest(model_name="envdump", input={"data": b"{}"})
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        for good in (key(server, "inference"), INF_TOKEN):
            assert stub.Predictions(request, metadata=(("authorization", f"Bearer {good}"),), timeout=30)
        for metadata in ((), (("authorization", "Bearer incorrect-token"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.Predictions(request, metadata=metadata, timeout=30)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert info.value.details() == REFUSED["message"]
        overall = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert overall.status == health_pb2.HealthCheckResponse.SERVING, "probes need no key"
    with grpc.insecure_channel(server.grpc_management_target) as channel:
        management = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        listed = management.ListModels(
            management_pb2.ListModelsRequest(),
            metadata=(("authorization", f"Bearer {key(server, 'management')}"),),
        )
        assert "envdump" in listed.msg
        with pytest.raises(grpc.RpcError) as info:
            management.ListModels(
                management_pb2.ListModelsRequest(),
                metadata=(("authorization", f"Bearer {key(server, 'inference')}"),),
            )
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_the_token_api_replaces_a_key_everywhere_before_it_answers(server: MarinerServe) -> None:
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    api, old_inference, old_management = (
        key(server, "API"),
        key(server, "inference"),
        key(server, "management"),
    )
    assert regenerate(server, "inference", "wrong").status_code == 400
    assert regenerate(server, "inference", old_management).status_code == 400, "only the API key may"
    assert key(server, "inference") == old_inference

    answer = regenerate(server, "inference", api)
    assert (answer.status_code, answer.text) == (200, "\n")
    new_inference = key(server, "inference")
    assert new_inference != old_inference
    assert predict(server, bearer(old_inference)).status_code == 400, "the old key is refused at once"
    assert predict(server, bearer(new_inference)).status_code == 200
    request = inference_pb2.PredictionsRequest(model_name="envdump", input={"data": b"{}"})
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Predictions(request, metadata=(("authorization", f"Bearer {old_inference}"),), timeout=30)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.Predictions(request, metadata=(("authorization", f"Bearer {new_inference}"),), timeout=30)

    assert regenerate(server, "management", api).status_code == 200
    assert describe(server, bearer(old_management)).status_code == 400
    assert describe(server, bearer(key(server, "management"))).status_code == 200
    assert key(server, "API") == api, "the API key stays"
    assert predict(server, bearer(INF_TOKEN)).status_code == 200, "Mariner's own tokens are untouched"


def test_no_key_reaches_a_handler_or_any_childs_environment(server: MarinerServe) -> None:
    dumped = predict(server, bearer(key(server, "inference")))
    assert dumped.status_code == 200
    values = [k["key"] for k in keys(server).values()]
    for value in values:
        assert value not in dumped.text, "the handler can read a key"
    assert server.supervisor_pid is not None
    children = [p.pid for p in psutil.Process(server.supervisor_pid).children(recursive=True)]
    assert dumped.json()["pid"] in children
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        for value in values:
            assert value not in environ, f"/proc/{pid}/environ holds a key"


def test_expiry_follows_the_setting_and_ts_variables_win_over_the_flag(tmp_path: Path) -> None:
    """config.properties enables TS_* variables and sets keys to expire at once; the variable
    turns token authorization on over `--disable-token-auth` (TorchServe's order)."""
    props = tmp_path / "config.properties"
    props.write_text("enable_envvars_config=true\ntoken_expiration_min=0\n")
    (tmp_path / "cwd").mkdir()
    srv = MarinerServe(
        _store(tmp_path),
        "envdump.mar",
        cwd=tmp_path / "cwd",
        env={"TS_DISABLE_TOKEN_AUTHORIZATION": "false"},
        args=("--ts-config", str(props), "--disable-token-auth"),
    )
    with srv:
        assert describe(srv, {}).status_code == 400, "on: the variable beats the flag"
        api = key(srv, "API")
        assert describe(srv, bearer(key(srv, "management"))).status_code == 400, "expired as soon as made"
        assert predict(srv, bearer(key(srv, "inference"))).status_code == 400
        assert regenerate(srv, "management", api).status_code == 200, "the API key never expires"
        assert describe(srv, bearer(key(srv, "management"))).status_code == 400, "a new key, expired too"
        assert (srv.cwd / "key_file.json").exists()
    assert not (srv.cwd / "key_file.json").exists(), "removed when the server stops"
