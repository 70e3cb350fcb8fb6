"""TorchServe's `config.properties`, translated onto Mariner's settings.

Users bring the file they already run TorchServe with. A key we map is honoured; a key we do
not use is named in a warning (one line each), never dropped in silence; and a key whose loss
would weaken security is honoured or refused, never downgraded. In particular TLS: TorchServe
serves a listener over TLS when its address is `https://` (HTTP) or `enable_grpc_ssl=true`
(gRPC), with the PEM pair `private_key_file` / `certificate_file`. Mariner serves TLS on every
listener or on none (one `--tls-cert-file` / `--tls-key-file` pair), so a file that asks for TLS
on some listeners only is refused with the list of listeners that would stay plain, and Java
keystores (`keystore`, `keystore_pass`, `keystore_type`) are refused when they would be the
key material.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("mariner.config")

# TorchServe listener address keys -> (our setting, default port). An absent key is TorchServe's
# default, plain http on loopback.
_HTTP_LISTENERS = (
    ("inference_address", 8080),
    ("management_address", 8081),
    ("metrics_address", 8082),
)
_KEYSTORE_KEYS = ("keystore", "keystore_pass", "keystore_type")
# Keys TorchServe understands that change security or what a client sees, with what Mariner
# does instead: the warning says it, so nobody assumes TorchServe's behaviour.
_DIFFERENT = {
    "disable_token_authorization": "Mariner has no TorchServe key_file.json tokens; set "
    "MARINER_INFERENCE_TOKEN_FILE / MARINER_MANAGEMENT_TOKEN_FILE for bearer-token auth",
    "model_snapshot": "Mariner does not read TorchServe snapshots: put per-model settings in models={...}",
    "token_expiration_min": "Mariner's bearer tokens do not expire; rotate them through the token files",
    "allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "use_env_allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "enable_metrics_api": "Mariner always serves /metrics on metrics_address (see --open-metrics)",
    "metrics_mode": "Mariner serves metrics in Prometheus mode only (TorchServe's names on /metrics)",
    "cors_allowed_origin": "Mariner sends no CORS headers: browsers on other origins are refused",
    "max_request_size": "use --max-request-bytes",
    "max_response_size": "use --max-request-bytes (it bounds gRPC messages both ways)",
}


def read_properties(text: str) -> dict[str, str]:
    """Java .properties: key=value lines, '#'/'!' comments, backslash line continuations."""
    out: dict[str, str] = {}
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith(("#", "!"))):
            continue
        if line.endswith("\\"):
            buf += line[:-1]
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    for line in logical:
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def _true(value: str) -> bool:
    return value.strip().lower() == "true"  # Java's Boolean.parseBoolean


def _listener(key: str, address: str, default_port: int) -> tuple[str, bool]:
    """'https://0.0.0.0:8443' -> ('0.0.0.0:8443', True); a bare 'host:port' is plain http."""
    if "://" not in address:
        if not address.rpartition(":")[2].isdigit():  # e.g. TorchServe's unix:/path sockets
            raise ValueError(f"config.properties {key}={address}: expected http(s)://host:port or host:port")
        return address, False
    u = urlparse(address)
    if u.scheme not in ("http", "https"):
        raise ValueError(f"config.properties {key}={address}: Mariner listens on http:// or https:// only")
    if not u.hostname:
        raise ValueError(f"config.properties {key}={address}: no host")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{host}:{u.port or default_port}", u.scheme == "https"


def _tls(props: Mapping[str, str], https: Mapping[str, bool]) -> dict[str, Any]:
    """Our TLS settings for the listeners TorchServe would encrypt, or ValueError naming the gap."""
    grpc_tls = _true(props.get("enable_grpc_ssl", "false"))
    wanted = {**https, "gRPC inference and management (enable_grpc_ssl)": grpc_tls}
    encrypted = [name for name, on in wanted.items() if on]
    pem = [k for k in ("private_key_file", "certificate_file") if props.get(k)]
    keystore = [k for k in _KEYSTORE_KEYS if k in props]
    if not encrypted:
        for key in pem + keystore:
            log.warning("config.properties %s is not used: no listener is https:// or enable_grpc_ssl", key)
        return {}
    plain = [name for name, on in wanted.items() if not on]
    if plain:
        raise ValueError(
            "config.properties asks for TLS on " + ", ".join(encrypted) + " but not on " + ", ".join(plain)
            + ": Mariner serves TLS on all of its listeners or on none, so it cannot serve this mix. "
            "Make every address https:// and set enable_grpc_ssl=true (an absent address is "
            "TorchServe's plain http default), or use no TLS at all"
        )  # fmt: skip
    if len(pem) < 2:
        missing = [k for k in ("private_key_file", "certificate_file") if k not in pem]
        why = (
            " (Java keystores are not supported: export the key and certificate to PEM, e.g. "
            "`openssl pkcs12 -in keystore.p12 -nodes`)"
            if keystore
            else ""
        )
        raise ValueError(
            f"config.properties asks for TLS on {', '.join(encrypted)} without {' and '.join(missing)}{why}"
        )
    for key in keystore:
        log.warning("config.properties %s is not used: TLS uses private_key_file and certificate_file", key)
    return {"tls_key_file": props["private_key_file"], "tls_cert_file": props["certificate_file"]}


def from_torchserve_properties(props: Mapping[str, str]) -> dict[str, Any]:
    """Map the TorchServe keys we understand onto ours; warn about every other key.

    Raises ValueError when honouring the file is impossible (partial TLS, a keystore as the only
    key material, an address that is not http/https), rather than serving it differently.
    """
    out: dict[str, Any] = {}
    used: set[str] = set()
    https: dict[str, bool] = {}
    for key, port in _HTTP_LISTENERS:
        address, tls = _listener(key, props.get(key, f"http://127.0.0.1:{port}"), port)
        https[key] = tls
        if key in props:
            out[key] = address
            used.add(key)
    for which, port in (("inference", 7070), ("management", 7071)):
        host_key, port_key = f"grpc_{which}_address", f"grpc_{which}_port"
        if host_key in props or port_key in props:
            out[host_key] = f"{props.get(host_key, '127.0.0.1')}:{props.get(port_key, port)}"
            used |= {host_key, port_key}
    out.update(_tls(props, https))
    used |= {"enable_grpc_ssl", "private_key_file", "certificate_file", *_KEYSTORE_KEYS}
    for ts_key, ours in (
        ("model_store", "model_store"),
        ("load_models", "models"),
        ("default_workers_per_model", "min_workers"),
        ("enable_model_api", "enable_model_management"),
        ("metrics_config", "metrics_config"),
        ("install_py_dep_per_model", "install_py_dep_per_model"),
    ):
        if ts_key in props:
            out[ours] = props[ts_key]
            used.add(ts_key)
    if "models" in props:
        out["model_overrides"] = json.loads(props["models"])
        used.add("models")
    if props.get("metrics_mode", "prometheus").strip().lower() == "prometheus":
        used.add("metrics_mode")  # what Mariner serves; "log"/"legacy" are warned about below
    if _true(props.get("disable_token_authorization", "false")):
        # No TorchServe tokens, as asked; Mariner's own rule still refuses exposure without tokens.
        used.add("disable_token_authorization")
    for key in sorted(set(props) - used):
        if key in _DIFFERENT:
            log.warning("config.properties %s is not supported (ignored): %s", key, _DIFFERENT[key])
        else:
            log.warning("config.properties %s is not used by Mariner (ignored)", key)
    return out
