"""TLS on some listeners only, as a TorchServe config.properties asks for it, on a real server.

The file makes inference and management `https://` and leaves metrics and gRPC on TorchServe's
plain defaults (TorchServe's own config_https.properties does the same). Each listener is probed
with a real client: TLS where the file says https, plain elsewhere, and the TLS listeners take
TLS 1.3 or TLS 1.2 with forward-secret AEAD suites only.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests

from mariner.server import protogen
from tests.integration.fault_archive import write_handler_archive
from tests.integration.test_security import _self_signed
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

HANDLER = """
class Echo:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        return ["echo" for _ in data]
"""


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MarinerServe, Path]]:
    root = tmp_path_factory.mktemp("tls")
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    cert, key = _self_signed(root, "server")
    store = root / "store"
    write_handler_archive(
        store / "echo.mar", "echo", "echo.py", {"echo.py": HANDLER, "model-config.yaml": "minWorkers: 1\n"}
    )
    props = root / "config.properties"
    props.write_text(
        "inference_address=https://127.0.0.1:8080\n"
        "management_address=https://127.0.0.1:8081\n"
        f"private_key_file={key}\n"
        f"certificate_file={cert}\n"
    )
    # The ports come from the test's config file (port 0); the TLS plan from config.properties.
    srv = MarinerServe(store, "echo.mar", args=("--ts-config", str(props))).start()
    try:
        yield srv, cert
    finally:
        srv.stop()


def _port_url(srv: MarinerServe, which: str, scheme: str) -> str:
    assert srv.ports is not None
    return f"{scheme}://127.0.0.1:{getattr(srv.ports, which)}"


def test_https_listeners_speak_tls_and_the_others_plain_http(mixed: tuple[MarinerServe, Path]) -> None:
    srv, cert = mixed
    inference, management = _port_url(srv, "inference", "https"), _port_url(srv, "management", "https")
    answer = requests.post(f"{inference}/predictions/echo", data=b"x", verify=str(cert), timeout=30)
    assert (answer.status_code, answer.text) == (200, "echo")
    assert requests.get(f"{management}/models", verify=str(cert), timeout=30).status_code == 200
    assert requests.get(f"{_port_url(srv, 'metrics', 'http')}/metrics", timeout=30).status_code == 200
    for url in (
        f"{_port_url(srv, 'inference', 'http')}/ping",
        f"{_port_url(srv, 'management', 'http')}/ping",
    ):
        with pytest.raises(requests.ConnectionError):  # plain HTTP to a TLS listener gets no answer
            requests.get(url, timeout=30)
    with pytest.raises(requests.exceptions.SSLError):  # and TLS to the plain one no handshake
        requests.get(f"{_port_url(srv, 'metrics', 'https')}/metrics", verify=str(cert), timeout=30)


def test_grpc_stays_plain_without_enable_grpc_ssl(mixed: tuple[MarinerServe, Path]) -> None:
    srv, _ = mixed
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(srv.grpc_target) as channel:
        reply = inference_pb2_grpc.InferenceAPIsServiceStub(channel).Predictions(
            inference_pb2.PredictionsRequest(model_name="echo", input={"data": b"x"}), timeout=30
        )
    assert reply.prediction == b"echo"


def _handshake(
    port: int, cert: Path, *, versions: tuple[ssl.TLSVersion, ssl.TLSVersion], ciphers: str
) -> str:
    """The suite a TLS client limited to `versions` and `ciphers` agrees on (ssl.SSLError if none)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(str(cert))
    context.set_ciphers(ciphers)
    with warnings.catch_warnings():  # the old versions are what this client offers on purpose
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version, context.maximum_version = versions
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        cipher = tls.cipher()
        assert cipher is not None
        return f"{tls.version()} {cipher[0]}"


def _refused(port: int, cert: Path, *, versions: tuple[ssl.TLSVersion, ssl.TLSVersion], ciphers: str) -> None:
    """The server, not this client, ends the handshake: the client offers what it asks (every
    security level allowed) and gets the server's alert, or the server hangs up (asyncio's TLS
    closes a failed handshake without one); a client that could not offer would fail otherwise."""
    with pytest.raises(ssl.SSLError, match="ALERT|UNEXPECTED_EOF"):
        _handshake(port, cert, versions=versions, ciphers=f"{ciphers}:@SECLEVEL=0")


def test_tls_listeners_take_tls_1_3_or_tls_1_2_with_ecdhe_and_aead_only(
    mixed: tuple[MarinerServe, Path],
) -> None:
    srv, cert = mixed
    assert srv.ports is not None
    v12, v13 = ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3
    for port in (srv.ports.inference, srv.ports.management):
        assert _handshake(port, cert, versions=(v13, v13), ciphers="DEFAULT").startswith("TLSv1.3 ")
        agreed = _handshake(port, cert, versions=(v12, v12), ciphers="DEFAULT")
        assert agreed.startswith("TLSv1.2 ECDHE-"), agreed
        assert "GCM" in agreed or "CHACHA20" in agreed, agreed
        for weak in ("AES128-GCM-SHA256", "ECDHE-RSA-AES128-SHA", "ECDHE-RSA-AES256-SHA384"):
            _refused(port, cert, versions=(v12, v12), ciphers=weak)  # static RSA key exchange, CBC
        _refused(port, cert, versions=(ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1), ciphers="ALL")
