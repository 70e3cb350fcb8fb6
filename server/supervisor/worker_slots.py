"""The registry's side of the worker budget: every version's slots as the budget counts them,
and the two questions it asks (a new version's count, a scale's). See `worker_budget`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from mariner.server.common.archive import ModelArchive
from mariner.server.common.model_settings import ModelSettings
from mariner.server.common.settings_layers import LayerSource
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.machine import FORKED_WORKER_BASE
from mariner.server.supervisor.versions import Version
from mariner.server.supervisor.worker_budget import Ask, VersionUse, WorkerBudget

log = logging.getLogger("mariner.supervisor")

# Where a count nobody set comes from, as a refusal names it.
BUILT_IN_WORKERS = "the built-in default: one worker per GPU, else per CPU core"
REGISTER_DEFAULT_WORKERS = "the register call's default of no worker"


def version_uses(versions: Sequence[Version]) -> list[VersionUse]:
    """Every version's worker slots as the budget counts them: the live ones, or its minWorkers
    while they are still to be added (start-up adds them once every archive is opened)."""
    uses = []
    for v in versions:
        live = v.live_instances()
        ready = tuple(
            i.process.pid for i in live if i.status == "READY" and i.process is not None and i.process.pid
        )
        loading = tuple(i.process.pid if i.process is not None else None for i in live if i.status != "READY")
        missing = max(0, v.settings.min_workers - len(live))
        uses.append(
            VersionUse(
                (v.name, v.version),
                slots=len(live) + missing,
                ready=ready,
                loading=loading + (None,) * missing,
                estimate=v.worker_estimate or FORKED_WORKER_BASE,
            )
        )
    return uses


def admit(
    budget: WorkerBudget,
    versions: Sequence[Version],
    archive: ModelArchive,
    settings: ModelSettings,
    origin: LayerSource | None,
    estimate: int,
    startup: bool,
) -> ModelSettings:
    """A new version's worker count, through the budget: a count someone set (the archive,
    models=, default_workers_per_model, a flag, initial_workers) is refused when over it
    (INVALID_ARGUMENT naming the cap and the numbers); the built-in default (one per GPU or
    core) is lowered to what fits instead, with a warning, and refused only when not even one
    worker fits."""
    if settings.min_workers == 0:  # registered without a worker: nothing to admit yet
        return settings
    source = origin.source if origin else (BUILT_IN_WORKERS if startup else REGISTER_DEFAULT_WORKERS)
    ask = Ask(
        archive.name,
        archive.version,
        settings.min_workers,
        what=origin.worker_key if origin else "minWorkers",
        source=source,
        estimate=estimate,
    )
    uses = version_uses(versions)
    if origin is not None:
        budget.check(ask, uses)
        return settings
    n, why = budget.fit(ask, uses)
    if n < 1:
        raise ServingError(Code.INVALID_ARGUMENT, why or f"no worker of model {archive.name} fits")
    if n < settings.min_workers:
        log.warning("model %s version %s: starting %d workers instead of %d: %s", archive.name,
                    archive.version, n, settings.min_workers, why)  # fmt: skip
        max_workers = n if settings.max_workers == settings.min_workers else max(n, settings.max_workers)
        settings = dataclasses.replace(settings, min_workers=n, max_workers=max_workers)
    return settings


def check_scale(budget: WorkerBudget, versions: Sequence[Version], v: Version, min_workers: int) -> None:
    """Refuse (INVALID_ARGUMENT) a scale of `v` to `min_workers` over the budget."""
    ask = Ask(
        v.name,
        v.version,
        min_workers,
        current=len(v.live_instances()),
        what="min_worker",
        estimate=v.worker_estimate or FORKED_WORKER_BASE,
    )
    budget.check(ask, version_uses(versions))
