"""Handler resolution as TorchServe's model loader does it, and a handler's failures answered as
TorchServe's worker answers them (on TorchServe's endpoints) and in our words (elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mariner.server.common.archive import ModelArchive
from mariner.server.common.grpc_status import torchserve_grpc
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer, torchserve_answer
from mariner.server.contracts.types import InferRequest, WireProtocol
from mariner.server.worker.device import Placement
from mariner.server.worker.entry_point import load_entry_point
from mariner.server.worker.runner import ModelHost

pytestmark = pytest.mark.unit


def archive(tmp_path: Path, handler: str, files: dict[str, str], **model: Any) -> ModelArchive:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    manifest = {"model": {"modelName": "m", "modelVersion": "1.0", "handler": handler, **model}}
    return ModelArchive("m", "1.0", tmp_path / "m.mar", "0" * 64, tmp_path, manifest)


def host(arch: ModelArchive) -> ModelHost:
    h = ModelHost(arch, id="m-1.0-0", placement=Placement(gpu_id=None), batch_size=4)
    h.load()
    return h


def request(body: Any = b"\x00\x01") -> InferRequest:
    return InferRequest(
        model="m", version=None, data={"body": body}, protocol=WireProtocol.TS_HTTP, request_id="r1"
    )


FUNCTION = """
seen = []
def handle(data, context):
    seen.append(None if data is None else [type(d["body"]).__name__ for d in data])
    if data is None:
        return None
    return [len(d["body"]) for d in data]
"""


def test_a_module_level_handle_is_initialised_with_none_then_called_per_batch(tmp_path: Path) -> None:
    h = host(archive(tmp_path, "fn_handler.py", {"fn_handler.py": FUNCTION}))
    results = h.run_batch([request(), request(b"abc")])
    assert [json.loads(r.body) for r in results] == [2, 3]
    # TorchServe calls handle(None, ctx) once at load, and hands binary bodies over as bytearray.
    assert h._handle.__globals__["seen"] == [None, ["bytearray", "bytearray"]]


def test_module_colon_function_names_the_entry_point(tmp_path: Path) -> None:
    code = "def infer(data, context):\n    return None if data is None else ['custom' for _ in data]\n"
    h = host(archive(tmp_path, "entry:infer", {"entry.py": code}))
    assert h.run_batch([request()])[0].body == b"custom"


def test_a_class_handler_is_instantiated_and_initialised(tmp_path: Path) -> None:
    code = (
        "from helper_mod import WORD\n"
        "class H:\n"
        "    def initialize(self, context):\n"
        "        self.name = context.manifest['model']['modelName']\n"
        "    def handle(self, data, context):\n"
        "        return [f'{WORD} {self.name}' for _ in data]\n"
    )
    files = {"h.py": code, "helper_mod.py": "WORD = 'hello'\n"}
    h = host(archive(tmp_path, "h.py", files))
    assert h.run_batch([request()])[0].body == b"hello m"


def test_a_built_in_handler_is_resolved_from_torchserves_library(tmp_path: Path) -> None:
    pytest.importorskip("ts")  # the serving install carries it; this checks the resolution
    handle, _init = load_entry_point(archive(tmp_path, "base_handler", {}))
    assert type(handle.__self__).__module__ == "ts.torch_handler.base_handler"
    assert type(handle.__self__).__name__ == "BaseHandler"


def test_an_unknown_handler_names_both_places_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ServingError) as err:
        load_entry_point(archive(tmp_path, "no_such_handler", {}))
    assert err.value.code is Code.INVALID_ARGUMENT
    assert "ts.torch_handler.no_such_handler" in err.value.message
    assert "image_classifier" in err.value.message  # what is allowed


def test_a_shipped_handler_that_fails_to_import_reports_its_own_error(tmp_path: Path) -> None:
    code = "import package_that_is_not_installed\ndef handle(data, context):\n    return data\n"
    with pytest.raises(ServingError, match="package_that_is_not_installed"):
        load_entry_point(archive(tmp_path, "broken.py", {"broken.py": code}))


def test_two_archives_with_the_same_handler_name_each_get_their_own(tmp_path: Path) -> None:
    one = host(
        archive(tmp_path / "a", "handler.py", {"handler.py": "def handle(d, c):\n    return d and ['a']\n"})
    )
    two = host(
        archive(tmp_path / "b", "handler.py", {"handler.py": "def handle(d, c):\n    return d and ['b']\n"})
    )
    assert one.run_batch([request()])[0].body == b"a"
    assert two.run_batch([request()])[0].body == b"b"


def test_a_class_module_needs_exactly_one_class(tmp_path: Path) -> None:
    code = "class A:\n    def handle(self, d, c):\n        return d\nclass B:\n    pass\n"
    with pytest.raises(ServingError, match="exactly one class, found 2 classes"):
        load_entry_point(archive(tmp_path, "two.py", {"two.py": code}))


def test_the_service_envelope_wraps_the_entry_point(tmp_path: Path) -> None:
    pytest.importorskip("ts")
    code = "def handle(data, context):\n    return None if data is None else [sum(x) for x in data]\n"
    arch = archive(tmp_path, "h.py", {"h.py": code}, envelope="json")
    h = host(arch)
    # A JSON body reaches the handler parsed, as TorchServe's backend decodes application/json.
    [result] = h.run_batch([request({"instances": [[1, 2], [3, 4]]})])
    assert json.loads(result.body) == {"predictions": [3, 7]}  # TorchServe's JSON envelope


RAISES = """
from ts.utils.util import PredictionException
def handle(data, context):
    if data is None:
        return None
    kind = bytes(data[0]["body"]).decode()
    if kind == "custom":
        raise PredictionException("the input is not a digit", 513)
    if kind == "big":
        raise PredictionException("too large", 413)
    if kind == "value":
        raise ValueError("secret internals")
    if kind == "dict":
        return {"not": "a list"}
    return [1, 2][: len(data) + 1]
"""


MISMATCH = "number of batch response mismatched"


@pytest.mark.parametrize(
    ("body", "ours", "theirs"),
    [
        (b"custom", (Code.INTERNAL, "the input is not a digit"), (513, "the input is not a digit")),
        (b"big", (Code.INVALID_ARGUMENT, "too large"), (507, "too large")),
        (
            b"value",
            (Code.INTERNAL, "the model's handler failed on this batch (ValueError)"),
            (503, "Prediction failed"),
        ),
        (b"dict", (Code.INTERNAL, "returned dict, not a list"), (503, "Invalid model predict output")),
        (
            b"short",
            (Code.INTERNAL, "returned 2 results for a batch of 1"),
            (503, "number of batch response mismatched"),
        ),
    ],
)
def test_handler_failures_are_answered_as_torchserve_answers_them(
    tmp_path: Path, body: bytes, ours: tuple[Code, str], theirs: tuple[int, str]
) -> None:
    pytest.importorskip("ts")
    h = host(archive(tmp_path, "raiser.py", {"raiser.py": RAISES}))
    with pytest.raises(ServingError) as err:
        h.run_batch([request(body)])
    assert err.value.code is ours[0]
    assert ours[1] in err.value.message
    assert "secret internals" not in err.value.message  # the exception text stays in the log
    assert torchserve_answer(err.value) == TorchServeAnswer(theirs[0], "InternalServerException", theirs[1])


def test_torchserve_answers_over_grpc_as_its_frontend_maps_them() -> None:
    import grpc

    failed = TorchServeAnswer(503, "InternalServerException", "Prediction failed")
    assert torchserve_grpc(failed) == (
        grpc.StatusCode.UNAVAILABLE,
        "Prediction failed\norg.pytorch.serve.http.InternalServerException",
    )
    assert (
        torchserve_grpc(TorchServeAnswer(513, "InternalServerException", "x"))[0] is grpc.StatusCode.INTERNAL
    )
    assert (
        torchserve_grpc(TorchServeAnswer(400, "InternalServerException", "x"))[0]
        is grpc.StatusCode.INVALID_ARGUMENT
    )


def test_errors_without_their_own_answer_use_torchserves_exception_names() -> None:
    assert torchserve_answer(ServingError(Code.NOT_FOUND, "model x is not served")) == TorchServeAnswer(
        404, "ModelNotFoundException", "model x is not served"
    )
    assert torchserve_answer(ServingError(Code.ALREADY_EXISTS, "dup")).type == "ConflictStatusException"


def test_service_envelope_from_config_properties_reaches_the_manifest(tmp_path: Path) -> None:
    from mariner.server.common.archive import with_envelope
    from mariner.server.compat.torchserve.java_properties import read_properties
    from mariner.server.compat.torchserve.properties import from_torchserve_properties

    setting = from_torchserve_properties(read_properties("service_envelope=kservev2\n"))
    assert setting == {"service_envelope": "kservev2"}
    arch = archive(tmp_path, "h.py", {})
    wrapped = with_envelope(arch, setting["service_envelope"])
    assert wrapped.manifest["model"]["envelope"] == "kservev2"
    assert "envelope" not in arch.manifest["model"]  # the opened archive itself is unchanged
    assert with_envelope(arch, None) is arch


def test_an_unknown_envelope_is_refused_naming_the_choices(tmp_path: Path) -> None:
    pytest.importorskip("ts")
    code = "def handle(data, context):\n    return data\n"
    with pytest.raises(ServingError, match="json, kserve, kservev2, body"):
        load_entry_point(archive(tmp_path, "h.py", {"h.py": code}, envelope="soap"))
