"""Out of memory in each model format, for real: models built here whose forward pass allocates
far more host memory than exists once a call holds more than two rows (TorchScript: the
interpreter's RuntimeError "DefaultCPUAllocator: can't allocate memory"; ONNX: an Expand that
makes onnxruntime's arena fail "Failed to allocate memory"; eager: torch's own RuntimeError).

A batch of four one-row requests is split until the halves succeed; one request of four rows is
retried in halves of its rows; a model that fails even on one row answers 503 (RESOURCE_EXHAUSTED)
and keeps serving. The same happens in a worker process, whose split count reaches the server.
AOTInductor hides the cause in its message, so it is covered by its text in tests/unit.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mariner.server.common.archive import ModelArchive
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, WireProtocol
from mariner.server.frontend.worker_client import WorkerConnection
from mariner.server.supervisor.worker_process import WorkerProcess, worker_spec
from mariner.server.worker.device import Placement
from mariner.server.worker.runner import ModelHost

pytestmark = pytest.mark.integration

# rows ** 23 floats: 32 MiB for two rows, 256 TiB for four; 2 ** 46 floats always fail.
MODULE = """
import torch


class Hungry(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > {limit}:
            size = 1
            for _ in range({power}):  # base ** power (`**` of ints is a float in TorchScript)
                size = size * {base}
            return x * 2 + torch.empty([size], dtype=torch.float32)[:1].sum() * 0
        return x * 2
"""

HANDLER = """
import json
import os

import numpy as np


class Handler:
    def initialize(self, context):
        d = context.system_properties["model_dir"]
        fmt = open(os.path.join(d, "format.txt")).read().strip()
        if fmt == "torchscript":
            import torch

            model = torch.jit.load(os.path.join(d, "model.pt"))
            self.run = lambda x: model(torch.from_numpy(x)).numpy()
        elif fmt == "onnx":
            import onnxruntime as ort

            session = ort.InferenceSession(os.path.join(d, "model.onnx"), providers=["CPUExecutionProvider"])
            self.run = lambda x: session.run(None, {"x": x})[0]
        else:
            import importlib.util

            import torch

            # By path: each test's model dir has its own hungry.py (sys.modules would share one).
            path = os.path.join(d, "hungry.py")
            spec = importlib.util.spec_from_file_location("hungry_" + str(id(self)), path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            model = module.Hungry()
            self.run = lambda x: model(torch.from_numpy(x)).numpy()

    def handle(self, data, context):
        if "tensors" in data[0]:
            parts = [d["tensors"]["x"] for d in data]
        else:
            parts = [np.asarray(json.loads(d["body"])["x"], np.float32) for d in data]
        sizes = [len(p) for p in parts]
        y = self.run(np.concatenate(parts).astype(np.float32))
        out, start = [], 0
        for i, n in enumerate(sizes):
            rows = y[start : start + n]
            start += n
            out.append({"tensors": {"y": rows}} if "tensors" in data[i] else {"y": rows.tolist()})
        return out
"""


def onnx_model(path: Path, limit: int) -> None:
    """y = x * 2, via an Expand to [1, rows ** 20]: 4 MiB for two rows, 4 TiB for four (the
    arena refuses it); `limit` 0 makes even one row fail (2 ** 40 elements, always)."""
    import onnx
    import onnx.helper as oh

    t = onnx.TensorProto
    nodes = [
        oh.make_node("Shape", ["x"], ["rows"], start=0, end=1),
        # limit 0: 2 ** 40 whatever the rows
        oh.make_node("Pow", ["rows" if limit else "two", "p"], ["big"]),
        oh.make_node("Concat", ["one", "big"], ["target"], axis=0),
        oh.make_node("Expand", ["x0", "target"], ["wide"]),
        oh.make_node("ReduceSum", ["wide"], ["s"], keepdims=0),
        oh.make_node("Mul", ["s", "zero"], ["z"]),
        oh.make_node("Mul", ["x", "twof"], ["x2"]),
        oh.make_node("Add", ["x2", "z"], ["y"]),
    ]
    inits = [
        oh.make_tensor("p", t.INT64, [1], [20 if limit else 40]),
        oh.make_tensor("two", t.INT64, [1], [2]),
        oh.make_tensor("one", t.INT64, [1], [1]),
        oh.make_tensor("x0", t.FLOAT, [1, 1], [1.0]),
        oh.make_tensor("zero", t.FLOAT, [], [0.0]),
        oh.make_tensor("twof", t.FLOAT, [], [2.0]),
    ]
    graph = oh.make_graph(
        nodes,
        "hungry",
        [oh.make_tensor_value_info("x", t.FLOAT, ["n", 2])],
        [oh.make_tensor_value_info("y", t.FLOAT, ["n", 2])],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def build(tmp_path: Path, fmt: str, limit: int = 2) -> ModelArchive:
    """A model dir for `fmt` whose forward pass fails for more than `limit` rows (0: always)."""
    d = tmp_path / f"{fmt}-{limit}"
    d.mkdir(parents=True)
    (d / "handler.py").write_text(HANDLER)
    (d / "format.txt").write_text(fmt)
    # rows ** 23 beyond `limit` rows; limit 0: 2 ** 46 whatever the rows
    source = (
        MODULE.format(limit=2, base="x.shape[0]", power=23)
        if limit
        else MODULE.format(limit=-1, base=2, power=46)
    )
    (d / "hungry.py").write_text(source)
    if fmt == "torchscript":
        import torch

        spec = importlib.util.spec_from_file_location(f"hungry_{limit}", d / "hungry.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # TorchScript reads the class's source through its module
        spec.loader.exec_module(module)
        torch.jit.save(torch.jit.script(module.Hungry()), str(d / "model.pt"))
    elif fmt == "onnx":
        onnx_model(d / "model.onnx", limit)
    manifest = {"model": {"modelName": fmt, "handler": "handler.py"}}
    return ModelArchive(fmt, "1", d / f"{fmt}.mar", "0" * 64, d, manifest, {"batchSize": 4})


def ts_request(i: int) -> InferRequest:
    body = json.dumps({"x": [[float(i), 1.0]]}).encode()
    return InferRequest("m", "1", {"body": body}, WireProtocol.TS_HTTP, f"r{i}")


def oip_request(rows: int) -> InferRequest:
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    return InferRequest("m", "1", {}, WireProtocol.OIP_HTTP, "t", items=rows, tensors={"x": x})


FORMATS = ["torchscript", "onnx", "eager"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_batch_that_runs_out_of_memory_is_answered_in_halves(tmp_path: Path, fmt: str) -> None:
    splits: list[int] = []
    host = ModelHost(build(tmp_path, fmt), id="m-1-0", placement=Placement(None), batch_size=4)
    host.load()
    host.on_oom = lambda: splits.append(1)
    results = host.run_batch([ts_request(i) for i in range(4)])
    assert [json.loads(r.body)["y"] for r in results] == [[[2.0 * i, 2.0]] for i in range(4)]
    assert len(splits) == 1  # 4 -> 2 + 2
    req = oip_request(4)
    [result] = host.run_batch([req])
    np.testing.assert_array_equal(result.tensors["y"], req.tensors["x"] * 2)
    assert len(splits) == 2  # 4 rows -> 2 + 2 rows
    host.unload()


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_of_memory_on_one_row_is_a_503_and_the_model_goes_on(tmp_path: Path, fmt: str) -> None:
    host = ModelHost(build(tmp_path, fmt, limit=0), id="m-1-0", placement=Placement(None), batch_size=4)
    host.load()
    for _ in range(2):  # answered, not fatal: the instance serves the next call the same way
        with pytest.raises(ServingError) as exhausted:
            host.run_batch([ts_request(0)])
        assert (exhausted.value.code, exhausted.value.http_status) == (Code.RESOURCE_EXHAUSTED, 503)
    assert not host.failed
    host.unload()


def test_a_worker_process_splits_and_reports_the_splits(tmp_path: Path) -> None:
    splits: list[int] = []

    async def scenario() -> list[Any]:
        spec = worker_spec(
            build(tmp_path, "torchscript"),
            instance=0,
            generation=0,
            batch_size=4,
            gpu_id=None,
            torch_threads=1,
            socket_dir=tmp_path,
        )
        process = WorkerProcess(spec)  # the supervisor's handle on a worker
        endpoint = await process.start(600.0)
        # The frontend's side: a connection that counts the splits the worker reports.
        conn = WorkerConnection(endpoint, batch_size=4, on_oom=lambda n: splits.extend([1] * n))
        await conn.start()
        try:
            return await conn.run([ts_request(i) for i in range(4)])
        finally:
            conn.close()
            await process.stop(10.0)

    results = asyncio.run(scenario())
    assert [json.loads(r.body)["y"] for r in results] == [[[2.0 * i, 2.0]] for i in range(4)]
    assert len(splits) == 1
