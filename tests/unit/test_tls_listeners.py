"""Which listeners serve TLS: every one with `--tls-cert-file`, or, from a TorchServe
config.properties, exactly those it makes `https://` or `enable_grpc_ssl` (the others plain, as
TorchServe serves them); what a listener's TLS accepts; and the checks around the plan."""

from __future__ import annotations

import logging
import shutil
import ssl
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_loading import load_config
from mariner.server.common.listeners import (
    LISTENER_NAMES,
    check_exposure,
    grpc_tls,
    tls_listeners,
    uvicorn_config,
)
from mariner.server.common.security import HTTP_TLS12_CIPHERS, http_ssl_context
from mariner.server.contracts.errors import Code, ServingError

pytestmark = pytest.mark.unit

PEM = "private_key_file=/etc/ts/key.pem\ncertificate_file=/etc/ts/cert.pem\n"
HTTPS = {
    "inference": "inference_address=https://127.0.0.1:8443\n",
    "management": "management_address=https://127.0.0.1:8444\n",
    "metrics": "metrics_address=https://127.0.0.1:8445\n",
}
GRPC_SSL = "enable_grpc_ssl=true\n"


def _properties(tmp_path: Path, text: str, *argv: str) -> ServerConfig:
    props = tmp_path / "config.properties"
    props.write_text(text)
    return load_config(["--ts-config", str(props), *argv], env={}, cwd=tmp_path)


def _pair(tmp_path: Path, bits: int = 2048) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    cert, key = tmp_path / f"cert{bits}.pem", tmp_path / f"key{bits}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", f"rsa:{bits}", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.parametrize(
    ("text", "encrypted"),
    [
        # TorchServe's own test/resources/config_https.properties: https inference and
        # management, metrics on its plain default, gRPC plain.
        (HTTPS["inference"] + HTTPS["management"] + PEM, {"inference", "management"}),
        (HTTPS["inference"] + PEM, {"inference"}),
        (GRPC_SSL + PEM, {"grpc_inference", "grpc_management"}),
        (
            HTTPS["inference"] + HTTPS["management"] + HTTPS["metrics"] + PEM,
            {"inference", "management", "metrics"},
        ),
        (HTTPS["metrics"] + GRPC_SSL + PEM, {"metrics", "grpc_inference", "grpc_management"}),
        ("".join(HTTPS.values()) + GRPC_SSL + PEM, set(LISTENER_NAMES)),
    ],
)
def test_a_torchserve_file_encrypts_the_listeners_it_makes_https(
    tmp_path: Path, text: str, encrypted: set[str]
) -> None:
    cfg = _properties(tmp_path, text)
    assert tls_listeners(cfg) == encrypted
    assert cfg.tls_cert_file == Path("/etc/ts/cert.pem")


def test_a_file_without_any_https_listener_encrypts_none_and_says_the_pem_keys_are_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mariner.config"):
        cfg = _properties(tmp_path, "inference_address=http://127.0.0.1:8080\n" + PEM)
    assert tls_listeners(cfg) == frozenset()
    assert cfg.tls_cert_file is None
    assert sorted(r.getMessage().split()[1] for r in caplog.records) == [
        "certificate_file",
        "private_key_file",
    ]


def test_our_tls_flags_mean_every_listener_unless_tls_listeners_names_some(tmp_path: Path) -> None:
    flags = ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]
    assert tls_listeners(load_config(flags, env={})) == set(LISTENER_NAMES)
    some = load_config([*flags, "--tls-listeners", "inference, grpc_inference"], env={})
    assert tls_listeners(some) == {"inference", "grpc_inference"}
    assert tls_listeners(load_config([], env={})) == frozenset()


@pytest.mark.parametrize(
    ("settings", "wanted"),
    [
        (
            {"tls_cert_file": Path("c"), "tls_key_file": Path("k"), "tls_listeners": "inference,https"},
            "https is no listener",
        ),
        ({"tls_listeners": "inference"}, "no --tls-cert-file"),
        ({"tls_cert_file": Path("c")}, "both --tls-cert-file and --tls-key-file"),
    ],
)
def test_a_plan_that_cannot_be_served_stops_start_up_saying_why(
    settings: dict[str, object], wanted: str
) -> None:
    with pytest.raises(ServingError, match=wanted) as info:
        check_exposure(replace(ServerConfig(), **settings))  # type: ignore[arg-type]
    assert info.value.code is Code.INVALID_ARGUMENT


def test_each_listener_gets_tls_only_if_the_plan_covers_it(tmp_path: Path) -> None:
    cert, key = _pair(tmp_path)
    cfg = replace(
        ServerConfig(), tls_cert_file=cert, tls_key_file=key, tls_listeners="inference,grpc_management"
    )

    def app() -> None:
        return None

    assert uvicorn_config(app, "127.0.0.1", 0, cfg, listener="inference").ssl_context_factory is not None
    assert uvicorn_config(app, "127.0.0.1", 0, cfg, listener="management").ssl_context_factory is None
    assert uvicorn_config(app, "127.0.0.1", 0, cfg, listener="metrics").ssl_context_factory is None
    assert grpc_tls(cfg, "grpc_management") is not None
    assert grpc_tls(cfg, "grpc_inference") is None


def test_a_weak_rsa_key_is_served_with_a_warning_and_the_same_suites(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchServe's own example pair is RSA-1024, below OpenSSL's default security level: Java
    serves it, so Mariner does too, saying so, with no other suite or version let in."""
    cert, key = _pair(tmp_path, bits=1024)
    with caplog.at_level(logging.WARNING, logger="mariner"):
        context = http_ssl_context(cert, key, None)
    assert any("weaker than OpenSSL's default security level" in r.getMessage() for r in caplog.records)
    tls12 = {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12, "TLS 1.2 suites are offered"
    assert all(("ECDHE" in name) and ("GCM" in name or "CHACHA20" in name) for name in tls12), tls12
    assert context.minimum_version.name == "TLSv1_2"
    cert2, key2 = _pair(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mariner"):
        http_ssl_context(cert2, key2, None)
    assert caplog.records == [], "a 2048-bit key is served without a word"
    assert HTTP_TLS12_CIPHERS == "ECDHE+AESGCM:ECDHE+CHACHA20"


def test_a_plain_listener_beyond_loopback_beside_tls_ones_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = replace(
        ServerConfig(),
        tls_cert_file=Path("c"),
        tls_key_file=Path("k"),
        tls_listeners="inference",
        management_address="0.0.0.0:8081",
    )
    with caplog.at_level(logging.WARNING, logger="mariner"):
        check_exposure(cfg)  # TorchServe's management key protects it
    (warning,) = caplog.records
    assert "HTTP management on 0.0.0.0:8081 is plain HTTP beyond loopback" in warning.getMessage()


def test_a_weak_key_is_refused_when_client_certificates_are_required(tmp_path: Path) -> None:
    """Serving a weak key takes a lower OpenSSL security level, which would also let weak client
    keys and CAs through mutual TLS: with a client CA, the weak key is refused with the reason."""
    cert, key = _pair(tmp_path, bits=1024)
    ca, ca_key = _pair(tmp_path)
    with pytest.raises(ServingError) as caught:
        http_ssl_context(cert, key, ca)
    assert caught.value.code == Code.INVALID_ARGUMENT
    assert "weaker than OpenSSL's default security level" in caught.value.message
    assert "client certificates required" in caught.value.message
    assert http_ssl_context(ca, ca_key, ca).verify_mode == ssl.CERT_REQUIRED, "a strong key still serves mTLS"
