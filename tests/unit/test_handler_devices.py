"""The digits handler's GPU paths, exercised on a CPU-only machine with fakes.

No silent CPU fallback (deviceType gpu / require_gpu without CUDA, an ONNX session that did not
get CUDA), ONNX on the instance's own GPU, one reused host staging buffer instead of a pinned
allocation per batch, and a compiled model that only ever runs the batch sizes it warmed up.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mariner.handlers.digits_handler as dh
from mariner.handlers.digits_handler import DigitsHandler
from mariner.handlers.handler_support import HostStaging, onnx_session, pick_device
from mariner.server.worker.context import Context
from mariner.training.model import DigitsCNN

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MODEL_KWARGS = {"width": 8, "hidden": 32, "dropout": 0.25}


@pytest.fixture(scope="module")
def reference_model() -> DigitsCNN:
    torch.manual_seed(7)
    return DigitsCNN(**MODEL_KWARGS).eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, reference_model: DigitsCNN) -> Path:
    d = tmp_path_factory.mktemp("devices")
    torch.save(reference_model.state_dict(), d / "weights.pt")
    shutil.copy2(ROOT / "training" / "model.py", d / "digits_model.py")
    (d / "norm.json").write_text(json.dumps({"mean": 4.9, "std": 6.0}))
    (d / "model.onnx").write_bytes(b"not really onnx: the session is fake")
    return d


def _ctx(
    model_dir: Path,
    config: dict[str, Any],
    *,
    gpu_id: int | None = None,
    serialized: str = "weights.pt",
    **props: Any,
) -> Context:
    manifest = {"model": {"modelName": "d", "serializedFile": serialized, "handler": "digits_handler.py"}}
    ctx = Context("d", str(model_dir), manifest, batch_size=int(config.get("batchSize", 1)), gpu_id=gpu_id,
                  model_yaml_config=config)  # fmt: skip
    ctx.system_properties.update(props)
    return ctx


def _eager(**extra: Any) -> dict[str, Any]:
    return {"batchSize": 4, "handler": {"format": "eager", "model_kwargs": MODEL_KWARGS}, **extra}


@pytest.fixture
def cuda_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# -- no silent CPU fallback ---------------------------------------------------------------------


def test_device_type_gpu_without_cuda_fails_initialize(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h = DigitsHandler()
    with pytest.raises(RuntimeError, match="must run on a GPU.*no usable CUDA"):
        h.initialize(_ctx(model_dir, _eager(deviceType="gpu"), gpu_id=0))
    assert not h.initialized


@pytest.mark.parametrize("flag", [True, "true", "1"])
def test_require_gpu_property_without_cuda_fails_initialize(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, flag: Any
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="refusing to serve it on the CPU"):
        DigitsHandler().initialize(_ctx(model_dir, _eager(), gpu_id=0, require_gpu=flag))


def test_gpu_required_but_no_gpu_assigned_fails(model_dir: Path, cuda_visible: None) -> None:
    with pytest.raises(RuntimeError, match="assigned this instance no GPU"):
        pick_device(_ctx(model_dir, _eager(deviceType="gpu"), gpu_id=None), "any")


def test_gpu_optional_archive_still_serves_on_the_cpu(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h = DigitsHandler()
    h.initialize(_ctx(model_dir, _eager(), gpu_id=0, require_gpu=False))
    assert h.device == torch.device("cpu")


def test_cpu_only_artefact_stays_on_the_cpu_even_when_gpus_are_required(
    model_dir: Path, cuda_visible: None
) -> None:
    ctx = _ctx(model_dir, {"deviceType": "cpu", "handler": {}}, gpu_id=0, require_gpu=True)
    assert pick_device(ctx, "cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"deviceType: gpu but .* only on the CPU"):
        pick_device(_ctx(model_dir, {"deviceType": "gpu"}, gpu_id=0), "cpu")


def test_the_instance_gpu_is_the_one_the_server_assigned(model_dir: Path, cuda_visible: None) -> None:
    assert pick_device(_ctx(model_dir, _eager(deviceType="gpu"), gpu_id=3), "any") == torch.device("cuda:3")


# -- ONNX Runtime: the instance's GPU, and no provider fallback ----------------------------------


class FakeOrt(types.SimpleNamespace):
    """An onnxruntime whose providers and session outcome the test decides."""

    def __init__(self, available: list[str], granted: list[str]) -> None:
        super().__init__(calls=[])
        self._available, self._granted = available, granted

    def get_available_providers(self) -> list[str]:
        return list(self._available)

    def SessionOptions(self) -> Any:  # noqa: N802 - onnxruntime's name
        return types.SimpleNamespace()

    def InferenceSession(self, path: str, sess_options: Any = None, providers: Any = None) -> Any:  # noqa: N802
        self.calls.append(providers)
        granted = self._granted
        return types.SimpleNamespace(
            get_providers=lambda: list(granted),
            get_inputs=lambda: [types.SimpleNamespace(name="x")],
            run=lambda _names, feed: [np.zeros((len(feed["x"]), 10), dtype=np.float32)],
        )


GPU_AND_CPU = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_onnx_session_uses_the_instance_gpu_index() -> None:
    ort = FakeOrt(GPU_AND_CPU, GPU_AND_CPU)
    onnx_session(ort, Path("m.onnx"), None, torch.device("cuda:2"))
    assert ort.calls == [[("CUDAExecutionProvider", {"device_id": 2}), "CPUExecutionProvider"]]


def test_onnx_session_that_fell_back_to_the_cpu_is_refused() -> None:
    ort = FakeOrt(GPU_AND_CPU, ["CPUExecutionProvider"])
    with pytest.raises(
        RuntimeError, match=r"could not create a CUDA session on cuda:1 .*CPUExecutionProvider"
    ):
        onnx_session(ort, Path("m.onnx"), None, torch.device("cuda:1"))


def test_onnx_without_a_cuda_provider_is_refused_on_a_gpu_instance() -> None:
    with pytest.raises(RuntimeError, match="no CUDAExecutionProvider.*onnxruntime-gpu"):
        onnx_session(FakeOrt(["CPUExecutionProvider"], ["CPUExecutionProvider"]), Path("m"), None,
                     torch.device("cuda:0"))  # fmt: skip


def test_onnx_on_a_cpu_instance_asks_for_the_cpu_only() -> None:
    ort = FakeOrt(GPU_AND_CPU, ["CPUExecutionProvider"])
    onnx_session(ort, Path("m.onnx"), None, torch.device("cpu"))
    assert ort.calls == [["CPUExecutionProvider"]]


def test_handler_refuses_an_onnx_gpu_instance_that_got_the_cpu(
    model_dir: Path, cuda_visible: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", FakeOrt(GPU_AND_CPU, ["CPUExecutionProvider"]))
    h = DigitsHandler()
    with pytest.raises(RuntimeError, match="refusing to serve this GPU instance on the CPU"):
        h.initialize(_ctx(model_dir, {"handler": {"format": "onnx"}}, gpu_id=1, serialized="model.onnx"))


def test_handler_onnx_gpu_instance_serves_on_its_gpu(
    model_dir: Path, cuda_visible: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ort = FakeOrt(GPU_AND_CPU, GPU_AND_CPU)
    monkeypatch.setitem(sys.modules, "onnxruntime", ort)
    h = DigitsHandler()
    h.initialize(
        _ctx(model_dir, {"batchSize": 2, "handler": {"format": "onnx"}}, gpu_id=1, serialized="model.onnx")
    )
    assert h.device == torch.device("cuda:1")
    assert ort.calls[0][0] == ("CUDAExecutionProvider", {"device_id": 1})


# -- one staging buffer, reused, never overwritten while a copy may read it ----------------------


class FakeEvent:
    def __init__(self, log: list[str], n: int) -> None:
        self.log, self.n = log, n

    def record(self) -> None:
        self.log.append(f"record {self.n}")

    def synchronize(self) -> None:
        self.log.append(f"sync {self.n}")


def _staging(log: list[str], rows: int = 8) -> tuple[HostStaging, list[tuple[int, ...]]]:
    allocations: list[tuple[int, ...]] = []

    def allocate(shape: tuple[int, ...]) -> torch.Tensor:
        allocations.append(shape)
        return torch.full(shape, float("nan"))

    events = iter(range(1000))
    staging = HostStaging(rows, (1, 8, 8), torch.device("cpu"), allocate=allocate,
                          new_event=lambda: FakeEvent(log, next(events)))  # fmt: skip
    real_fill = staging.fill

    def fill(x: torch.Tensor, rows: int) -> torch.Tensor:
        log.append(f"fill {len(x)}->{rows}")
        return real_fill(x, rows)

    staging.fill = fill  # type: ignore[method-assign]
    return staging, allocations


def test_staging_allocates_once_and_waits_for_the_previous_copy_before_rewriting() -> None:
    log: list[str] = []
    staging, allocations = _staging(log)
    for n in (3, 8, 1):
        x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 1, 8, 8)
        torch.testing.assert_close(staging.to_device(x), x)
    assert allocations == [(8, 1, 8, 8)]
    assert log == [
        "fill 3->3",
        "record 0",
        "sync 0",
        "fill 8->8",
        "record 1",
        "sync 1",
        "fill 1->1",
        "record 2",
    ]


def test_staging_pads_with_zeros_not_with_the_previous_batch() -> None:
    staging, _ = _staging([])
    staging.to_device(torch.ones(8, 1, 8, 8))
    out = staging.to_device(torch.full((3, 1, 8, 8), 2.0), rows=4)
    assert out.shape == (4, 1, 8, 8)
    torch.testing.assert_close(out[:3], torch.full((3, 1, 8, 8), 2.0))
    torch.testing.assert_close(out[3], torch.zeros(1, 8, 8))


def test_staging_refuses_a_batch_larger_than_the_buffer() -> None:
    staging, _ = _staging([], rows=4)
    with pytest.raises(ValueError, match="holds 4 rows"):
        staging.to_device(torch.zeros(5, 1, 8, 8))


def test_handler_reuses_one_staging_buffer_for_every_batch(
    model_dir: Path, reference_model: DigitsCNN
) -> None:
    h = DigitsHandler()
    h.initialize(_ctx(model_dir, _eager()))
    log: list[str] = []
    h._staging, allocations = _staging(log, rows=h.buckets[-1])
    for n in (1, 4, 2, 3):
        px = np.random.default_rng(n).uniform(0, 16, (n, 64)).astype(np.float32)
        x = h.normalise(px)
        with torch.inference_mode():
            expected = reference_model(x)
        torch.testing.assert_close(h.logits(x), expected)
    assert allocations == [(4, 1, 8, 8)]
    assert log.count("sync 0") == 1
    assert log[-1] == "record 3"
    # a batch beyond the buffer (one tensor request of many rows) takes one plain copy
    assert h.logits(h.normalise(np.zeros((9, 64), np.float32))).shape == (9, 10)
    assert log[-1] == "record 3"


# -- compiled: only warmed batch sizes, no compile after warm-up ---------------------------------


@pytest.mark.slow  # torch.compile at every warmed size: about 20 s on two cores
def test_compiled_variant_runs_only_warmed_sizes_and_never_recompiles(
    model_dir: Path, reference_model: DigitsCNN, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    seen: list[int] = []
    real_compile = torch.compile

    def recording_compile(model: Any, **kwargs: Any) -> Any:
        compiled = real_compile(model, **kwargs)

        def run(x: torch.Tensor) -> torch.Tensor:
            seen.append(len(x))
            return compiled(x)

        return run

    monkeypatch.setattr(dh.torch, "compile", recording_compile)
    torch._dynamo.reset()
    cfg = {"batchSize": 8, "handler": {"format": "compiled", "model_kwargs": MODEL_KWARGS,
                                       "compile": {"mode": "default", "dynamic": False}}}  # fmt: skip
    h = DigitsHandler()
    h.initialize(_ctx(model_dir, cfg))
    warmed = set(seen)
    assert warmed == {1, 2, 4, 8}
    graphs = counters["stats"]["unique_graphs"]
    seen.clear()
    rng = np.random.default_rng(0)
    for n in [*range(1, 9), 13, 20]:  # 13 and 20: multi-row tensor requests beyond batchSize
        px = rng.uniform(0, 16, (n, 64)).astype(np.float32)
        x = h.normalise(px)
        with torch.inference_mode():
            expected = reference_model(x)
        torch.testing.assert_close(h.logits(x), expected, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs, "a batch size compiled a graph after warm-up"
    assert set(seen) <= warmed, (
        f"sizes run that warm-up never ran (a CUDA graph would be recorded): {set(seen) - warmed}"
    )
