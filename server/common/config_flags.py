"""`mariner serve`'s command line: a flag for every ServerConfig field, with its help.

Kept apart from `config` (the fields) because the help texts are most of it, and from
`config_loading` (which parses the flags with this parser) because `mariner serve --help` needs
only this.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from mariner.server.common.config import SETTING_CHOICES, ServerConfig
from mariner.server.compat.torchserve.flags import add_torchserve_flags

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mariner serve", description="Serve TorchServe .mar archives fast.")
    for f in fields(ServerConfig):
        if f.name in ("model_overrides", "model_snapshot"):  # config-file values, never flags
            continue
        flag = "--" + f.name.replace("_", "-")
        if "bool" in str(f.type):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=_HELP[f.name])
        elif f.name in SETTING_CHOICES:
            p.add_argument(
                flag,
                default=None,
                choices=SETTING_CHOICES[f.name],
                help=f"{_HELP[f.name]} (env MARINER_{f.name.upper()})",
            )
        elif f.name == "models":  # torchserve's `--models a=a.mar b.mar` as well as ours, comma-separated
            p.add_argument(flag, nargs="+", default=None, help=f"{_HELP[f.name]} (env MARINER_MODELS)")
        else:
            p.add_argument(flag, default=None, help=f"{_HELP[f.name]} (env MARINER_{f.name.upper()})")
    add_torchserve_flags(p)
    return p
