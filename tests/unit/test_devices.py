"""GPU placement without a GPU: a fake device count stands in for the hardware.

One round-robin per process over the visible GPUs, for every model (single-worker models do not
all land on cuda:0), `deviceIds` honoured, GPU workers started as fresh interpreters, and the
supervisor's and frontends' code paths never initialising CUDA (counting GPUs, placing workers,
rendering metrics, describing models)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from mariner.server.common import metrics
from mariner.server.common.archive import ModelArchive
from mariner.server.common.model_settings import ModelSettings
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.types import ModelInfo, ModelState, WorkerInfo
from mariner.server.supervisor import devices
from mariner.server.supervisor.devices import GpuAllocator, device_ids_of
from mariner.server.supervisor.management import describe
from mariner.server.supervisor.versions import Instance, Version
from mariner.server.supervisor.worker_pool import WorkerPool
from mariner.server.supervisor.worker_process import start_method, worker_spec

pytestmark = pytest.mark.unit


@pytest.fixture
def two_gpus() -> Iterator[GpuAllocator]:
    """This process's allocator sees two (fake) GPUs for the test."""
    fake = GpuAllocator(count=lambda: 2)
    old = devices.set_allocator(fake)
    try:
        yield fake
    finally:
        devices.set_allocator(old)


@pytest.fixture
def no_cuda_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any call that could initialise CUDA fails the test."""
    import torch

    def forbidden(*_a: object, **_k: object) -> None:
        raise AssertionError("CUDA queried in a process that must not initialise it")

    for name in ("is_available", "device_count", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, name, forbidden)


def archive(tmp_path: Path, name: str, config: dict | None = None) -> ModelArchive:
    return ModelArchive(name, "1", tmp_path / f"{name}.mar", "0" * 64, tmp_path, {"model": {}}, config or {})


def pool(tmp_path: Path, *, require_gpu: bool = False) -> WorkerPool:
    async def changed() -> None:
        return None

    return WorkerPool(
        1, tmp_path, metrics.Metrics(), changed, lambda: 1, lambda: False, require_gpu=require_gpu
    )


def version(tmp_path: Path, name: str, config: dict | None = None, device_type: str | None = None) -> Version:
    return Version(archive(tmp_path, name, config), None, ModelSettings(device_type=device_type), None)  # type: ignore[arg-type]


def test_single_worker_models_take_turns_over_the_gpus(
    two_gpus: GpuAllocator, no_cuda_init: None, tmp_path: Path
) -> None:
    p = pool(tmp_path)
    a, b, c = (version(tmp_path, n) for n in "abc")
    placed = [p._gpu_for(a), p._gpu_for(b), p._gpu_for(c), p._gpu_for(c)]  # c has two workers
    assert [f"cuda:{g}" for g in placed] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert p._gpu_for(version(tmp_path, "d", device_type="cpu")) is None
    assert p._spec(version(tmp_path, "d", device_type="cpu"), Instance(0), None, 9000).device == "cpu"


def test_device_ids_restrict_a_model_to_its_gpus(
    two_gpus: GpuAllocator, no_cuda_init: None, tmp_path: Path
) -> None:
    p = pool(tmp_path)
    only_one = version(tmp_path, "a", {"deviceIds": [1]}, device_type="gpu")
    assert [p._gpu_for(only_one) for _ in range(3)] == [1, 1, 1]
    assert p._spec(only_one, Instance(0), 1, 9000).require_gpu
    # An id that is not visible is dropped; none left means no GPU (and a GPU-bound model fails).
    assert two_gpus.next([5, 0]) == 0
    assert two_gpus.next([7]) is None
    assert device_ids_of({"deviceIds": "0, 1"}) == (0, 1)
    assert device_ids_of({}) is None
    with pytest.raises(ServingError, match="deviceIds must be a list"):
        device_ids_of({"deviceIds": ["x"]})


def test_require_gpu_binds_every_model_that_does_not_ask_for_the_cpu(
    two_gpus: GpuAllocator, tmp_path: Path
) -> None:
    plain, on_cpu = version(tmp_path, "a"), version(tmp_path, "b", device_type="cpu")
    assert pool(tmp_path, require_gpu=True)._spec(plain, Instance(0), 0, 9000).require_gpu
    assert not pool(tmp_path, require_gpu=True)._spec(on_cpu, Instance(0), None, 9000).require_gpu
    assert not pool(tmp_path)._spec(plain, Instance(0), 0, 9000).require_gpu


def test_the_supervisors_pool_shares_the_turn_and_honours_device_ids(
    two_gpus: GpuAllocator, no_cuda_init: None, tmp_path: Path
) -> None:
    p, other = pool(tmp_path, require_gpu=True), pool(tmp_path)
    plain = version(tmp_path, "a")
    pinned = version(tmp_path, "b", {"deviceIds": [0]})
    on_cpu = version(tmp_path, "c", device_type="cpu")
    assert other._gpu_for(plain) == 0  # one process-wide turn: another pool's worker took cuda:0
    assert [p._gpu_for(plain), p._gpu_for(pinned), p._gpu_for(plain)] == [1, 0, 1]
    assert p._gpu_for(on_cpu) is None
    spec = p._spec(plain, Instance(0), 1, 9000)
    assert (spec.gpu_id, spec.require_gpu, spec.device) == (1, True, "cuda:1")
    assert not p._spec(on_cpu, Instance(0), None, 9000).require_gpu


def test_gpu_workers_are_spawned_and_cpu_workers_forked(tmp_path: Path) -> None:
    def spec(gpu: int | None, require: bool = False) -> object:
        return worker_spec(
            archive(tmp_path, "m"),
            instance=0,
            generation=0,
            batch_size=1,
            gpu_id=gpu,
            torch_threads=1,
            socket_dir=tmp_path,
            require_gpu=require,
        )

    assert start_method(spec(0), {}) == "spawn"  # type: ignore[arg-type]
    assert start_method(spec(None, require=True), {"MARINER_WORKER_START": "zygote"}) == "spawn"  # type: ignore[arg-type]
    assert start_method(spec(None), {}) == "zygote"  # type: ignore[arg-type]
    assert start_method(spec(None), {"MARINER_WORKER_START": "spawn"}) == "spawn"  # type: ignore[arg-type]


def test_gpus_are_counted_by_nvml_or_nvidia_smi_never_by_torch(
    monkeypatch: pytest.MonkeyPatch, no_cuda_init: None
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 3, nvmlShutdown=lambda: None
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert devices.visible_gpus() == 3
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: ImportError
    monkeypatch.setattr(devices.shutil, "which", lambda _name: None)
    assert devices.visible_gpus() == 0


def test_supervisor_and_frontend_paths_never_initialise_cuda(
    two_gpus: GpuAllocator, no_cuda_init: None, tmp_path: Path
) -> None:
    import torch

    m = metrics.Metrics()
    m.exposition()  # a process's own samples include GPU memory only where CUDA is in use
    gauge = metrics.WorkerGpuGauge(0)  # a worker's gauge, outside multiprocess mode: no-op
    gauge.sample()
    pool(tmp_path)._gpu_for(version(tmp_path, "a"))
    devices.visible_gpus()
    assert not torch.cuda.is_initialized()


def info(device_type: str | None, *workers: tuple[str, str]) -> ModelInfo:
    return ModelInfo(
        name="m",
        version="1",
        archive="m.mar",
        sha256="0" * 64,
        handler="h.py",
        is_default=True,
        state=ModelState.READY,
        batch_size=1,
        max_batch_delay_ms=0.0,
        response_timeout_s=1.0,
        queue_size=1,
        min_workers=1,
        max_workers=1,
        workers=tuple(WorkerInfo(f"w{i}", d, s, 0) for i, (d, s) in enumerate(workers)),
        load_seconds=None,
        device_type=device_type,
    )


def test_describe_says_the_device_the_model_really_runs_on() -> None:
    # deviceType: gpu in the model-config, but its ready worker runs on the CPU.
    assert describe.describe_model(info("gpu", ("cpu", "READY")))["deviceType"] == "cpu"
    on_gpu = describe.describe_model(info(None, ("cuda:1", "READY")))
    assert (on_gpu["deviceType"], on_gpu["deviceIds"]) == ("gpu", [1])
    # Nothing ready yet: what was asked for.
    assert describe.describe_model(info("gpu", ("cpu", "FAILED")))["deviceType"] == "gpu"


def test_a_gpu_workers_memory_gauge_reaches_the_merged_metrics(tmp_path: Path) -> None:
    """A worker on cuda:1 writes its torch.cuda.memory_allocated into the multiprocess files
    (prometheus_client picks its mode at import, hence a fresh interpreter); the supervisor's
    merge sums it per device over live processes."""
    import os
    import subprocess

    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    worker = """
import torch
torch.cuda.is_initialized = lambda: True  # a fake device: this torch has no CUDA
torch.cuda.memory_allocated = lambda device: 4096 * (device + 1)
from mariner.server.common.metrics import WorkerGpuGauge
WorkerGpuGauge(1)
WorkerGpuGauge(None)  # a CPU worker writes nothing
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=300)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    samples = {
        (s.name, s.labels.get("device")): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == metrics.GPU_MEMORY_METRIC
    }
    assert samples == {(metrics.GPU_MEMORY_METRIC, "cuda:1"): 8192.0}
