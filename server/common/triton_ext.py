"""Triton's protocol extensions that tools read: model configuration, statistics, repository.

Dashboards, perf_analyzer and Triton-aware clients call these besides the core protocol; a
server that answers them NOT_FOUND or UNIMPLEMENTED breaks those tools. This module is the
transport-neutral half (plain dicts in Triton's JSON shape); the REST adapter answers them as
they are, the gRPC adapter copies them into the generated messages with `json_format`, so both
transports say the same thing.

- configuration: what Mariner knows of a version (name, platform, max batch size, the declared
  tensors with the batch dim dropped, the batcher's delay, instances), in Triton's
  ModelConfig shape;
- statistics: read from what the server already counts, never estimated. `success`/`fail` are
  the call path's (`stats.CallStats`, end-to-end time per call); `queue` is the batcher's
  per-request wait (mariner_queue_duration_seconds); `compute_infer` is the handler's time per
  batch (mariner_compute_duration_seconds: one count per batch, not per request as in Triton);
  `inference_count` is the items batched, `execution_count` the batches. Decoding and encoding
  are not timed apart from the call, so `compute_input`/`compute_output` stay zero. Counts are
  this process's: under `mariner serve` each frontend answers for the calls it served;
- repository: the index lists the served versions; load registers `<model>.mar` from the model
  store and unload unregisters every version of a model, through the management plane's own
  register/unregister (model management must be on; refused otherwise, as there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from mariner.server.common import oip_codec as oip
from mariner.server.common.models import require_management
from mariner.server.common.oip_stats import book_of
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.names import check_model_name
from mariner.server.contracts.types import ModelInfo, ModelState

# Triton's repository states for ours.
_INDEX_STATE = {
    ModelState.READY: "READY",
    ModelState.LOADING: "LOADING",
    ModelState.RESTARTING: "LOADING",
    ModelState.STOPPING: "UNLOADING",
    ModelState.FAILED: "UNAVAILABLE",
    ModelState.NO_WORKERS: "UNAVAILABLE",
}


class RepositoryPlane(Protocol):
    """What the repository extension needs of a plane: the supervisor's registry serves it (a
    frontend's DataPlane refuses, as management-disabled, before `register` is reached)."""

    management_enabled: bool

    def models(self) -> list[ModelInfo]: ...

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]: ...

    async def register(self, archive_name: str, **overrides: Any) -> list[ModelInfo]: ...

    async def unregister(self, model: str, version: str | None = None) -> None: ...


# -- configuration ----------------------------------------------------------------------------
def _tensor(spec: Any, batched: bool) -> dict[str, Any]:
    dims = list(spec.shape)
    if batched and dims:
        dims = dims[1:]  # Triton's dims leave out the batch dim when max_batch_size > 0
    datatype = "STRING" if spec.datatype == "BYTES" else spec.datatype
    out: dict[str, Any] = {"name": spec.name, "data_type": f"TYPE_{datatype}", "dims": dims}
    if spec.optional:
        out["optional"] = True
    return out


def model_config(plane: oip.OipPlane, model: str, version: str | None) -> dict[str, Any]:
    """ModelConfig of one version (the default one when `version` is None); unknown: NOT_FOUND."""
    if not model:
        raise ServingError(Code.INVALID_ARGUMENT, "name is required: name a model this server serves")
    handle = plane.resolve(model, version)
    info = next(i for i in plane.describe(handle.name, handle.version))
    batched = handle.batch_size > 1
    sig = handle.signature
    config: dict[str, Any] = {
        "name": handle.name,
        "platform": oip.PLATFORM,
        "backend": "python",
        "max_batch_size": handle.batch_size if batched else 0,
        "input": [_tensor(s, batched) for s in sig.inputs] if sig else [],
        "output": [_tensor(s, batched) for s in sig.outputs] if sig else [],
        "instance_group": [
            {
                "name": handle.name,
                "count": info.min_workers,
                "kind": "KIND_GPU" if info.device_type == "gpu" else "KIND_CPU",
            }
        ],
    }
    if batched:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": round(info.max_batch_delay_ms * 1000)}
    return config


# -- statistics -------------------------------------------------------------------------------
def _histogram_totals(metric: Any) -> dict[tuple[str, str], tuple[float, float]]:
    """(model, version) -> (count, sum) of one of the metrics' histograms, this process's."""
    out: dict[tuple[str, str], list[float]] = {}
    for family in metric.collect():
        for sample in family.samples:
            key = (sample.labels.get("model", ""), sample.labels.get("version", ""))
            if sample.name.endswith("_count"):
                out.setdefault(key, [0.0, 0.0])[0] += sample.value
            elif sample.name.endswith("_sum"):
                out.setdefault(key, [0.0, 0.0])[1] += sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": round(seconds * 1e9)}


def model_statistics(plane: oip.OipPlane, model: str | None, version: str | None) -> list[dict[str, Any]]:
    """ModelStatistics of every served version, of one model's versions, or of one version."""
    if model:
        if version:
            handle = plane.resolve(model, version)
            versions: Iterable[tuple[str, str]] = [(handle.name, handle.version)]
        else:
            plane.resolve(model)  # unknown model: NOT_FOUND
            versions = [(i.name, i.version) for i in plane.describe(model)]
    else:
        versions = [(i.name, i.version) for i in plane.models()]
    metrics = plane.metrics
    queue = _histogram_totals(metrics.queue_duration)
    compute = _histogram_totals(metrics.compute_duration)
    batches = _histogram_totals(metrics.batch_size)
    calls = book_of(metrics).snapshot()
    out = []
    for key in versions:
        call = calls.get(key)
        executions, items = batches.get(key, (0.0, 0.0))
        out.append(
            {
                "name": key[0],
                "version": key[1],
                "last_inference": call.last_ms if call else 0,
                "inference_count": int(items),
                "execution_count": int(executions),
                "inference_stats": {
                    "success": _duration(call.ok, call.ok_s) if call else _duration(0, 0),
                    "fail": _duration(call.failed, call.failed_s) if call else _duration(0, 0),
                    "queue": _duration(*queue.get(key, (0.0, 0.0))),
                    "compute_input": _duration(0, 0),
                    "compute_infer": _duration(*compute.get(key, (0.0, 0.0))),
                    "compute_output": _duration(0, 0),
                    "cache_hit": _duration(0, 0),
                    "cache_miss": _duration(0, 0),
                },
                "batch_stats": [],
            }
        )
    return out


# -- repository -------------------------------------------------------------------------------
def repository_index(plane: RepositoryPlane, ready_only: bool = False) -> list[dict[str, str]]:
    """Every served version with Triton's state name (a failed one says why)."""
    out = []
    for info in plane.models():
        state = _INDEX_STATE.get(info.state, "UNAVAILABLE")
        if ready_only and state != "READY":
            continue
        entry = {"name": info.name, "version": info.version, "state": state}
        if info.error:
            entry["reason"] = info.error
        out.append(entry)
    return out


def _check_name(model: str) -> str:
    """The archive `<model>.mar` is looked up by this name: the rule every model name follows."""
    return check_model_name(model, "model name")


async def load(plane: RepositoryPlane, model: str) -> None:
    """Serve `<model>.mar` from the model store; a model already served is left as it is (one
    that failed is registered again, which replaces the failure)."""
    require_management(plane.management_enabled, "model loading")
    if any(i.name == model and i.state is not ModelState.FAILED for i in plane.models()):
        return
    await plane.register(f"{_check_name(model)}.mar")


async def unload(plane: RepositoryPlane, model: str) -> None:
    """Stop serving every version of `model` (Triton unloads a model, not a version)."""
    require_management(plane.management_enabled, "model unloading")
    _check_name(model)
    versions = [i.version for i in plane.describe(model)]  # unknown: NOT_FOUND
    for version in versions:
        await plane.unregister(model, version)
