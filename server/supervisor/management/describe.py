"""TorchServe's list-models and describe-model documents, built once for REST and gRPC.

Both management APIs answer with these dicts (gRPC puts them, as JSON, in its `msg`, as stock
TorchServe does), so the two can never disagree about a model. Every value comes from the
`ModelInfo` the DataPlane reports; nothing is read back out of metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any, Protocol

from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferResult, ModelInfo, WireProtocol, WorkerInfo

# TorchServe caps a list-models page at 100 entries.
MAX_PAGE = 100
# TorchServe's default max_retry_timeout_in_sec; Mariner has no such limit (describe_model).
TORCHSERVE_MAX_RETRY_TIMEOUT_S = 300


class Describable(Protocol):
    """The slice of the DataPlane the builders read."""

    def models(self) -> list[ModelInfo]: ...

    def describe(self, model: str, version: str | None = None) -> list[ModelInfo]: ...


class CustomDescribable(Describable, Protocol):
    """A plane that can also ask a model's handler to describe itself."""

    async def customized_metadata(
        self, model: str, version: str | None, headers: Mapping[str, str], protocol: WireProtocol
    ) -> InferResult: ...


def model_url(info: ModelInfo) -> str:
    """The archive's file name, as TorchServe shows it; never a server-side path."""
    return PurePath(info.archive).name


def list_models(models: Sequence[ModelInfo], limit: int, next_page_token: int) -> dict[str, Any]:
    """TorchServe's list-models document: one entry per model (its default version), sorted by
    name, paginated.

    As in TorchServe, a `limit` outside 0..100 means 100, and `nextPageToken` is present
    whenever the page was full, even when nothing follows it.
    """
    if not 0 <= limit <= MAX_PAGE:
        limit = MAX_PAGE
    start = max(next_page_token, 0)
    defaults: dict[str, ModelInfo] = {}
    for info in models:
        if info.is_default or info.name not in defaults:
            defaults[info.name] = info
    names = sorted(defaults)
    doc: dict[str, Any] = {}
    last = start + limit
    if last > len(names):
        last = len(names)
    else:
        doc["nextPageToken"] = str(last)
    doc["models"] = [{"modelName": n, "modelUrl": model_url(defaults[n])} for n in names[start:last]]
    return doc


def registered_message(info: ModelInfo) -> str:
    """TorchServe's answer to a register: the workers that are up, or, for a model registered
    with none, that there is none and how to add some (ApiUtils.handleRegister)."""
    if info.min_workers == 0:
        return (
            f'Model "{info.name}" Version: {info.version} registered with 0 initial workers. '
            "Use scale workers API to add workers for the model."
        )
    ready = sum(1 for w in info.workers if w.status == "READY")
    return f'Model "{info.name}" Version: {info.version} registered with {ready} initial workers'


def _iso_utc(seconds: float) -> str:
    """TorchServe's startTime format: 2026-01-31T12:00:00.123Z."""
    millis = int(seconds * 1000) % 1000  # truncated, like the seconds gmtime shows
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def _worker(w: WorkerInfo) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": w.id}
    if w.started_at is not None:
        entry["startTime"] = _iso_utc(w.started_at)
    entry["status"] = w.status
    if w.memory_bytes is not None:
        entry["memoryUsage"] = w.memory_bytes
    if w.pid is not None:
        entry["pid"] = w.pid
    entry["gpu"] = w.device.startswith("cuda")
    entry["gpuUsage"] = "N/A"  # per-GPU utilisation is not sampled per worker
    return entry


def _gpu_ids(info: ModelInfo) -> list[int]:
    return sorted({int(w.device.partition(":")[2] or 0) for w in info.workers if w.device.startswith("cuda")})


def device_type(info: ModelInfo) -> str:
    """Where the model really runs: its ready workers' devices ("gpu" when any is on a GPU); with
    none ready, what the settings asked for (else "cpu"). A `deviceType: gpu` model whose worker
    fell back to the CPU is described as cpu, never as the device it asked for."""
    ready = [w.device for w in info.workers if w.status == "READY"]
    if ready:
        return "gpu" if any(d.startswith("cuda") for d in ready) else "cpu"
    return info.device_type or ("gpu" if _gpu_ids(info) else "cpu")


def describe_model(info: ModelInfo) -> dict[str, Any]:
    """One element of TorchServe 0.12's describe-model list, with every key stock TorchServe
    sends, in its order.

    Mariner's own values: batchSize, maxBatchDelay, responseTimeout, min/maxWorkers,
    deviceType, loadedAtStartup, workers, jobQueueStatus, startupTimeout (the time a worker
    process is given to start and initialise its handler, enforced as TorchServe does).
    TorchServe's values for a feature Mariner does not have (so its answer is the one TorchServe
    gives with the feature off): maxRetryTimeoutInSec 300 (Mariner retries a failed worker with
    backoff until the model is unregistered; TorchServe's default is kept so scripts comparing
    it see no difference), clientTimeoutInMills 0 (no per-model client timeout; deadlines come
    with each call), parallelType "" and parallelLevel 0 (no model-parallel execution),
    continuousBatching / useJobTicket / useVenv / stateful false, and the sequence-batching
    limits sequenceMaxIdleMSec, sequenceTimeoutMSec, maxNumSequence, maxSequenceJobQueueSize 0.
    Per worker, startTime / memoryUsage / pid are left out when the DataPlane does not know
    them; gpuUsage is "N/A", TorchServe's own answer when it cannot read a GPU's utilisation.

    Added: deviceIds (the GPUs the workers run on, as TorchServe's model config names them)
    when any worker is on a GPU, and "mariner" with facts TorchServe has no key for (exact
    delays, state, sha256, per-worker device and batch counts).
    """
    gpus = _gpu_ids(info)
    entry: dict[str, Any] = {
        "modelName": info.name,
        "modelVersion": info.version,
        "modelUrl": model_url(info),
        "runtime": "python",
        "minWorkers": info.min_workers,
        "maxWorkers": info.max_workers,
        "batchSize": info.batch_size,
        "maxBatchDelay": round(info.max_batch_delay_ms),
        "responseTimeout": round(info.response_timeout_s),
        "startupTimeout": round(info.startup_timeout_s),
        "maxRetryTimeoutInSec": TORCHSERVE_MAX_RETRY_TIMEOUT_S,
        "clientTimeoutInMills": 0,
        "parallelType": "",
        "parallelLevel": 0,
        "deviceType": device_type(info),
    }
    if gpus:
        entry["deviceIds"] = gpus
    entry.update(
        {
            "continuousBatching": False,
            "useJobTicket": False,
            "useVenv": False,
            "stateful": False,
            "sequenceMaxIdleMSec": 0,
            "sequenceTimeoutMSec": 0,
            "maxNumSequence": 0,
            "maxSequenceJobQueueSize": 0,
            "loadedAtStartup": info.loaded_at_startup,
            "workers": [_worker(w) for w in info.workers],
            "jobQueueStatus": {
                "remainingCapacity": max(info.queue_size - info.pending_requests, 0),
                "pendingRequests": info.pending_requests,
            },
            "mariner": {
                "isDefault": info.is_default,
                "state": info.state.value,
                "handler": info.handler,
                "sha256": info.sha256,
                "queueSize": info.queue_size,
                "maxBatchDelayMs": info.max_batch_delay_ms,
                "responseTimeoutSeconds": info.response_timeout_s,
                "loadSeconds": info.load_seconds,
                "devices": [w.device for w in info.workers],
                "batches": [w.batches for w in info.workers],
                **({"error": info.error} if info.error else {}),
            },
        }
    )
    return entry


def select_versions(plane: Describable, model: str, version: str | None) -> list[ModelInfo]:
    """The versions a describe call is about: the default one when `version` is empty, every one
    for "all", else exactly that one (NOT_FOUND when the model or version is not served)."""
    if not model:
        raise ServingError(Code.INVALID_ARGUMENT, "model_name is required: name a model this server serves")
    if version == "all":
        return plane.describe(model, None)
    if version:
        return plane.describe(model, version)
    every = plane.describe(model, None)
    return [i for i in every if i.is_default] or every[:1]


def describe_models(plane: Describable, model: str, version: str | None) -> list[dict[str, Any]]:
    """TorchServe's describe-model document (a list, one entry per version described)."""
    return [describe_model(i) for i in select_versions(plane, model, version)]


def _metadata(body: bytes) -> Any:
    """TorchServe's customizedMetadata: the handler's answer as JSON when it is JSON, else text."""
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


async def describe_customized(
    plane: CustomDescribable,
    model: str,
    version: str | None,
    headers: Mapping[str, str],
    protocol: WireProtocol,
) -> tuple[list[dict[str, Any]], int]:
    """TorchServe's `customized=true` describe: one version's document with the handler's
    `describe_handle` output under "customizedMetadata" (left out when the handler returned
    nothing), and the status the handler set (TorchServe answers REST with it).

    "all" versions are described without asking any handler, as TorchServe does.
    """
    if version == "all":
        return describe_models(plane, model, version), 200
    doc = describe_models(plane, model, version)  # NOT_FOUND before any worker is asked
    result = await plane.customized_metadata(model, version, headers, protocol)
    if result.body and len(doc) == 1:
        doc[0]["customizedMetadata"] = _metadata(result.body)
    return doc, result.status
