"""Server settings: every setting is a CLI flag, a MARINER_* environment variable and a config-file key.

Everything binds 127.0.0.1 unless configured otherwise.

This module is the settings themselves (`ServerConfig`, its fields and defaults) and what is
derived from them alone (the frontend count). Around it, each with one job: `config_flags`
(the command line and its help), `config_loading` (`load_config`: the layers of files, the
environment and flags, and the checks) and `configured_models` (the models the settings name
and the layers under their serving settings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


# Settings whose value is one of a few words: the parser offers them, load_config checks them.
SETTING_CHOICES: dict[str, tuple[str, ...]] = {"metrics_mode": ("log", "prometheus", "legacy")}


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
