"""How the runner tells failures apart and answers each: out of memory in every format's own words
(split and retry, recovered outside the `except` block), a fatal device error (the instance ends),
anything else (the batch fails alone); rows of one tensor request capped per handler call; a
GPU-bound model refusing the CPU; an unloaded model released even after gc.freeze()."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mariner.server.common.archive import ModelArchive
from mariner.server.common.batch_policy import InstanceFailed
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, WireProtocol
from mariner.server.worker import batch_steps as batch_steps_mod
from mariner.server.worker import runner as runner_mod
from mariner.server.worker.device import Placement
from mariner.server.worker.failures import Failure, classify
from mariner.server.worker.runner import ModelHost

pytestmark = pytest.mark.unit

# The texts each runtime uses (see worker.failures), as torch 2.13 / onnxruntime 1.32 word them.
OOM_TEXTS = [
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)",
    "The following operation failed in the TorchScript interpreter.\nRuntimeError: CUDA error: out of memory",
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
    "to allocate 140737488355328 bytes. Error code 12 (Cannot allocate memory)",
    "[enforce fail at alloc_cpu.cpp:75] data. DefaultCPUAllocator: not enough memory: you tried to allocate",
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Expand node. Status "
    "Message: bfc_arena.cc:360 AllocateRawInternal Failed to allocate memory for requested buffer of size 8",
    "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory ; GPU=0",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
]
FATAL_TEXTS = [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported later",
    "CUDA error: device-side assert triggered",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, ...)`",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
]
AOTI_TEXT = (
    "run_func_( container_handle_, input_handles.data(), input_handles.size(), output_handles.data(), "
    "output_handles.size(), reinterpret_cast<AOTInductorStreamHandle>(stream_handle), proxy_executor_handle_)"
    " API call failed at /pytorch/torch/csrc/inductor/aoti_runner/model_container_runner.cpp, line 145"
)


@pytest.mark.parametrize("text", OOM_TEXTS)
def test_every_formats_out_of_memory_text_is_out_of_memory(text: str) -> None:
    assert classify(RuntimeError(text)) is Failure.OOM


def test_out_of_memory_types_and_wrapped_errors_are_out_of_memory() -> None:
    assert classify(MemoryError()) is Failure.OOM
    oom = type("OutOfMemoryError", (RuntimeError,), {})("anything")
    assert classify(oom) is Failure.OOM
    inner = RuntimeError(OOM_TEXTS[0])
    wrapped = ValueError("inference failed")
    wrapped.__cause__ = inner  # what `raise ValueError(...) from inner` sets
    assert classify(wrapped) is Failure.OOM
    context_only = ValueError("inference failed")
    context_only.__context__ = inner  # a raise inside an except block
    assert classify(context_only) is Failure.OOM


@pytest.mark.parametrize("text", FATAL_TEXTS)
def test_sticky_cuda_errors_are_fatal(text: str) -> None:
    assert classify(RuntimeError(text)) is Failure.FATAL_DEVICE


def test_aoti_runner_failure_is_a_possible_oom_and_other_errors_are_other() -> None:
    assert classify(RuntimeError(AOTI_TEXT)) is Failure.POSSIBLE_OOM
    assert classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is Failure.OTHER
    assert classify(KeyError("memory")) is Failure.OTHER


# -- the host's answers ------------------------------------------------------------------------
def make_archive(tmp_path: Path, code: str, config: dict[str, Any] | None = None) -> ModelArchive:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "h.py").write_text(code)
    manifest = {"model": {"modelName": "m", "handler": "h.py"}}
    return ModelArchive("m", "1", tmp_path / "m.mar", "0" * 64, tmp_path, manifest, config or {})


def ts_request(i: int) -> InferRequest:
    return InferRequest("m", "1", {"body": {"i": i}}, WireProtocol.TS_HTTP, f"r{i}")


def oip_request(rows: int) -> InferRequest:
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    return InferRequest("m", "1", {}, WireProtocol.OIP_HTTP, "t", items=rows, tensors={"x": x})


def host_for(tmp_path: Path, code: str, *, batch_size: int = 8, config: dict | None = None, **kw: Any) -> Any:
    host = ModelHost(
        make_archive(tmp_path, code, config),
        id="m-1-0",
        placement=Placement(None, **kw),
        batch_size=batch_size,
    )
    host.load()
    return host


BATCH_FAULT = """
calls = []
def handle(data, ctx):
    if data is None:  # TorchServe initialises a function handler with handle(None, ctx)
        return None
    calls.append(len(data))
    if len(data) > {limit}:
        big = bytearray(1 << 20)  # held by this frame, i.e. by the traceback
        handle.held = __import__("weakref").ref(ctx)  # any weakref-able marker works
        raise RuntimeError({text!r})
    return [{{"n": len(data)}} for _ in data]
"""


@pytest.mark.parametrize("text", [OOM_TEXTS[0], OOM_TEXTS[2], OOM_TEXTS[4], AOTI_TEXT])
def test_a_batch_that_runs_out_of_memory_is_split_until_the_halves_succeed(tmp_path: Path, text: str) -> None:
    splits: list[int] = []
    host = host_for(tmp_path, BATCH_FAULT.format(limit=2, text=text))
    host.on_oom = lambda: splits.append(1)
    results = host.run_batch([ts_request(i) for i in range(8)])
    assert [json.loads(r.body)["n"] for r in results] == [2] * 8
    module = host._handle.__globals__
    assert module["calls"] == [8, 4, 2, 2, 4, 2, 2]
    assert len(splits) == 3


def test_the_split_runs_after_the_failed_call_has_let_go_of_its_memory(tmp_path: Path) -> None:
    """PyTorch's FAQ: the traceback keeps the failed frame's tensors alive; recovery must run
    outside the `except` block, where nothing of the failed call is left."""
    code = """
import weakref
class Big:
    pass
refs = []
def handle(data, ctx):
    if data is None:  # TorchServe initialises a function handler with handle(None, ctx)
        return None
    if len(data) > 1:
        activations = Big()
        refs.append(weakref.ref(activations))
        raise MemoryError("out of memory")  # understood before and after the format patterns
    return [1 for _ in data]
"""
    host = host_for(tmp_path, code)
    alive_at_split: list[bool] = []
    refs = host._handle.__globals__["refs"]
    host.on_oom = lambda: alive_at_split.append(refs[-1]() is not None)
    host.run_batch([ts_request(0), ts_request(1)])
    assert alive_at_split == [False]


def test_out_of_memory_alone_is_resource_exhausted_and_a_possible_one_is_internal(tmp_path: Path) -> None:
    host = host_for(tmp_path / "a", BATCH_FAULT.format(limit=0, text=OOM_TEXTS[2]))
    with pytest.raises(ServingError) as oom:
        host.run_batch([ts_request(0)])
    assert (oom.value.code, oom.value.http_status) == (Code.RESOURCE_EXHAUSTED, 503)
    assert "out of memory" in oom.value.message
    host = host_for(tmp_path / "b", BATCH_FAULT.format(limit=0, text=AOTI_TEXT))
    with pytest.raises(ServingError) as unknown:
        host.run_batch([ts_request(0)])
    assert unknown.value.code is Code.INTERNAL
    assert "out of memory" not in unknown.value.message


def test_a_fatal_device_error_ends_the_instance(tmp_path: Path) -> None:
    host = host_for(tmp_path, BATCH_FAULT.format(limit=0, text=FATAL_TEXTS[0]))
    with pytest.raises(InstanceFailed, match="illegal memory access"):
        host.run_batch([ts_request(0), ts_request(1)])
    assert host.failed
    assert host._handle.__globals__["calls"] == [2]  # no split on a broken device


ROWS = """
calls = []
def handle(data, ctx):
    if data is None:  # TorchServe initialises a function handler with handle(None, ctx)
        return None
    rows = [len(d["tensors"]["x"]) for d in data]
    calls.append(rows)
    if sum(rows) > {limit}:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
    return [{{"tensors": {{"y": d["tensors"]["x"] * 2}}}} for d in data]
"""


def test_a_request_with_more_rows_than_the_cap_runs_in_chunks(tmp_path: Path) -> None:
    host = host_for(tmp_path, ROWS.format(limit=10**9), batch_size=4)
    req = oip_request(70)
    [result] = host.run_batch([req])
    assert host.max_rows == 16  # 4 x batchSize
    assert host._handle.__globals__["calls"] == [[16], [16], [16], [16], [6]]
    np.testing.assert_array_equal(result.tensors["y"], req.tensors["x"] * 2)


def test_the_cap_comes_from_the_model_config_and_is_checked(tmp_path: Path) -> None:
    host = host_for(tmp_path / "a", ROWS.format(limit=10**9), batch_size=4, config={"maxRowsPerCall": 30})
    host.run_batch([oip_request(70), oip_request(2)])
    assert host._handle.__globals__["calls"] == [[2], [30], [30], [10]]
    bad = make_archive(tmp_path / "b", ROWS, {"maxRowsPerCall": 0})
    with pytest.raises(ServingError, match="maxRowsPerCall must be an integer >= 1"):
        ModelHost(bad, id="x", placement=Placement(None), batch_size=4)


def test_one_request_that_runs_out_of_memory_is_retried_in_halves_of_its_rows(tmp_path: Path) -> None:
    host = host_for(tmp_path, ROWS.format(limit=5), batch_size=16)
    req = oip_request(16)
    [result] = host.run_batch([req])
    np.testing.assert_array_equal(result.tensors["y"], req.tensors["x"] * 2)
    assert host._handle.__globals__["calls"] == [[16], [8], [4], [4], [8], [4], [4]]


# -- devices -----------------------------------------------------------------------------------
PROPS = (
    "def handle(data, ctx):\n    if data is None:\n        return None\n"
    "    return [ctx.system_properties['require_gpu'] for _ in data]\n"
)


def test_a_gpu_bound_model_refuses_the_cpu_with_the_reason(tmp_path: Path) -> None:
    archive = make_archive(tmp_path, PROPS, {"deviceType": "gpu"})
    host = ModelHost(archive, id="m-1-0", placement=Placement(None, require_gpu=True), batch_size=1)
    with pytest.raises(ServingError) as refused:
        host.load()
    assert refused.value.code is Code.UNAVAILABLE
    assert "requires a GPU (deviceType: gpu)" in refused.value.message
    assert "not served on the CPU" in refused.value.message


def test_the_handler_is_told_a_gpu_is_required(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "usable_gpu", lambda gpu_id: None)  # a fake usable device
    host = host_for(tmp_path / "a", PROPS, require_gpu=True)
    assert json.loads(host.run_batch([ts_request(0)])[0].body) is True
    assert json.loads(host_for(tmp_path / "b", PROPS).run_batch([ts_request(0)])[0].body) is False


def test_a_gpu_placement_without_cuda_runs_on_the_cpu_and_says_so(tmp_path: Path) -> None:
    host = ModelHost(make_archive(tmp_path, PROPS), id="m-1-0", placement=Placement(0), batch_size=1)
    host.load()  # this torch has no CUDA
    assert host.placement.device == "cpu"


# -- release on unload ------------------------------------------------------------------------
CYCLIC = """
class Handler:
    def initialize(self, context):
        self.me = self  # a reference cycle: only the collector frees it
        self.context = context
    def handle(self, data, context):
        return [1 for _ in data]
"""


def test_an_unloaded_model_is_freed_even_after_gc_freeze(tmp_path: Path) -> None:
    host = ModelHost(make_archive(tmp_path, CYCLIC), id="m-1-0", placement=Placement(None), batch_size=1)
    host.load()
    host.run_batch([ts_request(0)])
    handler = weakref.ref(host._handle.__self__)
    gc.freeze()  # what a worker does once its model is loaded
    try:
        host.unload()
        gc.collect()
        assert handler() is None
        assert host._context is None
    finally:
        gc.unfreeze()


def test_a_gpu_instance_probes_the_device_after_an_error_that_hides_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AOTInductor's "API call failed" (or a reworded error) can hide an illegal address: a GPU
    instance asks the device (a synchronize) and ends itself when the context is broken."""
    host = host_for(tmp_path / "a", BATCH_FAULT.format(limit=0, text=AOTI_TEXT))
    host.placement = Placement(0)  # as if loaded on cuda:0 (this torch has no CUDA)
    probes: list[int] = []

    def broken() -> str:
        probes.append(1)
        return "an illegal memory access"

    monkeypatch.setattr(batch_steps_mod, "device_error", broken)
    with pytest.raises(InstanceFailed, match="illegal memory access"):
        host.run_batch([ts_request(0), ts_request(1)])
    assert probes == [1]
    assert host.failed
    # A healthy device: the same error is split like an out-of-memory one.
    monkeypatch.setattr(batch_steps_mod, "device_error", lambda: None)
    host = host_for(tmp_path / "b", BATCH_FAULT.format(limit=1, text=AOTI_TEXT))
    host.placement = Placement(0)
    assert len(host.run_batch([ts_request(0), ts_request(1)])) == 2
