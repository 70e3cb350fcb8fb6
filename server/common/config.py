"""Server settings: every setting is a CLI flag, a MARINER_* environment variable and a config-file key.

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
Everything binds 127.0.0.1 unless configured otherwise.

A model version's serving settings (batchSize, maxBatchDelay...) are layered once more, in
common.model_settings: built-in < `default_*` < config.properties `models={...}` < archive
model-config < our flags/env/file (`--batch-size`...) < a management register call.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from mariner.server.common.archive import UNLISTED, archive_file_name, store_archives
from mariner.server.common.config_snapshots import last_snapshot, snapshot_dir, snapshot_specs
from mariner.server.common.model_settings import (
    SNAPSHOT_KEYS,
    ServerLayers,
    SettingsOverrides,
    default_workers,
)
from mariner.server.common.models import ModelSpec
from mariner.server.compat.torchserve.flags import (
    add_torchserve_flags,
    take_torchserve_flags,
    torchserve_config_path,
)
from mariner.server.compat.torchserve.properties import (
    FIELDS_OF_KEY,
    from_torchserve_properties,
    read_properties,
    substitute_env,
    ts_env_props,
)


@dataclass(frozen=True)
class ServerConfig:
    model_store: Path = Path("model_store")
    # TorchServe's workflow store: where `POST /workflows?url=x.war` looks (None: the model store).
    workflow_store: Path | None = None
    # TorchServe's default: no model at start-up unless --models / load_models names some ("all"
    # for every archive of the store).
    models: str = ""
    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"
    metrics_address: str = "127.0.0.1:8082"
    grpc_inference_address: str = "127.0.0.1:7070"
    grpc_management_address: str = "127.0.0.1:7071"
    batch_size: int | None = None
    max_batch_delay_ms: float | None = None
    min_workers: int | None = None
    response_timeout_s: float | None = None
    max_queue: int | None = None
    # TorchServe's server-wide defaults (config.properties keys of the same names): under every
    # model's archive and models={...} entry, where the flags above are over them.
    default_workers_per_model: int | None = None
    default_response_timeout: float | None = None
    default_startup_timeout: float | None = None
    job_queue_size: int | None = None
    torch_threads: int | None = None
    frontends: int | None = None
    work_dir: Path | None = None
    max_request_bytes: int = 8 << 20
    # Request bytes a frontend holds at once, over all connections, and per stream (held_bytes).
    frontend_max_held_mb: int = 512
    stream_max_held_mb: int = 16
    # Connection limits of every HTTP listener (see common.http_limits), nginx-like defaults.
    http_max_header_bytes: int = 32 * 1024
    http_header_timeout_s: float = 20.0
    http_body_timeout_s: float = 60.0
    http_keep_alive_s: float = 5.0
    http_max_connections: int = 1000
    grace_seconds: float = 30.0
    refuse_seconds: float = 1.0
    slo_ms: float = 25.0
    metrics_config: Path | None = None
    enable_model_management: bool = False
    log_level: str = "INFO"
    access_log: bool = False
    # TorchServe's log files (logs/ or $LOG_LOCATION, $METRICS_LOCATION) and console (see ts_logging).
    ts_console: bool = True
    ts_log_files: bool = True
    ts_log_max_bytes: int = 100 * 1024 * 1024
    ts_log_backups: int = 5
    async_logging: bool = False
    # TorchServe's metrics: where they go (see compat.torchserve.metrics) and what is collected.
    metrics_mode: str = "log"
    model_metrics_auto_detect: bool = False
    disable_system_metrics: bool = False
    metric_time_interval: int = 60
    pin_index: bool = False
    require_gpu: bool = False
    install_py_dep_per_model: bool = False
    # Bounds on those installs (see supervisor.requirements): wheels only unless builds are allowed.
    install_py_dep_allow_builds: bool = False
    install_py_dep_timeout_s: float = 600.0
    install_py_dep_max_mb: int = 4096
    # TorchServe's request envelope for every model (json, kserve, kservev2, body), recorded
    # in each archive's manifest at registration as TorchServe's frontend does.
    service_envelope: str | None = None
    # Security: tokens never appear in repr/logs; prefer *_file or env over flags (ps shows argv).
    inference_token: str | None = field(default=None, repr=False)
    inference_token_file: Path | None = None
    management_token: str | None = field(default=None, repr=False)
    management_token_file: Path | None = None
    open_health: bool = True
    open_metrics: bool = True
    insecure: bool = False
    # Started as KServe's TorchServe ServingRuntime starts TorchServe's KServe image (see
    # torchserve_command): authentication is KServe's ingress's, as for that image's wrapper.
    kserve_runtime: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # Which listeners TLS covers (comma-separated names, see listeners.LISTENER_NAMES); None = all.
    tls_listeners: str | None = None
    # TorchServe's token authorization (key_file.json, see torchserve_tokens): on unless disabled,
    # as in TorchServe 0.12; keys expire after token_expiration_min minutes.
    disable_token_auth: bool = False
    token_expiration_min: float = 60.0
    config_file: Path | None = None
    model_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # TorchServe's config snapshots (config_snapshots): written under LOG_LOCATION/config, and the
    # newest restored by a start given no config file; a restored file's models (model_snapshot)
    # are loaded in place of `models`.
    config_snapshots: bool = True
    model_snapshot: Mapping[str, Any] | None = None
    # Connection limits of the gRPC inference listener (see common.grpc_server), per frontend.
    grpc_max_connections: int = 1000
    grpc_max_concurrent_streams: int = 256
    grpc_idle_timeout_s: float = 60.0
    # The worker budget (see supervisor.worker_budget): every path that starts workers passes it.
    max_workers_per_model: int = 64
    max_total_workers: int = 256
    worker_memory_check: bool = True


_HELP = {
    "model_store": "directory holding the .mar archives (archives load only from here)",
    "workflow_store": "directory holding TorchServe workflow archives (.war) for POST /workflows "
    "(torchserve's --workflow-store; default: the model store)",
    "models": "models to load at start-up: 'all' (every archive of the store), or 'file.mar' / "
    "'name=file.mar' entries, space- or comma-separated (torchserve's --models; default: none)",
    "inference_address": "HTTP inference listener host:port (TorchServe API, /ping, /healthz, /readyz)",
    "management_address": "HTTP management listener host:port (/models)",
    "metrics_address": "HTTP Prometheus listener host:port (/metrics)",
    "grpc_inference_address": "gRPC inference listener host:port",
    "grpc_management_address": "gRPC management listener host:port",
    "batch_size": "override every model's batchSize (over its archive and models={...})",
    "max_batch_delay_ms": "override every model's maxBatchDelay (ms to wait to fill a batch; 0 = never wait)",
    "min_workers": "override every model's instance count (minWorkers)",
    "response_timeout_s": "override every model's responseTimeout (seconds)",
    "max_queue": "override every model's queue: items queued per model version before requests are "
    "rejected (RESOURCE_EXHAUSTED)",
    "default_workers_per_model": "workers of a model whose archive and models={...} say none (TorchServe's "
    "key; default: one per GPU, else per CPU core)",
    "default_startup_timeout": "startupTimeout (s) of a model whose archive and models={...} say none: "
    "how long a worker may take to start and initialise its handler (TorchServe's default_startup_timeout)",
    "default_response_timeout": "responseTimeout (s) of a model whose archive and models={...} say none "
    "(TorchServe's key; default 120)",
    "job_queue_size": "queue (items) of a model whose archive says none (TorchServe's key; default 100)",
    "torch_threads": "torch intra-op threads for CPU inference (default: all cores but one)",
    "frontends": "inference frontend processes sharing the inference ports (default: 1 on up to 7 cores, "
    "else cores // 4, at most 8; provisional until the benchmark settles it)",
    "work_dir": "where archives are unpacked (default: a private temp dir, removed at exit)",
    "max_request_bytes": "largest gRPC message / HTTP body accepted",
    "frontend_max_held_mb": "MiB of request bodies and messages one frontend process holds at once, over "
    "every connection: a unary call that does not fit is refused 503 / RESOURCE_EXHAUSTED with "
    "Retry-After, and streams stop reading once they hold half of it",
    "stream_max_held_mb": "MiB of requests one gRPC stream holds (read and not yet answered) before it "
    "stops reading until its answers are written",
    "http_max_header_bytes": "largest HTTP request line + headers, in bytes (larger: 431 and the connection "
    "closes)",
    "http_header_timeout_s": "seconds a client has to send a request's line and headers, from the "
    "connection's start or the request's first byte (else 408 and close)",
    "http_body_timeout_s": "seconds a client has to send a request's whole body once its headers are in "
    "(else 408 and close)",
    "http_keep_alive_s": "seconds an idle keep-alive HTTP connection stays open",
    "http_max_connections": "open connections per HTTP listener and process; more are answered 503 and "
    "closed",
    "grace_seconds": "on SIGTERM, how long accepted requests may take to finish",
    "refuse_seconds": "after draining, keep refusing new calls with UNAVAILABLE this long before closing",
    "slo_ms": "p99 latency SLO: histogram buckets are dense around it",
    "metrics_config": "TorchServe metrics.yaml naming the TorchServe metrics served on /metrics beside "
    "mariner_* (default: TorchServe's default metrics.yaml)",
    "enable_model_management": "allow register/unregister (archives from the model store only)",
    "log_level": "DEBUG, INFO, WARNING, ERROR",
    "access_log": "log one line per HTTP request",
    "ts_console": "print TorchServe's console on stdout: its log lines (worker output, worker lifecycle, "
    "access and metric lines) and 'Model server started.'; off, a worker's output goes to the JSON log on "
    "stderr instead (TorchServe's log files are written either way, see ts_log_files)",
    "ts_log_files": "write TorchServe's log files (ts_log.log, model_log.log, access_log.log under "
    "$LOG_LOCATION, ts_metrics.log, model_metrics.log under $METRICS_LOCATION; default ./logs)",
    "ts_log_max_bytes": "size at which each of TorchServe's log files (ts_log.log, model_log.log, "
    "access_log.log, ts_metrics.log, model_metrics.log) is rotated (default 100 MiB, as TorchServe's log4j)",
    "ts_log_backups": "rotated files kept per TorchServe log file (default 5; 0 keeps none)",
    "async_logging": "TorchServe's async_logging: write its log files in batches (flushed every second) "
    "instead of after every batch of lines",
    "metrics_mode": "TorchServe's metrics_mode: log (its default: ts_metrics.log and model_metrics.log), "
    "prometheus (its metrics on /metrics) or legacy (three counters on /metrics, the rest logged); "
    "mariner_* metrics are on /metrics in every mode",
    "model_metrics_auto_detect": "keep handler metrics that metrics.yaml does not declare (TorchServe drops "
    "them unless this is on)",
    "disable_system_metrics": "collect no host metrics (CPU, memory, disk)",
    "metric_time_interval": "seconds between host metric samples in the log metrics modes (TorchServe's "
    "metric_time_interval; default 60)",
    "pin_index": "refuse archives not listed with their sha256 in MODEL_STORE/index.json",
    "require_gpu": "never serve a model on the CPU unless its model-config says deviceType: cpu: without a "
    "usable GPU such a model fails to load, with the reason, instead of falling back",
    "install_py_dep_per_model": "pip-install each archive's requirements file (model.requirementsFile) into "
    "that model's own directory before its workers start (TorchServe's install_py_dep_per_model)",
    "install_py_dep_allow_builds": "let pip build a requirement from source (runs the package's setup code "
    "as the server's user); off, only binary wheels are installed",
    "install_py_dep_timeout_s": "seconds one archive's requirements may take to install (pip is stopped "
    "after that and the model fails)",
    "install_py_dep_max_mb": "MiB pip may write (downloads and installed files) for one archive's "
    "requirements (pip is stopped past that and the model fails)",
    "service_envelope": "TorchServe request envelope wrapped around every model's handler: json, kserve, "
    "kservev2 or body (TorchServe's service_envelope)",
    "inference_token": "bearer token(s), comma-separated, for inference APIs (prefer the env var or a file)",
    "inference_token_file": "file with inference bearer tokens, one per line",
    "management_token": "bearer token(s) for management APIs and (unless open) metrics",
    "management_token_file": "file with management bearer tokens, one per line",
    "open_health": "health checks (/ping, /healthz, /readyz, /v2/health/*, grpc.health.v1) need no token",
    "open_metrics": "/metrics needs no token",
    "insecure": "allow listening beyond loopback without tokens (not recommended)",
    "kserve_runtime": "serve as TorchServe's KServe image (`mariner serve torchserve ...` sets it): with "
    "TorchServe's token authorization turned off, listeners beyond loopback start without credentials, "
    "as that image's KServe wrapper does (authentication is KServe's ingress's)",
    "tls_cert_file": "PEM certificate: serve gRPC and HTTP over TLS",
    "tls_key_file": "PEM private key for --tls-cert-file",
    "tls_client_ca_file": "PEM CA bundle: require client certificates signed by it (mTLS)",
    "tls_listeners": "listeners served over TLS when a certificate is set, comma-separated: inference, "
    "management, metrics, grpc_inference, grpc_management (default: all of them)",
    "disable_token_auth": "turn off TorchServe's token authorization (key_file.json in the working "
    "directory and the /token API; torchserve's --disable-token-auth, --dt)",
    "token_expiration_min": "minutes before TorchServe's inference and management keys expire (TorchServe's "
    "token_expiration_min; the token API makes new ones)",
    "config_file": "YAML/JSON config, or a TorchServe config.properties",
    "config_snapshots": "write TorchServe's config snapshots (LOG_LOCATION/config/*-startup|snapshot|"
    "shutdown.cfg) and, when no config file is given, restore the newest at start (torchserve's --ncs / "
    "--no-config-snapshots turn it off)",
    "grpc_max_connections": "open connections to the gRPC inference listener per frontend; more are closed "
    "at once",
    "grpc_max_concurrent_streams": "concurrent calls (HTTP/2 streams) per gRPC connection, advertised to "
    "clients; more are refused",
    "grpc_idle_timeout_s": "seconds a gRPC connection without calls stays open (then GOAWAY; clients "
    "reconnect when they next call)",
    "max_workers_per_model": "most worker processes one model version may have (archive minWorkers, "
    "models=, register, scale); more is refused with 400",
    "max_total_workers": "most worker processes of all models together",
    "worker_memory_check": "refuse worker counts that the host's or cgroup's free memory and threads "
    "cannot hold (each worker's cost is measured once it is ready)",
}


_CHOICES: dict[str, tuple[str, ...]] = {"metrics_mode": ("log", "prometheus", "legacy")}


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mariner serve", description="Serve TorchServe .mar archives fast.")
    for f in fields(ServerConfig):
        if f.name in ("model_overrides", "model_snapshot"):  # config-file values, never flags
            continue
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP[f.name])
        elif f.name in _CHOICES:
            p.add_argument(
                flag,
                default=None,
                choices=_CHOICES[f.name],
                help=f"{_HELP[f.name]} (env MARINER_{f.name.upper()})",
            )
        elif f.name == "models":  # torchserve's `--models a=a.mar b.mar` as well as ours, comma-separated
            p.add_argument(flag, nargs="+", default=None, help=f"{_HELP[f.name]} (env MARINER_MODELS)")
        else:
            p.add_argument(flag, default=None, help=f"{_HELP[f.name]} (env MARINER_{f.name.upper()})")
    add_torchserve_flags(p)
    return p


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
    for name, allowed in _CHOICES.items():
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


def default_frontends(cores: int | None = None) -> int:
    """How many frontend processes `mariner serve` starts when `--frontends` is not given.

    One on small machines: on <= 2 cores a second frontend only competes with the model workers
    for the same cores. Above that, a quarter of the cores (at most 8), leaving the rest to the
    workers' torch threads. Provisional: the benchmark's frontends x workers table settles it.
    """
    cores = cores or os.cpu_count() or 1
    if cores <= 2:
        return 1
    return max(1, min(8, cores // 4))


def frontend_count(cfg: ServerConfig) -> int:
    """`cfg.frontends`, checked, or the default for this machine."""
    if cfg.frontends is None:
        return default_frontends()
    if cfg.frontends < 1:
        raise ValueError(f"frontends must be a positive integer, got {cfg.frontends}")
    return cfg.frontends


def available_cores() -> int:
    """CPU cores this process may run on (its affinity, as the JVM's availableProcessors)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def server_layers(cfg: ServerConfig, gpus: int = 0, cores: int | None = None) -> ServerLayers:
    """The layers every model version's settings resolve over (see common.model_settings): the
    built-in worker count (one per GPU of `gpus`, else per core), the `default_*` keys,
    config.properties `models={...}`, and flags / MARINER_* env / our config file.

    Raises ServingError(INVALID_ARGUMENT) naming the field when a value is not allowed.
    """
    # TorchServe reads default_workers_per_model=0 as "not set" (GPUs, else cores).
    workers = cfg.default_workers_per_model or None
    defaults = [
        SettingsOverrides.parse({"minWorkers": workers, "maxWorkers": workers}, "default_workers_per_model"),
        SettingsOverrides.parse(
            {"responseTimeout": cfg.default_response_timeout}, "default_response_timeout"
        ),
        SettingsOverrides.parse({"startupTimeout": cfg.default_startup_timeout}, "default_startup_timeout"),
        SettingsOverrides.parse({"maxQueue": cfg.job_queue_size}, "job_queue_size"),
    ]
    flags = SettingsOverrides.parse(
        {
            "batchSize": cfg.batch_size,
            "maxBatchDelay": cfg.max_batch_delay_ms,
            "responseTimeout": cfg.response_timeout_s,
            "minWorkers": cfg.min_workers,
            "maxQueue": cfg.max_queue,
        },
        "the server's flags, MARINER_* environment or config file",
    )
    return ServerLayers(
        per_model=cfg.model_overrides,
        flags=flags,
        defaults=SettingsOverrides(**{k: v for d in defaults for k, v in d.given().items()}),
        startup_workers=default_workers(gpus, available_cores() if cores is None else cores),
    )


def model_specs(cfg: ServerConfig, pinned: Mapping[str, str] | None = None) -> list[ModelSpec]:
    """Expand `models` ('all', a list, or nothing: TorchServe loads no model by default) into
    ModelSpecs.

    Their serving settings are resolved when each archive is opened (its model-config is the
    lowest layer), over `server_layers(cfg)`.
    """
    if cfg.model_snapshot is not None:
        return _snapshot_model_specs(cfg.model_snapshot, pinned)
    entries: list[tuple[str | None, str]] = []
    if cfg.models.strip().lower() == "all":
        entries = [(None, name) for name in store_archives(cfg.model_store)]
    else:
        for item in cfg.models.split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, archive = item.partition("=")
            if sep:
                entries.append((name.strip(), archive.strip()))
            else:
                entries.append((None, archive_file_name(cfg.model_store, item)))
    return [
        ModelSpec(
            archive=archive, name=name, sha256=None if pinned is None else pinned.get(archive, UNLISTED)
        )
        for name, archive in entries
    ]


def _snapshot_model_specs(
    model_snapshot: Mapping[str, Any], pinned: Mapping[str, str] | None
) -> list[ModelSpec]:
    """A config snapshot's model versions, each with its snapshot settings as the top layer (as
    TorchServe's Model.setModelState), the default version of each model first."""
    try:
        versions = snapshot_specs(model_snapshot)
    except ValueError as exc:
        raise ValueError(f"config snapshot: {exc}") from None
    specs = []
    for name, archive, entry, _default in versions:
        overrides = SettingsOverrides.parse(
            {k: entry.get(k) for k in SNAPSHOT_KEYS}, f"config snapshot models[{name!r}]"
        )
        sha = None if pinned is None else pinned.get(archive, UNLISTED)
        specs.append(ModelSpec(archive=archive, name=name, overrides=overrides, sha256=sha))
    return specs


def pinned_digests(store: Path) -> dict[str, str]:
    """archive file name -> sha256 from the store's index.json (written by the pipeline)."""
    index = json.loads((store / "index.json").read_text())
    return {a["file"]: a["sha256"] for a in index.get("archives", [])}
