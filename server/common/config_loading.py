"""Loading the server settings: every place they are given, layered, coerced and checked.

Precedence: built-in defaults < TorchServe config.properties < our config file < MARINER_*
environment < command line < `TS_*` variables (only with `enable_envvars_config=true` in the
properties file; TorchServe applies them over its command line). Our config file is YAML/JSON
with our keys (`--config-file`, MARINER_CONFIG_FILE; a `.properties` one is TorchServe's). The
TorchServe file is `--ts-config`, `TS_CONFIG_FILE` or `./config.properties` (torchserve_flags);
of it we understand the keys users already have (`inference_address`, `management_address`,
`metrics_address`, `grpc_inference_port`, `grpc_management_port`, `model_store`,
`load_models`, `default_workers_per_model`, `default_response_timeout`, `job_queue_size`,
`models={...}` with batchSize/maxBatchDelay/minWorkers/maxWorkers/responseTimeout/deviceType,
and TLS: https:// addresses, `enable_grpc_ssl`, `private_key_file`, `certificate_file`);
torchserve_properties warns about every other key and refuses what it cannot honour.

`load_config` is the one way from those places to a `ServerConfig` (config.py); a start given no
config file restores the newest config snapshot (config_snapshots) as its TorchServe file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from mariner.server.common.config import SETTING_CHOICES, ServerConfig
from mariner.server.common.config_flags import build_parser
from mariner.server.common.config_snapshots import last_snapshot, snapshot_dir
from mariner.server.compat.torchserve.flags import take_torchserve_flags, torchserve_config_path
from mariner.server.compat.torchserve.java_properties import read_properties
from mariner.server.compat.torchserve.properties import from_torchserve_properties
from mariner.server.compat.torchserve.properties_env import FIELDS_OF_KEY, substitute_env, ts_env_props


def _coerce(name: str, value: Any) -> Any:
    if value is None:
        return None
    kind = {f.name: f.type for f in fields(ServerConfig)}[name]
    if "bool" in str(kind):
        if isinstance(value, bool):
            return value
        return str(value).strip().lower() in ("1", "true", "yes", "on")
    if "Path" in str(kind):
        return Path(str(value))
    if "int" in str(kind):
        return int(value)
    if "float" in str(kind):
        return float(value)
    if "Mapping" in str(kind):
        return value
    return str(value)


def read_torchserve_config(path: Path, env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TorchServe config.properties as our settings, with `$$VAR$$` substituted and, when it
    says `enable_envvars_config=true`, the `TS_*` variables over its keys; and the settings the
    `TS_*` variables decided (they beat the command line, as in TorchServe)."""
    props = substitute_env(read_properties(path.read_text()), env)
    from_env = ts_env_props(props, env)
    settings = from_torchserve_properties({**props, **from_env})
    decided = {f for key in from_env for f in FIELDS_OF_KEY.get(key, ())}
    return settings, {f: settings[f] for f in decided if f in settings}


def read_config_file(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".properties":
        return read_torchserve_config(path, os.environ if env is None else env)[0]
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings")
    unknown = set(data) - {f.name for f in fields(ServerConfig)}
    if unknown:
        raise ValueError(f"config file {path}: unknown keys {sorted(unknown)}")
    return data


def load_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> ServerConfig:
    """defaults < TorchServe config.properties < our config file < MARINER_* env < flags <
    TS_* env (when the properties file enables it). `cwd` is where `./config.properties` is
    looked for (TorchServe's fallback when no config file is given)."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(argv))
    ts_flags = take_torchserve_flags(args)
    if ts_flags.enable_model_api and args.get("enable_model_management") is None:
        args["enable_model_management"] = True
    config_file = args.get("config_file") or env.get("MARINER_CONFIG_FILE")
    ours_is_properties = bool(config_file) and Path(str(config_file)).suffix == ".properties"
    ts_file = _restored_snapshot(args, env, cwd, ts_flags.ts_config, config_file) or torchserve_config_path(
        ts_flags.ts_config, env, cwd, others=bool(config_file)
    )
    if ts_file is not None and ours_is_properties:
        raise ValueError(
            f"two TorchServe config files: {config_file} (--config-file / MARINER_CONFIG_FILE) and "
            f"{ts_file} (--ts-config / TS_CONFIG_FILE / ./config.properties): give one"
        )
    merged: dict[str, Any] = {}
    from_ts_env: dict[str, Any] = {}
    if ts_file is not None:
        settings, from_ts_env = read_torchserve_config(ts_file, env)
        merged.update(settings)
        merged["config_file"] = ts_file
    if config_file:
        if ours_is_properties:
            settings, from_ts_env = read_torchserve_config(Path(config_file), env)
        else:
            settings = read_config_file(Path(config_file), env)
        # A YAML null means "not set here": it leaves a lower layer's value.
        merged.update({k: v for k, v in settings.items() if v is not None})
        merged["config_file"] = config_file
    for f in fields(ServerConfig):
        key = f"MARINER_{f.name.upper()}"
        if key in env and f.name not in ("model_overrides", "model_snapshot"):
            merged[f.name] = env[key]
    merged.update({k: v for k, v in args.items() if v is not None})
    merged.update(from_ts_env)  # TorchServe applies TS_* variables after its command line
    coerced = {}
    for k, v in merged.items():
        try:
            coerced[k] = _coerce(k, v)
        except ValueError:  # say which setting, not only Python's "invalid literal for int()"
            kind = {f.name: f.type for f in fields(ServerConfig)}[k]
            raise ValueError(f"{k} must be {str(kind).replace(' | None', '')}, got {v!r}") from None
    cfg = replace(ServerConfig(), **coerced)
    for name, allowed in SETTING_CHOICES.items():
        # The parser checks flags; env and file values are checked here, naming the setting.
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    # Connection limits and worker caps: a zero would refuse or drop every request, or every worker.
    positive = {
        "max_workers_per_model",
        "max_total_workers",
        "grpc_max_connections",
        "grpc_max_concurrent_streams",
        "ts_log_max_bytes",
        "metric_time_interval",
        "install_py_dep_timeout_s",
        "install_py_dep_max_mb",
        "frontend_max_held_mb",
        "stream_max_held_mb",
    }
    for f in fields(cfg):
        if (f.name.startswith("http_") or f.name in positive) and not getattr(cfg, f.name) > 0:
            raise ValueError(f"{f.name} must be positive, got {getattr(cfg, f.name)!r}")
    if cfg.ts_log_backups < 0:
        raise ValueError(f"ts_log_backups must be 0 or more, got {cfg.ts_log_backups!r}")
    if cfg.frontend_max_held_mb << 20 < cfg.max_request_bytes:
        raise ValueError(
            f"frontend_max_held_mb ({cfg.frontend_max_held_mb} MiB) must hold at least one request of "
            f"max_request_bytes ({cfg.max_request_bytes} bytes)"
        )
    if cfg.stream_max_held_mb > cfg.frontend_max_held_mb:
        raise ValueError(
            f"stream_max_held_mb ({cfg.stream_max_held_mb}) must be at most frontend_max_held_mb "
            f"({cfg.frontend_max_held_mb})"
        )
    return cfg


def _restored_snapshot(
    args: Mapping[str, Any], env: Mapping[str, str], cwd: Path | None, ts_config: str | None, ours: Any
) -> Path | None:
    """The config snapshot a start restores, as TorchServe's ConfigManager chooses it: only when no
    config file is given (TS_CONFIG_FILE, --ts-config, --config-file / MARINER_CONFIG_FILE) and
    snapshots are on; then the newest one that is safe to read (config_snapshots)."""
    if env.get("TS_CONFIG_FILE") or ts_config or ours:
        return None
    wanted = args.get("config_snapshots")
    if wanted is None:
        wanted = _coerce("config_snapshots", env.get("MARINER_CONFIG_SNAPSHOTS", True))
    if not wanted:
        return None
    return last_snapshot(snapshot_dir(env, cwd))  # the supervisor says so once it logs
