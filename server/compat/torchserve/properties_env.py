"""TorchServe's environment over `config.properties`, as its ConfigManager reads it: a value's
`$$NAME$$` is replaced by the variable NAME (an unset one is an error), and with
`enable_envvars_config=true` in the file each `TS_*` variable of `TS_ENV_KEYS` replaces its
key, over the file and over the torchserve flags (`--model-store`, `--models`): TorchServe
applies them last. Only the variables TorchServe knows count (its ConfigManager constants:
`TS_<KEY>` for key `<key>` with four exceptions, see `TS_ENV_KEYS`); `TS_ALLOWED_URLS` only
with `use_env_allowed_urls=true`.

Apart from `properties` (what each key means for Mariner): this says which keys the
environment sets, and which settings it thereby decided (`FIELDS_OF_KEY`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from mariner.server.compat.torchserve.java_properties import parse_boolean

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
    if not parse_boolean(props.get("enable_envvars_config", "false")):
        return {}
    allow_urls = parse_boolean(props.get("use_env_allowed_urls", "false"))
    return {
        key: env[var]
        for var, key in TS_ENV_KEYS.items()
        if var in env and (key != "allowed_urls" or allow_urls)
    }
