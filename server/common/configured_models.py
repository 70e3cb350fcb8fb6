"""What the server settings say about models: the versions to load at start-up (`models`, or a
restored config snapshot's) and the server-wide layers under every version's serving settings.

A model version's serving settings (batchSize, maxBatchDelay...) are layered once more, in
common.model_settings: built-in < `default_*` < config.properties `models={...}` < archive
model-config < our flags/env/file (`--batch-size`...) < a management register call.

This module turns a `ServerConfig` into those layers (`server_layers`); the layers' order and
checks are settings_layers' and model_settings'.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mariner.server.common.archive import UNLISTED, archive_file_name, store_archives
from mariner.server.common.config import ServerConfig
from mariner.server.common.config_snapshots import snapshot_specs
from mariner.server.common.model_settings import SNAPSHOT_KEYS, SettingsOverrides
from mariner.server.common.models import ModelSpec
from mariner.server.common.settings_layers import ServerLayers, default_workers


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
