"""gRPC `InferTensorContents` decoded from its wire bytes, bounded by the tensor's checked header.

The OIP gRPC adapter parses requests with each input's `contents` kept opaque (see
`mariner.server.common.grpc_decoding.shallow_class`): letting protobuf materialise a repeated
field first cost 0.4 s of event loop for 8 million INT64 zeros, before a check could refuse
them. Here, after the header passed the model's signature, the contents' fields are walked (at
most one per expected element, plus a few), the field named by the datatype is taken and
decoded with numpy: FP32/FP64 straight from their little-endian bytes, integer varints through
protobuf on that field alone (at most ten bytes per expected element), BYTES as one bytes
object per element. Other typed fields are skipped unread, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from google.protobuf.message import DecodeError

from mariner.server.common.grpc_stubs import grpc_service_pb2 as pb
from mariner.server.contracts.tensors import CONTENTS_FIELD, bad, decode_values, element_count

_NUMBERS = {f.name: f.number for f in pb.InferTensorContents.DESCRIPTOR.fields}
# Float types: numpy dtype and the wire type of one unpacked element (fixed64 = 1, fixed32 = 5).
_FIXED = {"FP32": ("<f4", 5), "FP64": ("<f8", 1)}
_LENGTH_DELIMITED = 2
_MAX_VARINT_BYTES = 10
# Fields beyond one per expected element that a valid message may carry (other typed fields'
# packed chunks, a packed field split in several chunks).
_SPARE_FIELDS = 16


def _varint(buf: bytes, pos: int, tensor: str) -> tuple[int, int]:
    result = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise bad(f"input {tensor!r}: `contents` is not a valid InferTensorContents message")


def _fields(blob: bytes, number: int, limit: int, tensor: str) -> list[tuple[int, int, int, int]]:
    """(wire type, tag start, payload start, end) of each field `number`, walking at most `limit`."""
    found = []
    pos = seen = 0
    while pos < len(blob):
        seen += 1
        if seen > limit:
            raise bad(f"input {tensor!r}: `contents` holds more fields than its shape has elements")
        start = pos
        key, pos = _varint(blob, pos, tensor)
        wire = key & 7
        if wire == 0:
            payload = pos
            _, pos = _varint(blob, pos, tensor)
        elif wire in (1, 5):
            payload = pos
            pos += 8 if wire == 1 else 4
        elif wire == _LENGTH_DELIMITED:
            size, payload = _varint(blob, pos, tensor)
            pos = payload + size
        else:
            raise bad(f"input {tensor!r}: `contents` is not a valid InferTensorContents message")
        if pos > len(blob):
            raise bad(f"input {tensor!r}: `contents` is truncated")
        if key >> 3 == number:
            found.append((wire, start, payload, pos))
    return found


def decode_contents(name: str, datatype: str, dims: Sequence[int], blob: bytes) -> np.ndarray:
    """The typed values of a checked header's tensor, from the serialized `contents` message."""
    count = element_count(dims)
    field = CONTENTS_FIELD[datatype]
    chunks = _fields(blob, _NUMBERS[field], count + _SPARE_FIELDS, name)
    shape = list(dims)
    if datatype == "BYTES":
        if any(wire != _LENGTH_DELIMITED for wire, *_ in chunks):
            raise bad(f"input {name!r}: `contents.{field}` is not a valid bytes field")
        if len(chunks) != count:
            raise bad(f"tensor {name!r}: shape {shape} needs {count} values, received {len(chunks)}")
        out = np.empty(count, dtype=object)
        out[:] = [blob[p:end] for _, _, p, end in chunks]
        return out.reshape(dims)
    if datatype in _FIXED:
        dtype, unpacked = _FIXED[datatype]
        if any(wire not in (_LENGTH_DELIMITED, unpacked) for wire, *_ in chunks):
            raise bad(f"input {name!r}: `contents.{field}` has the wrong wire type")
        data = b"".join(blob[p:end] for _, _, p, end in chunks)
        itemsize = np.dtype(dtype).itemsize
        if len(data) != count * itemsize:
            raise bad(
                f"tensor {name!r}: shape {shape} needs {count} values, received {len(data) / itemsize:g}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(dims)
    if sum(end - p for _, _, p, end in chunks) > _MAX_VARINT_BYTES * count:
        raise bad(f"tensor {name!r}: `contents.{field}` holds more than the {count} values of shape {shape}")
    try:
        message = pb.InferTensorContents.FromString(b"".join(blob[s:e] for _, s, _, e in chunks))
    except DecodeError:
        raise bad(f"input {name!r}: `contents` is not a valid InferTensorContents message") from None
    return decode_values(name, datatype, dims, getattr(message, field), may_hold_bools=False)
