"""The supervisor's config snapshots: what goes into them and when they are written.

TorchServe writes one at start (`startup`), after every management change that succeeded
(`snapshot`: register, unregister, scale, set-default) and at a clean stop (`shutdown`). The
settings part is a config.properties a later start can read: the TorchServe config file this
server read (its keys as written, `$$VAR$$` substituted), with the keys Mariner maps set to what
the server runs with (model store, listeners and their TLS, defaults, the model API, TorchServe's
token authorization and key lifetime, per-model dependencies), whatever the file said; the models
part is every version served (`ModelViews.snapshot_models`). Mariner's own settings (tokens,
limits) are not TorchServe keys and are never written. The file format and which snapshot a
start restores are `config_snapshots`'s.

Writing never runs on the event loop (the file system may be slow or full) and never stops the
server: a location that cannot be written is named in one warning and left alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_snapshots import snapshot_dir, write_snapshot
from mariner.server.common.listeners import LISTENER_NAMES, tls_listeners
from mariner.server.compat.torchserve.java_properties import read_properties
from mariner.server.compat.torchserve.properties_env import substitute_env

log = logging.getLogger("mariner.supervisor")

Models = Mapping[str, Mapping[str, Mapping[str, Any]]]
_HTTP = (
    ("inference_address", "inference_address"),
    ("management_address", "management_address"),
    ("metrics_address", "metrics_address"),
)
_DEFAULTS = (
    "default_workers_per_model",
    "default_response_timeout",
    "default_startup_timeout",
    "job_queue_size",
)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _read_file_props(cfg: ServerConfig, env: Mapping[str, str]) -> dict[str, str]:
    """The TorchServe config file's own keys (none when the config is ours, YAML/JSON)."""
    path = cfg.config_file
    if path is None or Path(path).suffix not in (".properties", ".cfg"):
        return {}
    try:
        props = substitute_env(read_properties(Path(path).read_text()), env)
    except (OSError, ValueError) as exc:
        log.warning("config snapshots: cannot re-read %s (%s); writing the server's settings only", path, exc)
        return {}
    return {k: v for k, v in props.items() if k not in ("model_snapshot", "tsConfigFile")}


def _encrypted(cfg: ServerConfig) -> frozenset[str]:
    """The listeners a snapshot writes as TLS: `listeners.tls_listeners`, the rule the server
    serves by, so that a restored snapshot encrypts exactly what this server does (a second
    parser here disagreed with it: an empty `tls_listeners` is no listener there). A setting it
    refuses (ValueError) fails the start in `check_exposure`, before any snapshot is written, and
    that error is the one to show, not a traceback from here; until then every listener counts
    as encrypted, so that a mistake can only ever write TLS, never plain text."""
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return frozenset()
    try:
        return tls_listeners(cfg)
    except ValueError:
        return frozenset(LISTENER_NAMES)


def snapshot_properties(cfg: ServerConfig, env: Mapping[str, str]) -> dict[str, str]:
    """The settings part of every snapshot: the file's keys, with what the server runs with.

    Every key the server's settings decide is written from `cfg`, never left as the file had it:
    flags and environment variables (MARINER_*, TS_*) override the file, and a snapshot that
    kept the file's value would restore a server other than this one, e.g. with token
    authorization off or keys that live longer than the running server allows."""
    props = _read_file_props(cfg, env)
    encrypted = _encrypted(cfg)
    for key, field in _HTTP:
        scheme = "https" if key.removesuffix("_address") in encrypted else "http"
        props[key] = f"{scheme}://{getattr(cfg, field)}"
    for which in ("inference", "management"):
        host, _, port = str(getattr(cfg, f"grpc_{which}_address")).rpartition(":")
        props[f"grpc_{which}_address"], props[f"grpc_{which}_port"] = host, port
    props.pop("enable_grpc_ssl", None)
    if encrypted:
        props.update(private_key_file=str(cfg.tls_key_file), certificate_file=str(cfg.tls_cert_file))
        if {"grpc_inference", "grpc_management"} & encrypted:  # TorchServe's key covers both
            props["enable_grpc_ssl"] = "true"
    props["model_store"] = str(cfg.model_store)
    if cfg.models:
        props["load_models"] = cfg.models
    props.pop("enable_model_api", None)
    if cfg.enable_model_management:
        props["enable_model_api"] = "true"
    for key in _DEFAULTS:
        value = getattr(cfg, key)
        if value is not None:
            props[key] = _number(value)
    if cfg.model_overrides:
        props["models"] = json.dumps(cfg.model_overrides)
    props["install_py_dep_per_model"] = "true" if cfg.install_py_dep_per_model else "false"
    if cfg.service_envelope:
        props["service_envelope"] = cfg.service_envelope
    if cfg.metrics_config is not None:
        props["metrics_config"] = str(cfg.metrics_config)
    props["disable_token_authorization"] = "true" if cfg.disable_token_auth else "false"
    props["token_expiration_min"] = _number(cfg.token_expiration_min)
    return props


class ConfigSnapshots:
    """Writes the supervisor's config snapshots, one at a time, off the event loop.

    `models` answers the models part on the event loop (it reads the registry, which only the
    loop changes); the file is written in a thread, one at a time. A management call answers once
    its change's snapshot is written (`changed`), as TorchServe's does."""

    def __init__(
        self, cfg: ServerConfig, models: Callable[[], Models], env: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if env is None else env
        self.enabled = cfg.config_snapshots
        self.directory = snapshot_dir(env)
        self._props = snapshot_properties(cfg, env) if self.enabled else {}
        self._models = models
        self._lock = asyncio.Lock()  # files in the order of the changes they record
        self._warned = False
        if cfg.model_snapshot is not None:
            source = Path(str(cfg.config_file))
            if source.parent.resolve() == self.directory.resolve():
                log.info(
                    "restoring config snapshot %s: its settings and models, in place of --models "
                    "(no config file was given; --ncs starts without it)",
                    source,
                )
            else:  # a config.properties given with a model_snapshot (KServe's TorchServe layout)
                log.info("serving the models of model_snapshot in %s, in place of --models", source)

    async def changed(self) -> None:
        """A management change succeeded: its snapshot, written before its call answers."""
        await self.save("snapshot")

    async def save(self, kind: str) -> Path | None:
        """Write a snapshot of `kind` now; None when snapshots are off or it could not be written."""
        if not self.enabled:
            return None
        models = self._models()  # on the loop: the registry as it is at this change
        async with self._lock:
            try:
                path = await asyncio.to_thread(write_snapshot, self.directory, kind, self._props, models)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("config snapshots cannot be written to %s (%s); the server goes on without "
                                "them (--ncs turns them off)", self.directory, exc)  # fmt: skip
                return None
        log.debug("config snapshot %s written", path)
        return path

    async def close(self) -> None:
        """Wait for a snapshot being written, so the shutdown one is the last."""
        async with self._lock:
            pass
