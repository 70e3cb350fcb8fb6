"""Open Inference Protocol (v2) requests and answer checks for the load tools, without locust.

The locust users (`mariner.loadtest.locustfile`) build their OIP calls and judge the answers with
these functions; they live apart from the locustfile because importing locust monkey-patches the
importing process for gevent, and the tests call the same functions from a plain pytest process.

A request carries one test-set digit as the `pixels` input, FP32 [1, 64] (raw 0..16 intensities,
the digits models' signature). An answer only counts when it is a prediction: a `label` output
INT64 [1] in 0..9 that equals the argmax of the `logits` output FP32 [1, 10]. A server that
answers 200 with the wrong tensors, shapes or a label its own logits contradict fails the run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

INPUT = "pixels"
PIXELS = 64
CLASSES = 10


def infer_path(model: str) -> str:
    """The REST v2 inference path for `model`'s default version."""
    return f"/v2/models/{model}/infer"


def rest_body(pixels: Sequence[float]) -> bytes:
    """A JSON `/v2/models/{m}/infer` body asking for the label and the logits of one digit."""
    values = [float(v) for v in pixels]
    doc = {
        "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [1, PIXELS], "data": values}],
        "outputs": [{"name": "logits"}, {"name": "label"}],
    }
    return json.dumps(doc).encode()


def _label(logits: np.ndarray, label: np.ndarray) -> int:
    if logits.shape != (1, CLASSES):
        raise ValueError(f"output 'logits' has shape {list(logits.shape)}, expected [1, {CLASSES}]")
    if label.shape != (1,):
        raise ValueError(f"output 'label' has shape {list(label.shape)}, expected [1]")
    value = int(label[0])
    if not 0 <= value < CLASSES:
        raise ValueError(f"output 'label' is {value}, not a digit")
    if not np.isfinite(logits).all() or int(logits.argmax()) != value:
        raise ValueError(f"label {value} is not the argmax of the logits {logits.tolist()}")
    return value


def label_from_rest(body: bytes) -> int:
    """The predicted digit in a JSON v2 infer answer; ValueError when it is not a valid prediction."""
    try:
        doc = json.loads(body)
        outputs: Mapping[str, Any] = {o["name"]: o for o in doc["outputs"]}
        logits = np.asarray(outputs["logits"]["data"], np.float32).reshape(outputs["logits"]["shape"])
        label = np.asarray(outputs["label"]["data"], np.int64).reshape(outputs["label"]["shape"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"answer is not a v2 infer response with logits and label: {body[:120]!r}") from exc
    return _label(logits, label)


def grpc_messages() -> Any:
    """The generated `inference.grpc_service_pb2` and `_pb2_grpc` modules (generated if stale)."""
    from mariner.server import protogen

    protogen.generate()  # a no-op when the stubs are fresh
    from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc

    return grpc_service_pb2, grpc_service_pb2_grpc


def grpc_request(pb2: Any, model: str, pixels: np.ndarray) -> Any:
    """A `ModelInferRequest` with one digit as raw FP32 bytes (the binary form clients use)."""
    row = np.ascontiguousarray(pixels, dtype=np.float32).reshape(1, PIXELS)
    tensor = pb2.ModelInferRequest.InferInputTensor(name=INPUT, datatype="FP32", shape=[1, PIXELS])
    return pb2.ModelInferRequest(
        model_name=model,
        inputs=[tensor],
        outputs=[
            pb2.ModelInferRequest.InferRequestedOutputTensor(name="logits"),
            pb2.ModelInferRequest.InferRequestedOutputTensor(name="label"),
        ],
        raw_input_contents=[row.tobytes()],
    )


_DTYPES = {"FP32": np.float32, "INT64": np.int64}


def label_from_grpc(response: Any) -> int:
    """The predicted digit in a `ModelInferResponse`; ValueError when it is not a valid prediction."""
    outputs: dict[str, np.ndarray] = {}
    raw = list(response.raw_output_contents)
    for i, out in enumerate(response.outputs):
        dtype = _DTYPES.get(out.datatype)
        if dtype is None:
            raise ValueError(f"output {out.name!r} has datatype {out.datatype}, expected FP32 or INT64")
        if raw:
            values = np.frombuffer(raw[i], dtype) if i < len(raw) else np.empty(0, dtype)
        else:
            contents = out.contents.fp32_contents if dtype is np.float32 else out.contents.int64_contents
            values = np.asarray(contents, dtype)
        try:
            outputs[out.name] = values.reshape(list(out.shape))
        except ValueError as exc:
            shape = list(out.shape)
            raise ValueError(f"output {out.name!r}: {values.size} values for shape {shape}") from exc
    if "logits" not in outputs or "label" not in outputs:
        raise ValueError(f"answer lacks the logits and label outputs: {sorted(outputs)}")
    return _label(outputs["logits"], outputs["label"])
