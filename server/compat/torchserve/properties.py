"""TorchServe's `config.properties`, translated onto Mariner's settings.

Users bring the file they already run TorchServe with. A key we map is honoured; a key we do
not use is named in a warning (one line each), never dropped in silence; and a key whose loss
would weaken security is honoured or refused, never downgraded. In particular TLS: TorchServe
serves a listener over TLS when its address is `https://` (HTTP) or `enable_grpc_ssl=true`
(gRPC), with the PEM pair `private_key_file` / `certificate_file`; Mariner does the same, listener
by listener (`tls_listeners` names the encrypted ones when some stay plain), and refuses Java
keystores (`keystore`, `keystore_pass`, `keystore_type`) when they would be the key material.
TorchServe's token authorization keys (`disable_token_authorization`, `token_expiration_min`)
are read as TorchServe reads them (see torchserve_tokens).

The file's syntax is `java_properties`'; the environment's `$$VAR$$` and `TS_*` variables,
`properties_env`'. This module is what the keys mean.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from mariner.server.compat.torchserve.java_properties import parse_boolean

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
    "allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "use_env_allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "enable_metrics_api": "Mariner always serves /metrics on metrics_address (see --open-metrics)",
    "cors_allowed_origin": "Mariner sends no CORS headers: browsers on other origins are refused",
    "max_request_size": "use --max-request-bytes",
    "max_response_size": "use --max-request-bytes (it bounds gRPC messages both ways)",
}

# TorchServe's default token lifetime, also what it uses when token_expiration_min is not a number.
DEFAULT_TOKEN_EXPIRATION_MIN = 60.0


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
    return f"{host}:{default_port if u.port is None else u.port}", u.scheme == "https"


def _tls(props: Mapping[str, str], https: Mapping[str, bool]) -> dict[str, Any]:
    """Our TLS settings for the listeners TorchServe would encrypt (the others stay plain, as
    there), or ValueError when the key material is missing or only a Java keystore."""
    grpc_tls = parse_boolean(props.get("enable_grpc_ssl", "false"))
    wanted = {**https, "grpc_inference": grpc_tls, "grpc_management": grpc_tls}
    encrypted = [name for name, on in wanted.items() if on]
    pem = [k for k in ("private_key_file", "certificate_file") if props.get(k)]
    keystore = [k for k in _KEYSTORE_KEYS if k in props]
    if not encrypted:
        for key in pem + keystore:
            log.warning("config.properties %s is not used: no listener is https:// or enable_grpc_ssl", key)
        return {}
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
    out: dict[str, Any] = {
        "tls_key_file": props["private_key_file"],
        "tls_cert_file": props["certificate_file"],
    }
    if len(encrypted) < len(wanted):  # the others stay plain, as on TorchServe
        out["tls_listeners"] = ",".join(encrypted)
    return out


def _token_expiration_min(value: str) -> float:
    """token_expiration_min as TorchServe reads it (a Java double, minutes); a value that is not
    a finite number is TorchServe's default of 60, with a warning (TorchServe logs an error)."""
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not math.isfinite(minutes):
        log.warning(
            "config.properties token_expiration_min=%s is not a number: keys expire after %g minutes",
            value, DEFAULT_TOKEN_EXPIRATION_MIN,
        )  # fmt: skip
        return DEFAULT_TOKEN_EXPIRATION_MIN
    if minutes * 60 < 1:
        log.warning("config.properties token_expiration_min=%s: keys expire as soon as they are made", value)
    return minutes


# TorchServe's logging and metrics keys, read as its ConfigManager reads them.
_LOG_KEYS = (
    "metrics_mode",
    "model_metrics_auto_detect",
    "disable_system_metrics",
    "async_logging",
    "metric_time_interval",
)
_BOOLEAN_LOG_KEYS = ("model_metrics_auto_detect", "disable_system_metrics", "async_logging")


def _logs_and_metrics(props: Mapping[str, str]) -> dict[str, Any]:
    """metrics_mode (case and spaces ignored; another value is TorchServe's `log`, with a
    warning, as TorchServe logs an error and uses log), the boolean keys (Java's parseBoolean:
    anything but `true` is false, a value that is not a boolean warned about) and
    metric_time_interval (whole seconds, positive, or the start is refused)."""
    out: dict[str, Any] = {}
    if "metrics_mode" in props:
        mode = re.sub(r"\s", "", props["metrics_mode"]).lower()
        if mode not in ("log", "prometheus", "legacy"):
            log.warning("config.properties metrics_mode=%s is not log, prometheus or legacy: using log",
                        props["metrics_mode"])  # fmt: skip
            mode = "log"
        out["metrics_mode"] = mode
    for key in _BOOLEAN_LOG_KEYS:
        if key in props:
            value = props[key].strip().lower()
            if value not in ("true", "false"):
                log.warning("config.properties %s=%s is not true or false: using false", key, props[key])
            out[key] = value == "true"
    if "metric_time_interval" in props:
        value = props["metric_time_interval"].strip()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"config.properties metric_time_interval={value}: expected a whole number of seconds, "
                "at least 1"
            )
        out["metric_time_interval"] = int(value)
    return out


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
        https[key.removesuffix("_address")] = tls
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
    used |= {"enable_envvars_config", "use_env_allowed_urls"}  # read by ts_env_props
    for ts_key, ours in (
        ("model_store", "model_store"),
        ("workflow_store", "workflow_store"),
        ("load_models", "models"),
        ("default_workers_per_model", "default_workers_per_model"),
        ("default_response_timeout", "default_response_timeout"),
        ("default_startup_timeout", "default_startup_timeout"),
        ("job_queue_size", "job_queue_size"),
        ("enable_model_api", "enable_model_management"),
        ("metrics_config", "metrics_config"),
        ("install_py_dep_per_model", "install_py_dep_per_model"),
        ("service_envelope", "service_envelope"),
    ):
        if ts_key in props:
            out[ours] = props[ts_key]
            used.add(ts_key)
    if "models" in props:
        out["model_overrides"] = json.loads(props["models"])
        used.add("models")
    if "model_snapshot" in props:  # a config snapshot's models, loaded in place of load_models
        try:
            out["model_snapshot"] = json.loads(props["model_snapshot"])
        except ValueError as exc:
            raise ValueError(f"config.properties model_snapshot is not valid JSON: {exc}") from None
        used.add("model_snapshot")
    used.add("tsConfigFile")  # TorchServe's own snapshots record the file they came from
    out.update(_logs_and_metrics(props))
    used |= {k for k in _LOG_KEYS if k in props}
    if "disable_token_authorization" in props:
        out["disable_token_auth"] = parse_boolean(props["disable_token_authorization"])
        used.add("disable_token_authorization")
    if "token_expiration_min" in props:
        out["token_expiration_min"] = _token_expiration_min(props["token_expiration_min"])
        used.add("token_expiration_min")
    for key in sorted(set(props) - used):
        if key in _DIFFERENT:
            log.warning("config.properties %s is not supported (ignored): %s", key, _DIFFERENT[key])
        else:
            log.warning("config.properties %s is not used by Mariner (ignored)", key)
    return out
