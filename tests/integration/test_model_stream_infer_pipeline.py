"""OIP ModelStreamInfer, pipelined, against a real `mariner serve`, driven by tritonclient's own
gRPC stream client (`start_stream`/`async_stream_infer`, in .venv-triton: see stream_client.py).

- 64 digits requests sent before any answer is read come back with their ids and the logits
  unary ModelInfer gives;
- a request held by a blocked handler is answered after a later one (completion order);
- requests queued behind a blocked instance share a batch (the probe reports its batch size);
- a bad request in the middle is answered in-stream (with its id, seen with our stubs, since
  tritonclient hands stream errors over without one) and the following ones are answered.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from mariner.server import protogen
from tests.integration.fault_archive import write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRITON_PYTHON = REPO / ".venv-triton" / "bin" / "python"
CLIENT = Path(__file__).with_name("stream_client.py")
DIGITS = "digits_torchscript"
CAP_S = 120.0

# A tensor model: y = 2x, and each row's batch size; x == -1 holds the instance until GATE/release.
TPROBE = """
import os
import time

import numpy as np

GATE = {gate!r}


class TensorProbe:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        out = []
        for row in data:
            x = np.asarray(row["tensors"]["x"], dtype=np.float32)
            if (x == -1).any():
                open(os.path.join(GATE, "started"), "w").close()
                end = time.monotonic() + 300
                while not os.path.exists(os.path.join(GATE, "release")) and time.monotonic() < end:
                    time.sleep(0.005)
            batch = np.full((x.shape[0],), len(data), dtype=np.int64)
            out.append({{"tensors": {{"y": x * 2, "batch": batch}}}})
        return out
"""
TPROBE_CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 32
maxBatchDelay: 0
responseTimeout: 120
signature:
  inputs:
  - {name: x, datatype: FP32, shape: [-1, 1]}
  outputs:
  - {name: y, datatype: FP32, shape: [-1, 1]}
  - {name: batch, datatype: INT64, shape: [-1]}
"""


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def server(model_store: Path, gate: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    if not TRITON_PYTHON.is_file():
        pytest.fail(f"{TRITON_PYTHON} is missing: run `bash scripts/ensure_triton_venv.sh`")
    protogen.generate()
    store = tmp_path_factory.mktemp("store")
    shutil.copy2(model_store / f"{DIGITS}.mar", store)
    files = {"tprobe.py": TPROBE.format(gate=str(gate)), "model-config.yaml": TPROBE_CONFIG}
    write_handler_archive(store / "tprobe.mar", "tprobe", "tprobe.py", files)
    srv = MarinerServe(store, f"{DIGITS}.mar,tprobe.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


def reset(gate: Path) -> None:
    for name in ("started", "release", "go"):
        (gate / name).unlink(missing_ok=True)


def run_plan(srv: MarinerServe, plan: list[dict[str, Any]], tmp_path: Path, during: Any = None) -> list[Any]:
    """Run tritonclient on `plan`; `during` runs in this process meanwhile (e.g. to say go)."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    proc = subprocess.Popen(
        [str(TRITON_PYTHON), str(CLIENT), srv.grpc_target, str(plan_file)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    helper = threading.Thread(target=during) if during is not None else None
    if helper is not None:
        helper.start()
    out, err = proc.communicate(timeout=CAP_S + 60)
    if helper is not None:
        helper.join()
    assert proc.returncode == 0, f"stream client failed:\n{out}\n{err}"
    return json.loads(out)


def digits(rid: str, row: np.ndarray) -> dict[str, Any]:
    spec = {"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}
    return {"model": DIGITS, "id": rid, "inputs": [spec]}


def probe(rid: str, x: float, model: str = "tprobe") -> dict[str, Any]:
    return {
        "model": model,
        "id": rid,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}],
    }


def unary_logits(srv: MarinerServe, row: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]}
    r = requests.post(f"{srv.http}/v2/models/{DIGITS}/infer", json=body, timeout=CAP_S)
    assert r.status_code == 200, r.text
    (logits,) = [o for o in r.json()["outputs"] if o["name"] == "logits"]
    return np.asarray(logits["data"], dtype=np.float32)


def queue_depth(srv: MarinerServe, model: str) -> float:
    total = 0.0
    for line in requests.get(f"{srv.metrics}/metrics", timeout=30).text.splitlines():
        if line.startswith("mariner_queue_depth{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_64_pipelined_requests_come_back_with_their_ids_and_unary_logits(
    server: MarinerServe, tmp_path: Path
) -> None:
    rows = np.random.default_rng(1).integers(0, 17, size=(64, 64)).astype(np.float32)
    answers = run_plan(
        server, [{"send": [digits(f"r{i}", r) for i, r in enumerate(rows)]}, {"wait_answers": 64}], tmp_path
    )
    assert [a["error"] for a in answers] == [None] * 64
    assert sorted(a["id"] for a in answers) == sorted(f"r{i}" for i in range(64))
    for a in answers:
        want = unary_logits(server, rows[int(a["id"][1:])])
        np.testing.assert_allclose(np.asarray(a["outputs"]["logits"]).ravel(), want, atol=1e-4)


def test_a_held_request_is_answered_after_a_later_one(
    server: MarinerServe, gate: Path, tmp_path: Path
) -> None:
    reset(gate)
    rows = np.zeros((1, 64), dtype=np.float32)
    plan = [
        {"send": [probe("slow", -1.0)]},
        {"wait_file": str(gate / "started")},
        {"send": [digits("fast", rows[0])]},
        {"wait_answers": 1},
        {"touch": str(gate / "release")},
        {"wait_answers": 2},
    ]
    answers = run_plan(server, plan, tmp_path)
    assert [a["id"] for a in answers] == ["fast", "slow"]
    assert answers[1]["outputs"]["y"] == [[-2.0]]


def test_requests_queued_on_one_stream_share_a_batch(
    server: MarinerServe, gate: Path, tmp_path: Path
) -> None:
    reset(gate)

    def say_go_once_queued() -> None:
        end = time.monotonic() + CAP_S
        while queue_depth(server, "tprobe") < 20 and time.monotonic() < end:
            time.sleep(0.01)
        (gate / "release").touch()

    plan = [
        {"send": [probe("gate", -1.0)]},
        {"wait_file": str(gate / "started")},
        {"send": [probe(f"q{i}", float(i)) for i in range(20)]},
        {"wait_answers": 21},
    ]
    answers = run_plan(server, plan, tmp_path, during=say_go_once_queued)
    assert sorted(a["id"] for a in answers) == sorted(["gate", *(f"q{i}" for i in range(20))])
    queued = [a for a in answers if a["id"] != "gate"]
    assert all(a["outputs"]["y"] == [[2.0 * int(a["id"][1:])]] for a in queued)
    assert max(a["outputs"]["batch"][0] for a in queued) > 1


def test_a_bad_request_is_answered_in_stream_and_the_next_ones_too(
    server: MarinerServe, tmp_path: Path
) -> None:
    rows = np.random.default_rng(2).integers(0, 17, size=(3, 64)).astype(np.float32)
    bad_shape = {
        "model": DIGITS,
        "id": "shape",
        "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
    }
    plan = [
        {
            "send": [
                digits("g1", rows[0]),
                probe("unknown", 1.0, model="no_such_model"),
                bad_shape,
                digits("g2", rows[1]),
            ]
        },
        {"wait_answers": 4},
        {"send": [digits("g3", rows[2])]},
        {"wait_answers": 5},
    ]
    answers = run_plan(server, plan, tmp_path)
    ok = {a["id"] for a in answers if a["error"] is None}
    errors = sorted(a["error"] for a in answers if a["error"] is not None)
    assert ok == {"g1", "g2", "g3"}
    assert len(errors) == 2
    assert any("no_such_model" in e for e in errors)
    assert any("expected shape [-1, 64], received [1, 3]" in e for e in errors)


def test_an_error_answer_echoes_the_request_id(server: MarinerServe) -> None:
    """What tritonclient does not show: the error's infer_response carries model, version and id."""
    import grpc

    from mariner.server._proto.inference import grpc_service_pb2 as pb
    from mariner.server._proto.inference import grpc_service_pb2_grpc as pb_grpc

    async def main() -> list[Any]:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            reqs = [pb.ModelInferRequest(model_name="no_such_model", model_version="7", id="e1")]
            return [a async for a in stub.ModelStreamInfer(iter(reqs), timeout=CAP_S)]

    (answer,) = asyncio.run(main())
    assert "no_such_model" in answer.error_message
    echo = answer.infer_response
    assert (echo.model_name, echo.model_version, echo.id) == ("no_such_model", "7", "e1")
