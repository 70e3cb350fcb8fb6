"""The Open Inference Protocol's tensor codec (contracts.tensors) and shared checks (common.oip_codec).

Every datatype round-trips through both wire forms (raw little-endian bytes and typed values),
BYTES uses 4-byte little-endian length prefixes, and every mismatch is an INVALID_ARGUMENT
that names the tensor, what was expected and what was received, before anything is queued.
"""

from __future__ import annotations

import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mariner.server.common import oip_codec as oip
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.tensors import (
    CONTENTS_FIELD,
    DTYPES,
    ModelSignature,
    TensorSpec,
    datatype_of,
    decode_raw,
    decode_values,
    encode_raw,
    match_signature,
)
from mariner.server.contracts.types import InferResult, WireProtocol

pytestmark = pytest.mark.unit

NUMERIC = [dt for dt in DTYPES if dt != "BYTES"]


def sample(datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values that exercise each type's range ends, not just zeros."""
    n = int(np.prod(shape))
    dt = DTYPES[datatype]
    if datatype == "BOOL":
        return (np.arange(n) % 2 == 0).reshape(shape)
    if datatype == "BYTES":
        return np.array([f"é{i}".encode() * (i % 3) for i in range(n)], dtype=object).reshape(shape)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        vals = [info.min, info.max, 0, 1, info.max // 3]
        return np.array([vals[i % len(vals)] for i in range(n)], dtype=dt).reshape(shape)
    return (np.linspace(-3.5, 7.25, n) if n else np.empty(0)).astype(dt).reshape(shape)


def invalid(fn, *args: object) -> ServingError:
    with pytest.raises(ServingError) as info:
        fn(*args)
    assert info.value.code is Code.INVALID_ARGUMENT
    return info.value


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 4), (1,), (2, 0), (2, 1, 3)])
def test_raw_round_trip_every_datatype(datatype: str, shape: tuple[int, ...]) -> None:
    arr = sample(datatype, shape)
    back = decode_raw("t", datatype, list(shape), encode_raw(arr))
    assert back.shape == shape
    assert datatype_of(back) == datatype
    if datatype == "BYTES":
        assert back.tolist() == arr.tolist()
    else:
        assert back.dtype == DTYPES[datatype]
        np.testing.assert_array_equal(back, arr)


@pytest.mark.parametrize("datatype", list(DTYPES))
def test_values_round_trip_every_datatype(datatype: str) -> None:
    arr = sample(datatype, (2, 5))
    flat = arr.reshape(-1).tolist()
    back = decode_values("t", datatype, [2, 5], flat)
    assert back.shape == (2, 5)
    if datatype == "BYTES":
        assert back.tolist() == arr.tolist()
    else:
        assert back.dtype == DTYPES[datatype]
        np.testing.assert_array_equal(back, arr)


def test_raw_bytes_are_little_endian_row_major() -> None:
    arr = np.array([[1, 2], [3, 256]], dtype=np.int32)
    assert encode_raw(arr) == struct.pack("<4i", 1, 2, 3, 256)
    big_endian = arr.astype(">i4")
    assert encode_raw(big_endian) == struct.pack("<4i", 1, 2, 3, 256)
    assert encode_raw(np.array([True, False])) == b"\x01\x00"


def test_bf16_is_served_when_ml_dtypes_is_present() -> None:
    assert "BF16" in DTYPES
    arr = np.array([1.5, -2.0], dtype=DTYPES["BF16"])
    assert encode_raw(arr) == arr.view(np.uint16).astype("<u2").tobytes()


@settings(max_examples=60, deadline=None)
@given(
    datatype=st.sampled_from(list(DTYPES)),
    shape=st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=4).map(tuple),
)
def test_raw_round_trip_property(datatype: str, shape: tuple[int, ...]) -> None:
    arr = sample(datatype, shape)
    back = decode_raw("t", datatype, list(shape), encode_raw(arr))
    assert back.shape == shape
    assert back.tolist() == arr.tolist()


# -- BYTES framing ----------------------------------------------------------------------------
def test_bytes_elements_carry_four_byte_little_endian_lengths() -> None:
    arr = np.array([b"ab", b"", "xyz"], dtype=object)
    assert encode_raw(arr) == b"\x02\x00\x00\x00ab" + b"\x00\x00\x00\x00" + b"\x03\x00\x00\x00xyz"
    assert decode_raw("s", "BYTES", [3], encode_raw(arr)).tolist() == [b"ab", b"", b"xyz"]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\x02\x00\x00\x00ab", "need at least 8 bytes, received 6"),  # refused before allocating
        (b"\x02\x00\x00\x00abcd", "ends after 1 of 2"),
        (b"\x02\x00\x00\x00ab\x09\x00\x00\x00xy", "claims 9 bytes, only 2 remain"),
        (b"\x01\x00\x00\x00a\x01\x00\x00\x00bZZ", "2 bytes left over"),
        (b"\x02\x00", "need at least 8 bytes, received 2"),
    ],
)
def test_malformed_bytes_framing_names_the_tensor(raw: bytes, needle: str) -> None:
    err = invalid(decode_raw, "words", "BYTES", [2], raw)
    assert "'words'" in err.message
    assert needle in err.message


# -- mismatches -------------------------------------------------------------------------------
@pytest.mark.parametrize("datatype", NUMERIC)
def test_raw_length_mismatch_names_tensor_expected_and_received(datatype: str) -> None:
    itemsize = DTYPES[datatype].itemsize
    err = invalid(decode_raw, "pixels", datatype, [2, 3], b"\x00" * (6 * itemsize - 1))
    assert "'pixels'" in err.message
    assert f"needs {6 * itemsize} bytes" in err.message
    assert f"received {6 * itemsize - 1}" in err.message
    assert datatype in err.message


def test_values_count_mismatch_names_tensor_expected_and_received() -> None:
    err = invalid(decode_values, "pixels", "FP32", [2, 64], [0.0] * 127)
    assert "'pixels'" in err.message
    assert "needs 128 values" in err.message
    assert "received 127" in err.message


@pytest.mark.parametrize(
    ("datatype", "values", "needle"),
    [("INT8", [300], "not valid INT8"), ("FP32", ["abc"], "not valid FP32"), ("UINT8", [-1], "UINT8")],
)
def test_values_that_do_not_fit_the_datatype_are_refused(datatype: str, values: list, needle: str) -> None:
    err = invalid(decode_values, "x", datatype, [1], values)
    assert needle in err.message
    assert "'x'" in err.message


@pytest.mark.parametrize("shape", [[-1, 64], [1] * 9])
def test_bad_shapes_are_refused(shape: list[int]) -> None:
    err = invalid(decode_raw, "x", "FP32", shape, b"")
    assert "'x'" in err.message
    assert str(shape) in err.message


def test_unknown_datatype_lists_the_allowed_ones() -> None:
    err = invalid(decode_raw, "x", "FLOAT32", [1], b"\x00" * 4)
    assert "'FLOAT32'" in err.message
    assert "FP32" in err.message
    assert "BYTES" in err.message


# -- signatures -------------------------------------------------------------------------------
SIG = ModelSignature(
    inputs=(TensorSpec("pixels", "FP32", (-1, 64)),),
    outputs=(
        TensorSpec("logits", "FP32", (-1, 10)),
        TensorSpec("probabilities", "FP32", (-1, 10)),
        TensorSpec("label", "INT64", (-1,)),
    ),
)
TWO_IN = ModelSignature(
    inputs=(TensorSpec("a", "FP32", (-1, 2)), TensorSpec("b", "INT32", (-1,))),
    outputs=(),
)


def test_signature_from_model_config() -> None:
    raw = {
        "inputs": [{"name": "pixels", "datatype": "fp32", "shape": [-1, 64]}],
        "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}],
    }
    sig = ModelSignature.from_config(raw)
    assert sig is not None
    assert sig.inputs == (TensorSpec("pixels", "FP32", (-1, 64)),)
    assert ModelSignature.from_config(None) is None
    with pytest.raises(ValueError, match="unknown datatype"):
        ModelSignature.from_config({"inputs": [{"name": "x", "datatype": "F32", "shape": [1]}]})


def test_match_signature_returns_rows() -> None:
    assert match_signature({"pixels": ("FP32", np.zeros((5, 64), np.float32))}, SIG) == 5
    rows = match_signature(
        {"a": ("FP32", np.zeros((3, 2), np.float32)), "b": ("INT32", np.zeros(3, np.int32))}, TWO_IN
    )
    assert rows == 3


@pytest.mark.parametrize(
    ("inputs", "needles"),
    [
        ({"pixels": ("FP32", np.zeros((2, 63), np.float32))}, ["'pixels'", "[-1, 64]", "[2, 63]"]),
        ({"pixels": ("FP32", np.zeros((2, 8, 8), np.float32))}, ["'pixels'", "[-1, 64]", "[2, 8, 8]"]),
        ({"pixels": ("FP64", np.zeros((2, 64)))}, ["'pixels'", "FP32", "FP64"]),
        ({"pixel": ("FP32", np.zeros((2, 64), np.float32))}, ["['pixel']", "pixels FP32[-1, 64]"]),
        ({}, ["missing", "['pixels']"]),
        ({"pixels": ("FP32", np.zeros((0, 64), np.float32))}, ["at least one row"]),
    ],
)
def test_match_signature_mismatches(inputs: dict, needles: list[str]) -> None:
    err = invalid(match_signature, inputs, SIG)
    for needle in needles:
        assert needle in err.message


def test_inputs_must_agree_on_rows() -> None:
    inputs = {"a": ("FP32", np.zeros((3, 2), np.float32)), "b": ("INT32", np.zeros(2, np.int32))}
    assert "batch dim" in invalid(match_signature, inputs, TWO_IN).message


EITHER = ModelSignature.from_config(
    {
        "inputs": [
            {"name": "image", "datatype": "BYTES", "shape": [-1], "optional": True},
            {"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 2, 2], "optional": True},
        ],
        "outputs": [{"name": "indices", "datatype": "INT64", "shape": [-1, 5]}],
    }
)


def test_optional_inputs_may_be_left_out_but_not_all() -> None:
    assert EITHER is not None
    assert match_signature({"image": ("BYTES", np.array([b"a", b"b"], dtype=object))}, EITHER) == 2
    assert match_signature({"pixels": ("FP32", np.zeros((3, 3, 2, 2), np.float32))}, EITHER) == 3
    err = invalid(match_signature, {}, EITHER)
    assert "at least one of" in err.message
    assert "image BYTES[-1] (optional)" in err.message
    # The required input of a plain signature is still required.
    assert "missing input(s) ['pixels']" in invalid(match_signature, {}, SIG).message


@pytest.mark.parametrize("item", [{"optional": "yes"}, {"optional": 1}])
def test_optional_must_be_a_bool(item: dict) -> None:
    with pytest.raises(ValueError, match="'optional' is true or false"):
        ModelSignature.from_config({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], **item}]})


def test_outputs_cannot_be_optional() -> None:
    with pytest.raises(ValueError, match="only for inputs"):
        ModelSignature.from_config(
            {"inputs": [], "outputs": [{"name": "y", "datatype": "FP32", "shape": [1], "optional": True}]}
        )


# -- shared adapter checks (common.oip_codec) -----------------------------------------------
def test_element_cap_is_checked_before_any_allocation() -> None:
    err = invalid(oip.check_header, "words", "BYTES", [1 << 40], 1000)
    assert "'words'" in err.message
    assert "at most 1000" in err.message
    assert oip.check_header("x", "FP32", [2, 3], 6) == (2, 3)


def test_deadline_from_timeout_parameter_in_microseconds() -> None:
    assert oip.deadline_from({}, None) is None
    before = time.monotonic()
    deadline = oip.deadline_from({"timeout": 2_000_000}, 10.0)
    assert deadline is not None
    assert before + 1.9 < deadline < time.monotonic() + 2.1
    tighter = oip.deadline_from({"timeout": 60_000_000}, 0.5)
    assert tighter is not None
    assert tighter < time.monotonic() + 0.6


@pytest.mark.parametrize("params", [{"sequence_id": 7}, {"timeout": -1}, {"timeout": "soon"}])
def test_unsupported_or_bad_request_parameters(params: dict) -> None:
    invalid(oip.deadline_from, params, None)


def test_unsupported_tensor_parameters_are_refused() -> None:
    err = invalid(oip.check_tensor_params, "output", "label", {"classification": 3})
    assert "'label'" in err.message
    invalid(oip.check_tensor_params, "input", "pixels", {"shared_memory_region": "r"})
    oip.check_tensor_params("output", "label", {"binary_data": True})


def _prepared(requested: tuple[str, ...] = ()) -> oip.Prepared:
    handle = SimpleNamespace(name="digits", version="1.0", signature=SIG)
    return oip.prepare(
        handle,
        inputs={"pixels": ("FP32", np.zeros((2, 64), np.float32))},
        requested=requested,
        request_id="r1",
        protocol=WireProtocol.OIP_GRPC,
        deadline=None,
        headers={},
    )


def _answer(**overrides: object) -> InferResult:
    tensors = {
        "logits": np.ones((2, 10), np.float64),  # cast to the declared FP32
        "probabilities": np.full((2, 10), 0.1, np.float32),
        "label": np.array([3, 4], np.int64),
    }
    return InferResult(body=b"", tensors={**tensors, **overrides})


def test_prepare_builds_a_tensor_request_with_one_slot_per_row() -> None:
    prepared = _prepared()
    req = prepared.request
    assert (req.model, req.version, req.items, req.request_id) == ("digits", "1.0", 2, "r1")
    assert req.tensors is not None
    assert set(req.tensors) == {"pixels"}
    assert req.data == {}  # nothing a handler could mistake for TorchServe input


def test_pick_outputs_all_declared_in_signature_order_with_declared_types() -> None:
    outs = oip.pick_outputs(_prepared(), _answer())
    assert [(o.name, o.datatype) for o in outs] == [
        ("logits", "FP32"),
        ("probabilities", "FP32"),
        ("label", "INT64"),
    ]
    assert outs[0].array.dtype == np.float32


def test_pick_outputs_requested_in_request_order() -> None:
    outs = oip.pick_outputs(_prepared(("label", "logits")), _answer())
    assert [o.name for o in outs] == ["label", "logits"]


def test_unknown_requested_output_fails_before_queueing() -> None:
    err = invalid(_prepared, ("label", "scores"))
    assert "['scores']" in err.message
    assert "label INT64[-1]" in err.message
    assert "more than once" in invalid(_prepared, ("label", "label")).message


def test_handler_rejection_carries_the_handlers_message() -> None:
    result = InferResult(body=b'{"error": "pixels must be in [0, 16]", "code": 400}', status=400)
    err = invalid(oip.pick_outputs, _prepared(), result)
    assert err.message == "pixels must be in [0, 16]"


def test_handler_that_forgets_an_output_is_an_internal_error() -> None:
    result = InferResult(body=b"", tensors={"logits": np.ones((2, 10), np.float32)})
    with pytest.raises(ServingError) as info:
        oip.pick_outputs(_prepared(), result)
    assert info.value.code is Code.INTERNAL
    with pytest.raises(ServingError) as info:
        oip.pick_outputs(_prepared(), InferResult(body=b"{}"))
    assert info.value.code is Code.INTERNAL


def test_model_without_signature_points_to_the_torchserve_api() -> None:
    handle = SimpleNamespace(name="legacy", version="1.0", signature=None)
    err = invalid(oip.signature_of, handle)
    assert "model legacy declares no tensor signature; use the TorchServe API" in err.message


def test_long_request_ids_are_refused_and_missing_ones_generated() -> None:
    assert oip.request_id_of("abc") == "abc"
    assert len(oip.request_id_of("")) == 32
    invalid(oip.request_id_of, "x" * (oip.MAX_ID_CHARS + 1))


# -- headers are checked before data; data is decoded by numpy ---------------------------------
@pytest.mark.parametrize(
    ("name", "datatype", "shape", "needles"),
    [
        ("pixels", "INT64", [2, 64], ["'pixels'", "expected datatype FP32", "received INT64"]),
        ("pixels", "FP32", [2, 63], ["'pixels'", "expected shape [-1, 64]", "received [2, 63]"]),
        ("pixels", "FP32", [9, 64], ["'pixels'", "9 rows", "at most 8", "max batch size"]),
        ("pixel", "FP32", [1, 64], ["['pixel']", "pixels FP32[-1, 64]"]),
    ],
)
def test_input_header_is_checked_against_signature_and_max_batch(
    name: str, datatype: str, shape: list[int], needles: list[str]
) -> None:
    err = invalid(oip.check_input, SIG, 8, name, datatype, shape)
    for needle in needles:
        assert needle in err.message
    oip.check_input(SIG, 8, "pixels", "FP32", [8, 64])  # the largest accepted header


def test_flat_values_are_counted_before_any_is_converted() -> None:
    # Unconvertible values: the count is what is reported, so none of them was converted.
    err = invalid(decode_values, "x", "FP32", [2], ["not a number"] * 3)
    assert "needs 2 values, received 3" in err.message


def test_json_booleans_are_refused_unless_the_text_holds_none() -> None:
    err = invalid(decode_values, "x", "FP32", [2], [1.0, True])
    assert "not booleans" in err.message
    assert "not booleans" in invalid(decode_values, "x", "INT32", [1, 2], [[1, False]]).message
    arr = decode_values("x", "INT32", [2, 2], [[1, 2], [3, 4]], may_hold_bools=False)
    assert arr.dtype == np.int32
    np.testing.assert_array_equal(arr, [[1, 2], [3, 4]])
    assert "not valid FP32" in invalid(decode_values, "x", "FP32", [2, 2], [[1, 2], [3]]).message


@pytest.fixture(scope="module")
def contents_pb() -> SimpleNamespace:
    from mariner.server import protogen

    protogen.generate()
    from mariner.server._proto.inference import grpc_service_pb2
    from mariner.server.frontend.protocols.oip import contents
    from mariner.server.frontend.protocols.oip import grpc as grpc_oip

    return SimpleNamespace(m=grpc_service_pb2, decode=contents.decode_contents, shallow=grpc_oip)


@pytest.mark.parametrize("datatype", sorted(CONTENTS_FIELD))
def test_contents_round_trip_every_typed_field(contents_pb: SimpleNamespace, datatype: str) -> None:
    arr = sample(datatype, (2, 3))
    message = contents_pb.m.InferTensorContents()
    getattr(message, CONTENTS_FIELD[datatype]).extend(arr.reshape(-1).tolist())
    other = "int64_contents" if datatype != "INT64" else "fp64_contents"
    getattr(message, other).extend([9] * 50)  # another typed field: skipped unread, as before
    back = contents_pb.decode("t", datatype, (2, 3), message.SerializeToString())
    assert back.shape == (2, 3)
    np.testing.assert_array_equal(back.astype(arr.dtype) if datatype != "BYTES" else back, arr)


def test_unpacked_float_contents_decode_like_packed(contents_pb: SimpleNamespace) -> None:
    tag = 6 << 3 | 5  # fp32_contents, one fixed32 element per field
    blob = b"".join(bytes([tag]) + struct.pack("<f", v) for v in (1.5, -2.0))
    np.testing.assert_array_equal(contents_pb.decode("t", "FP32", (2,), blob), [1.5, -2.0])


@pytest.mark.parametrize(
    ("datatype", "fields", "needle"),
    [
        ("FP32", {"fp32_contents": [1.0] * 3}, "needs 2 values, received 3"),
        ("INT64", {"int64_contents": [1] * 3}, "needs 2 values, received 3"),
        ("INT64", {"int64_contents": [1] * 21}, "holds more than the 2 values"),
        ("UINT8", {"uint_contents": [256, 0]}, "not valid UINT8"),
        ("INT32", {"int_contents": [1]}, "needs 2 values, received 1"),
        ("INT8", {"int_contents": [300, 1]}, "not valid INT8"),
        ("BYTES", {"bytes_contents": [b"a"] * 40}, "more fields than its shape has elements"),
    ],
)
def test_contents_that_disagree_with_the_header_are_refused(
    contents_pb: SimpleNamespace, datatype: str, fields: dict, needle: str
) -> None:
    blob = contents_pb.m.InferTensorContents(**fields).SerializeToString()
    err = invalid(contents_pb.decode, "t", datatype, (2,), blob)
    assert "'t'" in err.message
    assert needle in err.message


@pytest.mark.parametrize("blob", [b"\xff", b"\x32\x10\x00", b"\x0f\x00", b"\x1a\x03\xff\xff\xff"])
def test_garbage_contents_are_invalid_argument(contents_pb: SimpleNamespace, blob: bytes) -> None:
    assert "'t'" in invalid(contents_pb.decode, "t", "INT64", (1,), blob).message


def test_shallow_request_keeps_contents_serialized(contents_pb: SimpleNamespace) -> None:
    tensor = contents_pb.m.ModelInferRequest.InferInputTensor(name="p", datatype="FP32", shape=[2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    wire = contents_pb.m.ModelInferRequest(model_name="m", id="i", inputs=[tensor]).SerializeToString()
    shallow = contents_pb.shallow.ShallowInferRequest.FromString(wire)
    assert (shallow.model_name, shallow.id, list(shallow.inputs[0].shape)) == ("m", "i", [2])
    assert shallow.inputs[0].contents == tensor.contents.SerializeToString()
    assert shallow.SerializeToString() == wire
