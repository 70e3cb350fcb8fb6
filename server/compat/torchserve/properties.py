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

Environment, as TorchServe's ConfigManager reads it: a value's `$$NAME$$` is replaced by the
variable NAME (an unset one is an error), and with `enable_envvars_config=true` in the file each
`TS_*` variable of `TS_ENV_KEYS` replaces its key, over the file and over the torchserve flags
(`--model-store`, `--models`): TorchServe applies them last. Only the variables TorchServe
knows count (its ConfigManager constants: `TS_<KEY>` for key `<key>` with four exceptions, see
`TS_ENV_KEYS`); `TS_ALLOWED_URLS` only with `use_env_allowed_urls=true`.
"""

from __future__ import annotations

import json
import logging
import math
import re
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
    "allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "use_env_allowed_urls": "Mariner loads archives from the model store only, never from a URL",
    "enable_metrics_api": "Mariner always serves /metrics on metrics_address (see --open-metrics)",
    "cors_allowed_origin": "Mariner sends no CORS headers: browsers on other origins are refused",
    "max_request_size": "use --max-request-bytes",
    "max_response_size": "use --max-request-bytes (it bounds gRPC messages both ways)",
}


# TorchServe 0.12's ConfigManager `TS_*` constants: the variable -> the key it sets. The rule is
# TS_<KEY_UPPER> -> <key>, except TS_DEBUG (debug), TS_OPEN_INFERENCE_PROTOCOL, TS_HEADER_KEY_*
# (their keys keep a ts_ prefix) and TS_TOKEN_EXPIRATION_TIME_MIN (token_expiration_min). Keys
# without a constant (models, model_snapshot, enable_envvars_config...) cannot come from the
# environment.
_PLAIN_ENV_KEYS = (
    "inference_address",
    "management_address",
    "metrics_address",
    "load_models",
    "blacklist_env_vars",
    "default_workers_per_model",
    "default_response_timeout",
    "default_startup_timeout",
    "unregister_model_timeout",
    "number_of_netty_threads",
    "netty_client_threads",
    "job_queue_size",
    "number_of_gpu",
    "metrics_config",
    "metrics_mode",
    "model_metrics_auto_detect",
    "disable_system_metrics",
    "ipex_enable",
    "cpu_launcher_enable",
    "cpu_launcher_args",
    "ipex_gpu_enable",
    "async_logging",
    "cors_allowed_origin",
    "cors_allowed_methods",
    "cors_allowed_headers",
    "decode_input_request",
    "keystore",
    "keystore_pass",
    "keystore_type",
    "certificate_file",
    "private_key_file",
    "max_request_size",
    "max_response_size",
    "limit_max_image_pixels",
    "default_service_handler",
    "service_envelope",
    "model_server_home",
    "model_store",
    "prefer_direct_buffer",
    "allowed_urls",
    "install_py_dep_per_model",
    "enable_metrics_api",
    "grpc_inference_address",
    "grpc_management_address",
    "grpc_inference_port",
    "grpc_management_port",
    "grpc_inference_max_connection_age_ms",
    "grpc_management_max_connection_age_ms",
    "grpc_inference_max_connection_age_grace_ms",
    "grpc_management_max_connection_age_grace_ms",
    "enable_grpc_ssl",
    "initial_worker_port",
    "initial_distribution_port",
    "workflow_store",
    "cpp_log_config",
    "disable_token_authorization",
    "enable_model_api",
)
TS_ENV_KEYS: dict[str, str] = {
    **{f"TS_{key.upper()}": key for key in _PLAIN_ENV_KEYS},
    "TS_DEBUG": "debug",
    "TS_OPEN_INFERENCE_PROTOCOL": "ts_open_inference_protocol",
    "TS_TOKEN_EXPIRATION_TIME_MIN": "token_expiration_min",
    "TS_HEADER_KEY_SEQUENCE_ID": "ts_header_key_sequence_id",
    "TS_HEADER_KEY_SEQUENCE_START": "ts_header_key_sequence_start",
    "TS_HEADER_KEY_SEQUENCE_END": "ts_header_key_sequence_end",
}
# TorchServe key -> the ServerConfig fields it sets here (to know which fields a TS_* variable
# decided, since those beat the command line as in TorchServe).
FIELDS_OF_KEY: dict[str, tuple[str, ...]] = {
    "inference_address": ("inference_address", "tls_listeners"),
    "management_address": ("management_address", "tls_listeners"),
    "metrics_address": ("metrics_address", "tls_listeners"),
    "enable_grpc_ssl": ("tls_listeners",),
    "grpc_inference_address": ("grpc_inference_address",),
    "grpc_inference_port": ("grpc_inference_address",),
    "grpc_management_address": ("grpc_management_address",),
    "grpc_management_port": ("grpc_management_address",),
    "model_store": ("model_store",),
    "workflow_store": ("workflow_store",),
    "load_models": ("models",),
    "default_workers_per_model": ("default_workers_per_model",),
    "default_response_timeout": ("default_response_timeout",),
    "default_startup_timeout": ("default_startup_timeout",),
    "job_queue_size": ("job_queue_size",),
    "enable_model_api": ("enable_model_management",),
    "metrics_config": ("metrics_config",),
    "metrics_mode": ("metrics_mode",),
    "model_metrics_auto_detect": ("model_metrics_auto_detect",),
    "disable_system_metrics": ("disable_system_metrics",),
    "install_py_dep_per_model": ("install_py_dep_per_model",),
    "private_key_file": ("tls_key_file",),
    "certificate_file": ("tls_cert_file",),
    "disable_token_authorization": ("disable_token_auth",),
    "token_expiration_min": ("token_expiration_min",),
}
# TorchServe's default token lifetime, also what it uses when token_expiration_min is not a number.
DEFAULT_TOKEN_EXPIRATION_MIN = 60.0
_SUBSTITUTION = re.compile(r"\$\$([^$]+[^$])\$\$")  # ConfigManager's pattern


def substitute_env(props: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """`$$NAME$$` in a value replaced by the variable NAME, as TorchServe does for every key.
    Raises ValueError naming a variable that is not set (TorchServe refuses to start too)."""

    def one(key: str, value: str) -> str:
        def repl(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise ValueError(
                    f"config.properties {key}: environment variable {name} (from $${name}$$) is not set"
                )
            return env[name]

        return _SUBSTITUTION.sub(repl, value)

    return {key: one(key, value) for key, value in props.items()}


def ts_env_props(props: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The keys the `TS_*` variables set, when the file says `enable_envvars_config=true`
    (else none: TorchServe ignores them)."""
    if not _true(props.get("enable_envvars_config", "false")):
        return {}
    allow_urls = _true(props.get("use_env_allowed_urls", "false"))
    return {
        key: env[var]
        for var, key in TS_ENV_KEYS.items()
        if var in env and (key != "allowed_urls" or allow_urls)
    }


def read_properties(text: str) -> dict[str, str]:
    """Java .properties as java.util.Properties.load reads them: `key=value`, `key: value` or
    `key value` lines, '#'/'!' comments, a line ending in an odd number of backslashes continued
    on the next, and escapes (`\\:`, `\\=`, `\\n`, `\\uXXXX`, any other `\\x` is `x`): what
    TorchServe reads, and how its config snapshots are written. A value's trailing spaces are
    dropped (Java keeps them; a path ending in a space is never what was meant)."""
    out: dict[str, str] = {}
    logical, buf, continued = [], "", False
    for raw in text.splitlines():
        line = raw.lstrip(" \t\f")
        if not continued and (not line or line.startswith(("#", "!"))):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        continued = trailing % 2 == 1
        if continued:
            buf += line[:-1]
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    for line in logical:
        key, value = _split_property(line)
        if key:
            out[key] = value.rstrip()
    return out


def _split_property(line: str) -> tuple[str, str]:
    """A logical line's key (up to the first unescaped '=', ':' or blank) and value, unescaped."""
    i = 0
    while i < len(line) and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    key, rest = line[:i], line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return _unescape(key), _unescape(rest)


_ESCAPED = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_UNICODE = re.compile(r"[0-9a-fA-F]{4}")


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "\\" or i + 1 == len(text):
            out.append(ch)
            i += 1
        elif text[i + 1] == "u" and _UNICODE.fullmatch(text[i + 2 : i + 6]):
            out.append(chr(int(text[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(_ESCAPED.get(text[i + 1], text[i + 1]))
            i += 2
    return "".join(out)


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
    return f"{host}:{default_port if u.port is None else u.port}", u.scheme == "https"


def _tls(props: Mapping[str, str], https: Mapping[str, bool]) -> dict[str, Any]:
    """Our TLS settings for the listeners TorchServe would encrypt (the others stay plain, as
    there), or ValueError when the key material is missing or only a Java keystore."""
    grpc_tls = _true(props.get("enable_grpc_ssl", "false"))
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
        out["disable_token_auth"] = _true(props["disable_token_authorization"])
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
