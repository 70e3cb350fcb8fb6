"""What the fuzz tests (test_fuzz.py) send, how they send it, and how they judge the answers.

Clients that send bytes as they are: `call_raw` hands gRPC already-serialized requests (identity
serializers), `http_exchange` writes a request byte for byte on its own connection. Judges:
`grpc_problem` and `http_problem` say why an answer is wrong (or None) and count every answer in
STATUS_COUNTS. Strategies: raw and mutated protobuf bytes, hostile OIP and TorchServe messages,
raw HTTP requests. Known findings (`*_known` helpers) name the inputs for which a wrong answer is
already pinned by a strict xfail test, so the fuzz tests accept exactly those and hunt the rest.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import math
import re
import socket
import struct
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import grpc
from hypothesis import strategies as st

from mariner.server import protogen

MAX_REQUEST_BYTES = 64 * 1024  # the fuzzed server's limit: low, so crossing it is cheap
MODEL = "digits_onnx"
VERSION = "1.0"
GOOD_PIXELS = [float(i % 17) for i in range(64)]
CALL_TIMEOUT_S = 20.0  # far above any honest answer: reaching it means the server hung

# Answers by surface and status ("grpc:INVALID_ARGUMENT", "http:404", "known finding: ...");
# tests.fuzz_main prints it after a run.
STATUS_COUNTS: Counter[str] = Counter()


@st.composite
def mostly(draw: st.DrawFn, common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> Any:
    """`rare` in roughly one draw of 16-32: four fair coins must all come up. Hypothesis has no
    weights, and its choices chase novelty, so a plain one_of gives a huge rare branch half the
    draws. Rare here: what is slow to answer (gRPC takes 0.2-0.9 s to refuse a message over the
    limit) or big (deeply nested JSON)."""
    return draw(rare if all(draw(st.booleans()) for _ in range(4)) else common)


# -- what an answer may be -----------------------------------------------------------------------
SC = grpc.StatusCode
# DESIGN.md's error table.
DOCUMENTED_GRPC = frozenset(
    {SC.OK, SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.UNAVAILABLE, SC.RESOURCE_EXHAUSTED, SC.DEADLINE_EXCEEDED,
     SC.UNAUTHENTICATED, SC.PERMISSION_DENIED, SC.UNIMPLEMENTED, SC.INTERNAL}
)  # fmt: skip
# The table plus the transport-level 405 (method), 413 (body size) and 431 (request line and
# headers over --http-max-header-bytes: a target of a few long segments crosses its 32 KiB), and
# TorchServe's 202 "Processing worker updates..." to a scale without `synchronous=true`.
DOCUMENTED_HTTP = frozenset({200, 202, 400, 401, 403, 404, 405, 413, 431, 500, 501, 503, 504})
# What a message must never contain: a traceback, a frame, an exception's repr.
LEAK = re.compile(r"Traceback \(most recent call last\)|File \"|<class '|Error\(|Exception\(")
# uvicorn's answer to bytes that are not HTTP at all (bad request line, header or chunking):
# it never reaches the app, and its plain-text body carries nothing of the request.
UNPARSEABLE_HTTP = b"Invalid HTTP request received."


def grpc_problem(answer: GrpcAnswer, known: Mapping[grpc.StatusCode, str] | None = None) -> str | None:
    """Why a gRPC answer to a fuzzed request is wrong, or None; counts the answer.

    A fuzzed request is the client's fault, so INTERNAL is wrong too (the server failed to say
    what was wrong), unless `known` names the pinned finding that explains it for this input.
    """
    code, details = answer.code, answer.details
    STATUS_COUNTS[f"grpc:{code.name}"] += 1
    if answer.elapsed >= CALL_TIMEOUT_S * 0.9:
        return f"no answer within {answer.elapsed:.1f} s ({code.name})"
    if known and code in known:
        STATUS_COUNTS[f"known finding: {known[code]}"] += 1
        return None
    if code not in DOCUMENTED_GRPC:
        return f"undocumented status {code.name}: {details[:300]!r}"
    if code is SC.INTERNAL:
        return f"INTERNAL for a client's request: {details[:300]!r}"
    if LEAK.search(details):
        return f"{code.name} details leak internals: {details[:300]!r}"
    return None


def http_problem(
    method: bytes, answer: HttpAnswer | None, known: Mapping[int, str] | None = None
) -> str | None:
    """Why an HTTP answer to a fuzzed request is wrong, or None; counts the answer."""
    if answer is None:
        STATUS_COUNTS["http:no answer"] += 1
        return "the connection closed without an answer"
    unparseable = answer.status == 400 and answer.body == UNPARSEABLE_HTTP
    STATUS_COUNTS[f"http:{answer.status}" + (" (unparseable request)" if unparseable else "")] += 1
    if answer.elapsed >= CALL_TIMEOUT_S * 0.9:
        return f"answered only after {answer.elapsed:.1f} s"
    if known and answer.status in known:
        STATUS_COUNTS[f"known finding: {known[answer.status]}"] += 1
        return None
    text = answer.body.decode("utf-8", errors="replace")
    if answer.status not in DOCUMENTED_HTTP:
        return f"undocumented status {answer.status}: {text[:300]!r}"
    if answer.status == 500:
        return f"500 for a client's request: {text[:300]!r}"
    if LEAK.search(text):
        return f"{answer.status} body leaks internals: {text[:300]!r}"
    if answer.status < 400 or method == b"HEAD" or unparseable:
        return None
    try:
        doc = json.loads(answer.body)
    except ValueError:
        return f"{answer.status} with a body that is not JSON: {text[:300]!r}"
    if not (isinstance(doc, dict) and isinstance(doc.get("message", doc.get("error")), str)):
        return f"{answer.status} JSON body without a message: {text[:300]!r}"
    return None


# -- known findings ---------------------------------------------------------------------------------
# None today: the six the fuzzer found (undecodable gRPC requests, deeply nested JSON, empty tensors
# with impossible dims, Unicode digits in Inference-Header-Content-Length, trailing-slash redirects,
# a TorchServe field named "tensors") are fixed and enforced by test_fuzz.py. When the fuzzer finds
# a new one, pin it with a strict xfail there and name exactly its inputs here, so the rest is still
# hunted.
def oip_grpc_known(request: Any) -> dict[grpc.StatusCode, str]:
    return {}


def ts_grpc_known(request: Any) -> dict[grpc.StatusCode, str]:
    return {}


def http_known(case: HttpCase) -> dict[int, str]:
    return {}


# -- gRPC plumbing -------------------------------------------------------------------------------
TS = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
OIP = "inference.GRPCInferenceService"
MGMT = "org.pytorch.serve.grpc.management.ManagementAPIsService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


@dataclass(frozen=True)
class Method:
    """One RPC of one of the server's two gRPC ports."""

    service: str
    name: str
    kind: str  # unary_unary | unary_stream | stream_stream
    port: str  # inference | management

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


UU, US, SS = "unary_unary", "unary_stream", "stream_stream"
METHODS: tuple[Method, ...] = (
    Method(TS, "Ping", UU, "inference"),
    Method(TS, "Predictions", UU, "inference"),
    Method(TS, "StreamPredictions", US, "inference"),
    Method(TS, "StreamPredictions2", SS, "inference"),
    Method(OIP, "ServerLive", UU, "inference"),
    Method(OIP, "ServerReady", UU, "inference"),
    Method(OIP, "ModelReady", UU, "inference"),
    Method(OIP, "ServerMetadata", UU, "inference"),
    Method(OIP, "ModelMetadata", UU, "inference"),
    Method(OIP, "ModelInfer", UU, "inference"),
    Method(OIP, "ModelStreamInfer", SS, "inference"),
    Method(HEALTH, "Check", UU, "inference"),
    Method(REFLECTION, "ServerReflectionInfo", SS, "inference"),
    Method(MGMT, "DescribeModel", UU, "management"),
    Method(MGMT, "ListModels", UU, "management"),
    Method(MGMT, "RegisterModel", UU, "management"),
    Method(MGMT, "ScaleWorker", UU, "management"),
    Method(MGMT, "SetDefault", UU, "management"),
    Method(MGMT, "UnregisterModel", UU, "management"),
    Method(HEALTH, "Check", UU, "management"),
    Method(REFLECTION, "ServerReflectionInfo", SS, "management"),
)


@functools.cache
def stubs() -> SimpleNamespace:
    """Generated stubs, imported on first use (strategies build messages lazily)."""
    protogen.generate()
    from grpc_health.v1 import health_pb2  # noqa: F401  (registers its messages in the pool)
    from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401

    from mariner.server._proto.inference import grpc_service_pb2
    from mariner.server._proto.torchserve import inference_pb2, management_pb2

    return SimpleNamespace(oip=grpc_service_pb2, ts=inference_pb2, mgmt=management_pb2)


def request_class(method: Method) -> Any:
    """The method's request message class, from the descriptor pool the stubs registered in."""
    from google.protobuf import descriptor_pool, message_factory

    stubs()
    desc = descriptor_pool.Default().FindMethodByName(f"{method.service}.{method.name}")
    return message_factory.GetMessageClass(desc.input_type)


def decodes(method: Method, payload: bytes) -> bool:
    """Whether the server's own deserializer (the same protobuf runtime) can parse `payload`."""
    try:
        request_class(method).FromString(payload)
    except Exception:  # google.protobuf.message.DecodeError, whatever the runtime's flavour
        return False
    return True


@dataclass
class GrpcAnswer:
    """Status, details and the raw response messages of one call."""

    code: grpc.StatusCode
    details: str
    responses: list[bytes] = field(default_factory=list)
    elapsed: float = 0.0


def call_raw(
    channel: grpc.Channel,
    method: Method,
    payloads: Sequence[bytes],
    metadata: Sequence[tuple[str, str | bytes]] = (),
) -> GrpcAnswer:
    """Send `payloads` as already-serialized request(s); return the status and raw responses."""
    t0 = time.monotonic()
    kw: dict[str, Any] = {"timeout": CALL_TIMEOUT_S, "metadata": tuple(metadata) or None}
    try:
        if method.kind == UU:
            out = [channel.unary_unary(method.path)(payloads[0], **kw)]
        elif method.kind == US:
            out = list(channel.unary_stream(method.path)(payloads[0], **kw))
        else:
            out = list(channel.stream_stream(method.path)(iter(payloads), **kw))
    except grpc.RpcError as err:
        return GrpcAnswer(err.code(), err.details() or "", [], time.monotonic() - t0)
    return GrpcAnswer(SC.OK, "", out, time.monotonic() - t0)


def good_oip_request() -> Any:
    pb = stubs().oip
    tensor = pb.ModelInferRequest.InferInputTensor(name="pixels", datatype="FP32", shape=[1, 64])
    return pb.ModelInferRequest(
        model_name=MODEL, inputs=[tensor], raw_input_contents=[struct.pack("<64f", *GOOD_PIXELS)]
    )


def good_ts_request() -> Any:
    return stubs().ts.PredictionsRequest(model_name=MODEL, input={"data": json.dumps(GOOD_PIXELS).encode()})


# -- strategies: bytes as gRPC requests ---------------------------------------------------------
@functools.cache
def seed_messages() -> tuple[bytes, ...]:
    """Well-formed requests the mutator starts from, so it reaches past the parser."""
    s = stubs()
    return (
        good_ts_request().SerializeToString(),
        good_oip_request().SerializeToString(),
        s.oip.ModelMetadataRequest(name=MODEL, version=VERSION).SerializeToString(),
        s.oip.ModelReadyRequest(name=MODEL).SerializeToString(),
        s.mgmt.DescribeModelRequest(model_name=MODEL, model_version="all").SerializeToString(),
        s.mgmt.ListModelsRequest(limit=3, next_page_token=1).SerializeToString(),
        s.mgmt.RegisterModelRequest(url=f"{MODEL}.mar", model_name="x", batch_size=4).SerializeToString(),
        s.mgmt.ScaleWorkerRequest(model_name=MODEL, min_worker=2, max_worker=1).SerializeToString(),
    )


@st.composite
def mutated_seed(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(seed_messages())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "splice"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "splice":
            other = draw(st.sampled_from(seed_messages()))
            data[at:] = other[draw(st.integers(0, len(other))) :]
    return bytes(data)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# Field 1 (a string in every request that has one) longer than the server's message limit.
oversized_messages = st.integers(MAX_REQUEST_BYTES, MAX_REQUEST_BYTES + 4096).map(
    lambda n: b"\x0a" + varint(n) + b"a" * n
)
raw_payloads = mostly(
    st.one_of(st.binary(max_size=64), st.binary(min_size=64, max_size=2048), mutated_seed(), mutated_seed()),
    oversized_messages,
)


CORRUPT_TAILS = (
    b"\xff\xff\xff",  # a truncated varint tag
    b"\x0f",  # field 1 with wire type 7, which does not exist
    b"\x0a\x05ab",  # a length-delimited field that claims more bytes than follow
    b"\x0b",  # a group start that never ends
)


@st.composite
def undecodable_calls(draw: st.DrawFn) -> tuple[Method, bytes]:
    method = draw(st.sampled_from([m for m in METHODS if m.kind != SS]))
    prefix = draw(st.one_of(st.just(b""), mutated_seed(), st.binary(max_size=64)))
    payload = prefix + draw(st.one_of(st.sampled_from(CORRUPT_TAILS), st.binary(min_size=1, max_size=64)))
    return method, payload


# -- strategies: well-formed gRPC messages with hostile values ------------------------------------
INT64_EDGES = (-(2**63), -(2**31), -1, 0, 1, 2, 8, 32, 33, 64, 65, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1)
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
             "FP32", "FP64", "BF16", "BYTES")  # fmt: skip
ODD_DATATYPES = ("fp32", "Fp32", "FP8", "STRING", "INT128", "", "FP32 ", "FP32\x00", "float32", "TYPE_FP32")
ITEMSIZE = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
            "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8}  # fmt: skip
ODD_NAMES = ("", "..", "../../etc/passwd", "\x00", "%00", " ", "DIGITS_ONNX", f"{MODEL}\x00", f"{MODEL} ",
             f"{MODEL}/{VERSION}", "all", "\u202e", "\U0001f600", "null", "1.0\n", "-1")  # fmt: skip


def repeated(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(lo, hi))


small_text = st.one_of(st.sampled_from(ODD_NAMES), st.text(max_size=24))
hostile_text = mostly(
    st.one_of(st.sampled_from(ODD_NAMES), st.text(max_size=40), repeated(200, 5000)),
    repeated(MAX_REQUEST_BYTES // 4, MAX_REQUEST_BYTES),  # past the message limit once UTF-8 encoded
)
model_names = st.one_of(st.just(MODEL), hostile_text)
versions = st.one_of(st.just(""), st.just(VERSION), hostile_text)
dims = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1), st.integers(0, 70))
huge_dims = st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63 - 1])
shapes = st.one_of(
    st.builds(lambda n: [n, 64], st.integers(0, 40)),
    st.just([1, 8, 8]),
    st.lists(dims, max_size=10),
    # Zero elements, so under every cap, yet dims no array can have.
    st.lists(st.one_of(st.just(0), huge_dims), min_size=2, max_size=4)
    .map(lambda s: [0, *s])
    .flatmap(st.permutations),
)
datatypes = st.one_of(
    st.just("FP32"), st.sampled_from(DATATYPES), st.sampled_from(ODD_DATATYPES), st.text(max_size=12)
)
PARAM_KEYS = ("timeout", "sequence_id", "sequence_start", "priority", "binary_data_size", "binary_data",
              "binary_data_output", "shared_memory_region", "shared_memory_byte_size", "classification",
              "")  # fmt: skip
param_values = st.one_of(
    st.none(),
    st.tuples(st.just("bool_param"), st.booleans()),
    st.tuples(
        st.just("int64_param"), st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1))
    ),
    st.tuples(st.just("string_param"), small_text),
    st.tuples(st.just("double_param"), st.floats()),
    st.tuples(st.just("uint64_param"), st.integers(0, 2**64 - 1)),
)
param_maps = st.one_of(
    st.just({}),
    st.dictionaries(st.one_of(st.sampled_from(PARAM_KEYS), st.text(max_size=16)), param_values, max_size=4),
)
CONTENT_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=24),
}
pixel_values = st.one_of(st.floats(0, 16, width=32), st.floats(width=32))


def set_params(target: Any, params: dict[str, Any]) -> None:
    for key, choice in params.items():
        param = target[key]
        if choice is not None:
            setattr(param, choice[0], choice[1])
        else:
            param.SetInParent()  # present, with no value set in its oneof


@st.composite
def tensor_contents(draw: st.DrawFn, tensor: Any) -> None:
    field_name = draw(st.sampled_from(sorted(CONTENT_VALUES)))
    size = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 128]), st.integers(0, 200)))
    value = draw(pixel_values if field_name.startswith("fp") else CONTENT_VALUES[field_name])
    getattr(tensor.contents, field_name).extend([value] * size)
    if draw(st.booleans()):  # a second, conflicting typed field
        other = draw(st.sampled_from(sorted(CONTENT_VALUES)))
        getattr(tensor.contents, other).extend(draw(st.lists(CONTENT_VALUES[other], max_size=3)))


def element_bytes(shape: Sequence[int], datatype: str) -> int | None:
    """Bytes a raw buffer of this shape and datatype needs, or None when that is not small."""
    if datatype not in ITEMSIZE or any(d < 0 for d in shape):
        return None
    n = math.prod(shape) * ITEMSIZE[datatype]
    return n if n <= 16384 else None


@st.composite
def raw_buffer(draw: st.DrawFn, shape: Sequence[int], datatype: str) -> bytes:
    size = element_bytes(shape, datatype)
    mode = draw(st.sampled_from(["exact", "exact", "off_by_one", "random"]))
    if size is None or mode == "random":
        return draw(st.binary(max_size=512))
    if mode == "off_by_one":
        size = max(0, size + draw(st.sampled_from([-1, 1, -4, 4])))
    if datatype == "FP32":
        unit = struct.pack("<f", draw(pixel_values))
        return (unit * (size // 4 + 1))[:size]
    return (draw(st.binary(min_size=1, max_size=8)) * size)[:size]


@st.composite
def oip_infer_requests(draw: st.DrawFn) -> Any:
    pb = stubs().oip
    req = pb.ModelInferRequest(
        model_name=draw(model_names),
        model_version=draw(versions),
        id=draw(st.one_of(st.just(""), small_text, repeated(250, 2000))),
    )
    set_params(req.parameters, draw(param_maps))
    count = draw(st.one_of(st.just(1), st.integers(0, 4), st.integers(5, 300)))
    template = None
    for i in range(count):
        if template is not None and i >= 4:  # many inputs: copies, named apart or all alike
            clone = req.inputs.add()
            clone.CopyFrom(template)
            if i % 2:
                clone.name = f"pixels{i}"
            continue
        tensor = req.inputs.add(
            name=draw(st.one_of(st.just("pixels"), small_text)),
            datatype=draw(datatypes),
            shape=draw(shapes),
        )
        set_params(tensor.parameters, draw(param_maps))
        if draw(st.integers(0, 3)) == 0:
            draw(tensor_contents(tensor))
        template = tensor
    layout = draw(st.sampled_from(["raw", "raw", "none", "extra", "missing"]))
    if layout != "none":
        buffers = [draw(raw_buffer(list(t.shape), t.datatype.upper())) for t in req.inputs]
        if layout == "extra":
            buffers.append(draw(st.binary(max_size=64)))
        elif layout == "missing" and buffers:
            buffers.pop()
        req.raw_input_contents.extend(buffers)
    for _ in range(draw(st.integers(0, 4))):
        out = req.outputs.add(
            name=draw(st.one_of(st.sampled_from(["logits", "probabilities", "label"]), small_text))
        )
        set_params(out.parameters, draw(param_maps))
    return req


@st.composite
def baseline_oip_requests(draw: st.DrawFn) -> Any:
    """A good request with one or two aspects made hostile, so the deep checks get reached."""
    req = good_oip_request()
    rows = draw(st.integers(1, 40))
    req.inputs[0].shape[:] = [rows, 64]
    req.raw_input_contents[0] = struct.pack("<f", draw(pixel_values)) * (rows * 64)
    hostile = draw(oip_infer_requests())
    for aspect in draw(
        st.lists(
            st.sampled_from(
                ["name", "version", "id", "params", "inputs", "outputs", "shape", "datatype", "raw"]
            ),
            min_size=1,
            max_size=2,
        )
    ):
        if aspect == "name":
            req.model_name = hostile.model_name
        elif aspect == "version":
            req.model_version = hostile.model_version
        elif aspect == "id":
            req.id = hostile.id
        elif aspect == "params":
            req.parameters.MergeFrom(hostile.parameters)
        elif aspect == "inputs":
            req.inputs.MergeFrom(hostile.inputs)
        elif aspect == "outputs":
            req.outputs.MergeFrom(hostile.outputs)
        elif aspect == "shape":
            req.inputs[0].shape[:] = draw(shapes)
            req.raw_input_contents[0] = draw(raw_buffer(list(req.inputs[0].shape), "FP32"))
        elif aspect == "datatype":
            req.inputs[0].datatype = draw(datatypes)
        else:
            req.raw_input_contents[0] = draw(raw_buffer(list(req.inputs[0].shape), "FP32"))
    return req


oip_requests = st.one_of(baseline_oip_requests(), oip_infer_requests())


PNG_MAGIC, JPEG_MAGIC = b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff"


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@st.composite
def png_images(draw: st.DrawFn) -> bytes:
    """PNGs with checksummed chunks: honest, huge-claiming, truncated or with junk pixel data."""
    width = draw(st.one_of(st.integers(1, 32), st.sampled_from([0, 4097, 2**16, 2**31 - 1, 2**32 - 1])))
    height = draw(st.one_of(st.integers(1, 32), st.sampled_from([0, 4097, 2**16, 2**31 - 1, 2**32 - 1])))
    depth, color = draw(st.sampled_from([(8, 0), (8, 2), (8, 6), (1, 0), (16, 2), (8, 3), (7, 9)]))
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0))
    if draw(st.booleans()) and width * height <= 1024:
        row = b"\x00" + bytes(draw(st.integers(0, 255)) for _ in range(width * 4))
        pixels = zlib.compress(row * height)
    else:
        pixels = draw(st.one_of(st.binary(max_size=64), st.binary(max_size=64).map(zlib.compress)))
    image = PNG_MAGIC + ihdr + png_chunk(b"IDAT", pixels) + png_chunk(b"IEND", b"")
    cut = draw(st.one_of(st.just(len(image)), st.integers(0, len(image))))
    return image[:cut]


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=24,
)
pixel_documents = st.one_of(
    st.just(GOOD_PIXELS),
    st.lists(pixel_values, min_size=64, max_size=64),
    st.lists(st.lists(st.floats(0, 16), min_size=8, max_size=8), min_size=8, max_size=8),
    st.lists(st.floats(0, 16), max_size=80),
    st.lists(
        st.one_of(st.floats(0, 16), st.booleans(), st.text(max_size=3), st.none()), min_size=64, max_size=64
    ),
    st.builds(lambda d: {"data": d}, st.lists(st.floats(0, 16), min_size=64, max_size=64)),
    json_values,
)
# Nested past Python's recursion limit: [[[...]]] or {"a":{"a":...}}.
deep_json = st.integers(900, 20000).flatmap(
    lambda n: st.sampled_from([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n])
)
model_inputs = mostly(
    st.one_of(
        pixel_documents.map(lambda doc: json.dumps(doc).encode()),
        st.binary(max_size=256),
        png_images(),
        st.binary(max_size=64).map(lambda b: JPEG_MAGIC + b),
        st.sampled_from(
            [
                b"",
                b" ",
                b"[" + b"NaN," * 63 + b"NaN]",
                b"1e999",
                b"[" + b"9" * 5000 + b"]",
                b"\xff\xfe",
                b"null",
            ]
        ),
    ),
    deep_json,
)


@st.composite
def ts_requests(draw: st.DrawFn) -> Any:
    req = stubs().ts.PredictionsRequest(model_name=draw(model_names), model_version=draw(versions))
    keys = draw(
        st.lists(st.one_of(st.sampled_from(["data", "body", "tensors"]), small_text), max_size=4, unique=True)
    )
    for key in keys:
        req.input[key] = draw(model_inputs)
    if draw(st.booleans()):
        req.sequence_id = draw(small_text)
    return req


# gRPC refuses reserved and malformed metadata client-side; what is legal is fair game.
metadata_keys = st.from_regex(r"\A[a-z0-9][a-z0-9_.-]{0,24}\Z").filter(
    lambda k: not k.startswith("grpc-") and k not in {"content-type", "te", "user-agent", "host"}
)
metadata_values = mostly(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=64),
    st.integers(8000, 20000).map(lambda n: "v" * n),  # past grpc's metadata limits
)
metadata = st.lists(
    st.one_of(
        st.tuples(metadata_keys.filter(lambda k: not k.endswith("-bin")), metadata_values),
        st.tuples(metadata_keys.map(lambda k: k + "-bin"), st.binary(max_size=64)),
    ),
    max_size=6,
)


# -- HTTP plumbing and strategies ----------------------------------------------------------------
@dataclass(frozen=True)
class HttpAnswer:
    """Status, headers (names lower-cased) and body of one HTTP answer."""

    status: int
    headers: dict[str, str]
    body: bytes
    elapsed: float


def http_request(
    method: str | bytes,
    target: str | bytes,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    body: bytes = b"",
    chunks: Sequence[bytes] | None = None,
    declared_length: bytes | None = None,
) -> bytes:
    """An HTTP/1.1 request, byte for byte (nothing normalises the target or the headers)."""
    as_bytes = [x.encode() if isinstance(x, str) else x for x in (method, target)]
    lines = [as_bytes[0] + b" " + as_bytes[1] + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    if chunks is not None:
        lines.append(b"Transfer-Encoding: chunked")
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"
    else:
        lines.append(b"Content-Length: " + (declared_length or str(len(body)).encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def http_exchange(port: int, raw: bytes) -> HttpAnswer | None:
    """Send one request on a fresh connection, read to EOF; None when no answer came back."""
    t0 = time.monotonic()
    received: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=CALL_TIMEOUT_S) as sock:
        with contextlib.suppress(OSError):  # the server may answer (413) and close before reading it all
            sock.sendall(raw)
        try:
            while data := sock.recv(65536):
                received.append(data)
        except (TimeoutError, ConnectionResetError):
            pass
    head, sep, body = b"".join(received).partition(b"\r\n\r\n")
    status_line, *header_lines = head.split(b"\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3})", status_line)
    if not sep or match is None:
        return None
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return HttpAnswer(int(match.group(1)), headers, body, time.monotonic() - t0)


@dataclass(frozen=True)
class HttpCase:
    """One fuzzed HTTP request; `wire()` is what goes on the socket."""

    port: str  # inference | management
    method: bytes
    target: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    chunks: tuple[bytes, ...] | None = None
    declared_length: bytes | None = None

    def wire(self) -> bytes:
        return http_request(
            self.method,
            self.target,
            headers=self.headers,
            body=self.body,
            chunks=self.chunks,
            declared_length=self.declared_length,
        )


METHODS_HTTP = (b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS", b"TRACE")
odd_methods = st.from_regex(rb"\A[A-Z]{1,10}\Z")
SEGMENTS = (MODEL, MODEL, VERSION, "all", "..", ".", "%00", "%2e%2e", "%2F", "%2f..%2f", "", "~", "%ff", "%",
            "%zz", "a%00b", "set-default", "infer", "ready", "versions", "%C3%A9", "..%2F..%2Fetc%2Fpasswd",
            ";", "%3F", "%23", "%20", "*", "%5c..%5c")  # fmt: skip
segments = st.one_of(
    st.sampled_from(SEGMENTS),
    st.text(max_size=24).map(lambda s: quote(s, safe="")),
    st.integers(200, 20000).map(lambda n: "a" * n),
)
# Raw: non-ASCII, spaces and controls go out as they are, for the HTTP parser to refuse.
odd_segments = st.one_of(st.text(max_size=12), st.sampled_from(["\u00e9", "\\", "a b", "\x7f"]))
PAGES = ("/predictions/{a}", "/predictions/{a}", "/predictions/{a}/{b}", "/v2/models/{a}/infer",
         "/v2/models/{a}/infer", "/v2/models/{a}/versions/{b}/infer", "/ping", "/healthz", "/readyz", "/v2",
         "/v2/health/live", "/v2/health/ready", "/v2/models/{a}", "/v2/models/{a}/ready",
         "/v2/models/{a}/versions/{b}", "/v2/models/{a}/versions/{b}/ready", "//predictions//{a}",
         "/predictions/{a}/")  # fmt: skip
MANAGEMENT_PAGES = ("/models", "/models", "/models/{a}", "/models/{a}/{b}", "/models/{a}/{b}/set-default",
                    "/models/{a}/")  # fmt: skip
ANY_PAGES = ("/metrics", "/{a}", "/{a}/{b}/{c}")
ODD_TARGETS = ("*", "http://127.0.0.1/ping", "{a}", "")
QUERY_KEYS = ("limit", "next_page_token", "url", "model_name", "min_worker", "max_worker", "batch_size",
              "synchronous", "")  # fmt: skip
query_values = st.one_of(
    st.sampled_from(["-1", "0", "999999999999", "true", f"{MODEL}.mar", "x"]), st.text(max_size=12)
)
queries = st.one_of(
    st.just(""),
    st.lists(
        st.tuples(st.one_of(st.sampled_from(QUERY_KEYS), st.text(max_size=8)), query_values), max_size=4
    ).map(lambda kv: "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in kv)),
    st.sampled_from(["?", "?&&==", "?%zz", "?a=%00", "?" + "x=1&" * 200]),
)


def natural_method(template: str) -> bytes:
    if "predictions" in template or template.endswith("infer"):
        return b"POST"
    return b"PUT" if template.endswith("set-default") else b"GET"


@st.composite
def targets(draw: st.DrawFn, port: str, odd: bool) -> tuple[bytes, bytes]:
    """(the method the route takes, the request target)."""
    pages = (PAGES if port == "inference" else MANAGEMENT_PAGES) + ANY_PAGES
    template = draw(st.sampled_from(pages + (ODD_TARGETS if odd else ())))
    parts = st.one_of(segments, odd_segments) if odd else segments
    path = template.format(
        a=draw(st.one_of(st.just(MODEL), parts)), b=draw(st.one_of(st.just(VERSION), parts)), c=draw(parts)
    )
    return natural_method(template), (path + draw(queries)).encode("utf-8")


CONTENT_TYPES = ("application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                 "text/plain; charset=latin-1", "application/octet-stream", "multipart/form-data",
                 "multipart/form-data; boundary=", 'multipart/form-data; boundary="b"',
                 "application/x-www-form-urlencoded", "image/png", "", "*/*", ";;;", "text/")  # fmt: skip
HEADER_NAMES = ("content-type", "content-encoding", "inference-header-content-length", "authorization",
                "x-request-id", "accept", "accept-encoding", "user-agent", "x-forwarded-for", "cookie",
                "range", "if-none-match", "origin")  # fmt: skip
header_names = st.one_of(
    st.sampled_from(HEADER_NAMES).map(str.encode), st.from_regex(rb"\A[!#$%&'*+.^_`|~0-9A-Za-z-]{1,40}\Z")
)
odd_header_names = st.sampled_from([b"bad name", b"x:y", b"\xc3\xa9", b""])  # not tokens
HEADER_VALUES = (b"application/json", b"gzip", b"deflate", b"br", b"identity", b"-1", b"0", b"99999999999",
                 b"Bearer x", b"bearer", b"", b"\xff\xfe", b" \t ", b"chunked", b"\xb2",
                 b"1\xb3")  # fmt: skip
header_values = st.one_of(
    st.sampled_from(HEADER_VALUES),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200).map(str.encode),
)
odd_header_values = st.binary(max_size=200).map(lambda b: bytes(c for c in b if c not in b"\r\n\x00"))
FRAMING = {b"content-length", b"transfer-encoding", b"host", b"connection", b"expect", b"upgrade"}


@st.composite
def multipart_bodies(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    boundary = draw(st.one_of(st.just("b0undary"), st.from_regex(r"\A[A-Za-z0-9'()+_,-./:=?]{1,70}\Z")))
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        name = draw(st.one_of(st.just("data"), st.just("body"), small_text))
        head = f'Content-Disposition: form-data; name="{name}"'.encode()
        if draw(st.booleans()):
            head = draw(st.sampled_from([b"", b"Content-Disposition: form-data", b"X: y"]))
        if draw(st.booleans()):
            head += b"\r\nContent-Type: " + draw(st.sampled_from(CONTENT_TYPES)).encode()
        parts.append(b"--" + boundary.encode() + b"\r\n" + head + b"\r\n\r\n" + draw(model_inputs) + b"\r\n")
    closing = draw(st.sampled_from([b"--" + boundary.encode() + b"--\r\n", b"", b"--" + boundary.encode()]))
    ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}", "multipart/form-data"]))
    return b"".join(parts) + closing, [(b"content-type", ctype.encode())]


@st.composite
def oip_json_bodies(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """REST infer documents: good ones with a hostile aspect, plus binary-extension framing."""
    json_ints = st.one_of(dims, st.integers(), st.sampled_from([10**30, -(10**30)]))
    shape = draw(
        st.one_of(
            st.just([1, 64]),
            st.lists(st.one_of(json_ints, st.floats(), st.text(max_size=3), st.booleans()), max_size=9),
        )
    )
    tensor: dict[str, Any] = {
        "name": draw(st.one_of(st.just("pixels"), small_text)),
        "datatype": draw(datatypes),
        "shape": shape,
    }
    binary = b""
    if draw(st.booleans()):
        tensor["data"] = draw(
            st.one_of(pixel_documents, st.lists(st.floats(0, 16), min_size=64, max_size=64))
        )
    else:
        binary = draw(st.one_of(st.just(struct.pack("<64f", *GOOD_PIXELS)), st.binary(max_size=300)))
        size = draw(
            st.one_of(st.just(len(binary)), st.integers(-5, 400), st.sampled_from([True, "1", 2**70]))
        )
        tensor["parameters"] = {"binary_data_size": size}
    if draw(st.booleans()):
        tensor.setdefault("parameters", {}).update(
            draw(st.dictionaries(st.text(max_size=20), json_values, max_size=3))
        )
    doc: dict[str, Any] = {
        "inputs": draw(
            st.one_of(
                st.just([tensor]),
                st.just([tensor, tensor]),
                st.lists(st.just(tensor), max_size=40),
                json_values,
            )
        )
    }
    for key, values in (
        ("id", st.one_of(st.text(max_size=8), json_values, repeated(250, 400))),
        ("parameters", json_values),
        (
            "outputs",
            st.lists(st.dictionaries(st.sampled_from(["name", "parameters"]), json_values), max_size=3),
        ),
    ):
        if draw(st.booleans()):
            doc[key] = draw(values)
    head = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json")]
    if binary or draw(st.booleans()):
        length = draw(
            st.one_of(
                st.just(str(len(head))),
                st.sampled_from(["-1", "x", "", str(len(head) + 9999)]),
                st.integers(0, len(head) + 400).map(str),
            )
        )
        headers.append((b"inference-header-content-length", length.encode()))
    return head + binary, headers


def with_encoding(
    inner: st.SearchStrategy[tuple[bytes, list[tuple[bytes, bytes]]]],
) -> st.SearchStrategy[Any]:
    @st.composite
    def encoded(draw: st.DrawFn) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        body, headers = draw(inner)
        encoding = draw(st.sampled_from([b"gzip", b"deflate", b"br", b"gzip, deflate"]))
        if encoding == b"gzip":
            body = gzip.compress(body)
        elif encoding == b"deflate":
            body = zlib.compress(body)
        cut = draw(st.one_of(st.just(len(body)), st.integers(0, len(body))))
        return body[:cut], [*headers, (b"content-encoding", encoding)]

    return encoded()


plain_bodies = st.one_of(
    st.just(b""),
    st.binary(max_size=512),
    model_inputs,
    json_values.map(lambda v: json.dumps(v).encode()),
    st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=70).map(
        lambda kv: "&".join(f"{quote(k)}={quote(v)}" for k, v in kv).encode()
    ),
).map(lambda b: (b, []))
bodies = st.one_of(
    plain_bodies,
    multipart_bodies(),
    oip_json_bodies(),
    with_encoding(st.one_of(oip_json_bodies(), plain_bodies)),
    st.integers(MAX_REQUEST_BYTES + 1, MAX_REQUEST_BYTES + 2048).map(
        lambda n: (b"[" + b"1," * (n // 2) + b"1]", [])
    ),
    st.integers(2**20, 2**20 + 4096).map(
        lambda n: (b"\x1f\x8b" + gzip.compress(b"0" * n)[2:], [(b"content-encoding", b"gzip")])
    ),
)


@st.composite
def http_cases(draw: st.DrawFn) -> HttpCase:
    # One request in 8 or so also feeds the HTTP parser what it must refuse before the app sees it.
    odd = all(draw(st.booleans()) for _ in range(3))

    def either(clean: st.SearchStrategy[Any], weird: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(clean, weird) if odd else clean

    port = draw(st.sampled_from(["inference", "inference", "management"]))
    natural, target = draw(targets(port, odd))
    method = draw(st.one_of(st.just(natural), either(st.sampled_from(METHODS_HTTP), odd_methods)))
    body, headers = draw(bodies)
    if draw(st.booleans()):
        headers = [
            (b"content-type", draw(st.one_of(st.sampled_from(CONTENT_TYPES).map(str.encode), header_values)))
        ]
    extra = draw(st.lists(st.tuples(either(header_names, odd_header_names),
                                    either(header_values, odd_header_values)), max_size=8))  # fmt: skip
    headers = [*headers, *((n, v) for n, v in extra if n.lower() not in FRAMING)]
    framing = draw(st.sampled_from(["length", "length", "length", "chunked", "declared_huge"]))
    chunks = declared = None
    if framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        chunks = tuple(body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True))
    elif framing == "declared_huge":  # only ever more than any limit: a body the server must not wait for
        declared = str(draw(st.integers(10**8, 10**12))).encode()
    return HttpCase(port, method, target, tuple(headers), body, chunks, declared)
