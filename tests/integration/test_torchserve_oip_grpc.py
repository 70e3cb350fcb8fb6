"""TorchServe's own Open Inference Protocol gRPC service against a real Mariner.

TorchServe's clients speak the protocol under their package's name
(`org.pytorch.serve.grpc.openinference.GRPCInferenceService`), not KServe's `inference`. The
stubs here are compiled at test time from the `open_inference_grpc.proto` that the installed
torchserve wheel carries in `ts/frontend/model-server.jar`, so every call is in TorchServe's
exact messages (no copy of that file lives in this repository).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from mariner.server import protogen
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODEL = "digits_torchscript"
ROWS = 8
TOL = 1e-4
PROTO = "proto/open_inference_grpc.proto"


def torchserve_jar() -> Path:
    spec = importlib.util.find_spec("ts")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the torchserve wheel is not installed in this venv (the dev extra installs it)")
    jar = Path(next(iter(spec.submodule_search_locations))) / "frontend" / "model-server.jar"
    if not jar.is_file():
        pytest.fail(f"{jar} is missing from the torchserve wheel")
    return jar


@pytest.fixture(scope="module")
def ts(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """TorchServe's open_inference_grpc.proto, compiled from its jar into a temp dir and imported."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("ts_oip")
    with zipfile.ZipFile(torchserve_jar()) as jar:
        (out / "open_inference_grpc.proto").write_bytes(jar.read(PROTO))
    rc = protoc.main(
        [
            "protoc",
            f"-I{out}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(out / "open_inference_grpc.proto"),
        ]
    )
    assert rc == 0, "protoc could not compile TorchServe's open_inference_grpc.proto"
    sys.path.insert(0, str(out))
    try:
        pb = importlib.import_module("open_inference_grpc_pb2")
        pb_grpc = importlib.import_module("open_inference_grpc_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    return SimpleNamespace(m=pb, stub=pb_grpc.GRPCInferenceServiceStub, descriptor=pb.DESCRIPTOR)


@pytest.fixture(scope="module")
def mariner(shared_digits_torchscript: MarinerServe) -> MarinerServe:
    """The session's shared server (tests/integration/conftest.py): these tests only send requests."""
    protogen.generate()
    return shared_digits_torchscript.alive()


@pytest.fixture(scope="module")
def stub(mariner: MarinerServe, ts: SimpleNamespace) -> Iterator[object]:
    with grpc.insecure_channel(mariner.grpc_target) as channel:
        yield ts.stub(channel)


def test_torchserve_proto_is_the_service_mariner_answers_under(ts: SimpleNamespace) -> None:
    from mariner.server.frontend.protocols.oip.grpc import TORCHSERVE_METHODS, TORCHSERVE_SERVICE_NAME

    (service,) = ts.descriptor.services_by_name.values()
    assert service.full_name == TORCHSERVE_SERVICE_NAME
    # TorchServe's proto has no streaming RPC; Mariner serves exactly the ones it declares.
    assert sorted(m.name for m in service.methods) == sorted(TORCHSERVE_METHODS)


def test_torchserve_messages_match_ours_field_for_field(ts: SimpleNamespace) -> None:
    """Same names and numbers everywhere, except InferParameter's two extra choices in ours."""
    from mariner.server._proto.inference import grpc_service_pb2 as ours

    def fields(desc) -> set[tuple[str, int, int]]:
        return {(f.name, f.number, f.type) for f in desc.fields}

    def walk(desc, prefix=""):
        yield prefix + desc.name, desc
        for nested in desc.nested_types:
            yield from walk(nested, prefix + desc.name + ".")

    theirs = dict(x for m in ts.descriptor.message_types_by_name.values() for x in walk(m))
    mine = dict(x for m in ours.DESCRIPTOR.message_types_by_name.values() for x in walk(m))
    for name, desc in theirs.items():
        assert name in mine, f"TorchServe's {name} has no counterpart in our proto"
        diff = fields(mine[name]) ^ fields(desc)
        if name == "InferParameter":
            assert diff == {("double_param", 4, 1), ("uint64_param", 5, 4)}
        else:
            assert not diff, f"{name} differs: {diff}"


def test_health_calls(stub, ts: SimpleNamespace) -> None:
    assert stub.ServerLive(ts.m.ServerLiveRequest(), timeout=30).live is True
    assert stub.ServerReady(ts.m.ServerReadyRequest(), timeout=30).ready is True
    assert stub.ModelReady(ts.m.ModelReadyRequest(name=MODEL), timeout=30).ready is True
    assert stub.ModelReady(ts.m.ModelReadyRequest(name="no_such_model"), timeout=30).ready is False
    meta = stub.ServerMetadata(ts.m.ServerMetadataRequest(), timeout=30)
    assert meta.name == "mariner"


def test_model_metadata(stub, ts: SimpleNamespace) -> None:
    meta = stub.ModelMetadata(ts.m.ModelMetadataRequest(name=MODEL), timeout=30)
    assert meta.name == MODEL
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("pixels", "FP32", [-1, 64])]
    assert {t.name for t in meta.outputs} == {"logits", "probabilities", "label"}


def _eager(eager_reference, pixels: np.ndarray) -> np.ndarray:
    import torch

    from mariner.training.data import to_model_input

    with torch.inference_mode():
        return eager_reference.model(to_model_input(pixels, eager_reference.norm)).float().numpy()


def test_model_infer_raw_and_typed_contents_match_eager(stub, ts: SimpleNamespace, eager_reference) -> None:
    pixels = np.ascontiguousarray(eager_reference.test_pixels[:ROWS], dtype=np.float32)
    want = _eager(eager_reference, pixels)
    tensor = ts.m.ModelInferRequest.InferInputTensor
    raw = ts.m.ModelInferRequest(
        model_name=MODEL,
        id="ts-1",
        inputs=[tensor(name="pixels", datatype="FP32", shape=pixels.shape)],
        outputs=[ts.m.ModelInferRequest.InferRequestedOutputTensor(name="logits")],
        raw_input_contents=[pixels.tobytes()],
    )
    response = stub.ModelInfer(raw, timeout=60)
    assert response.id == "ts-1"
    assert response.model_name == MODEL
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("logits", "FP32", [ROWS, 10])
    got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(ROWS, 10)
    np.testing.assert_allclose(got, want, atol=TOL)

    typed = ts.m.ModelInferRequest(
        model_name=MODEL,
        inputs=[
            tensor(
                name="pixels",
                datatype="FP32",
                shape=pixels.shape,
                contents=ts.m.InferTensorContents(fp32_contents=pixels.reshape(-1).tolist()),
            )
        ],
    )
    response = stub.ModelInfer(typed, timeout=60)
    outs = {o.name: i for i, o in enumerate(response.outputs)}
    got = np.frombuffer(response.raw_output_contents[outs["logits"]], np.float32).reshape(ROWS, 10)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_errors_have_their_status_and_message(stub, ts: SimpleNamespace) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelMetadata(ts.m.ModelMetadataRequest(name="no_such_model"), timeout=30)
    assert caught.value.code() is grpc.StatusCode.NOT_FOUND
    assert "no_such_model" in caught.value.details()
    bad = ts.m.ModelInferRequest(
        model_name=MODEL,
        inputs=[ts.m.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=[1, 63])],
        raw_input_contents=[np.zeros(63, np.float32).tobytes()],
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(bad, timeout=30)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "pixels" in caught.value.details()
