"""numpy <-> Open Inference Protocol tensors, for both client transports.

Both transports carry tensors as raw little-endian bytes (gRPC `raw_input_contents`, the REST
binary-tensor extension), the fast path tritonclient uses too, so encoding lives here once.
BYTES elements use the protocol's framing: a 4-byte little-endian length, then the bytes.
Kept independent of server/ so the client does not drag in the server's modules.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
try:  # bfloat16 has no numpy dtype of its own; ml_dtypes provides one where installed
    from ml_dtypes import bfloat16 as _bf16

    _DTYPES["BF16"] = np.dtype(_bf16)
except ImportError:  # pragma: no cover
    pass
_NAMES = {dt.newbyteorder("="): name for name, dt in _DTYPES.items()}


def datatype_of(arr: np.ndarray) -> str:
    """The OIP datatype name for an array's dtype (str/bytes/object arrays are BYTES)."""
    if arr.dtype.kind in "OSU":
        return "BYTES"
    name = _NAMES.get(arr.dtype.newbyteorder("="))
    if name is None:
        raise TypeError(f"no Open Inference Protocol datatype for numpy dtype {arr.dtype}")
    return name


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for an OIP datatype name; BYTES is object (elements are `bytes`)."""
    if datatype == "BYTES":
        return np.dtype(object)
    try:
        return _DTYPES[datatype]
    except KeyError:
        raise ValueError(f"unknown datatype {datatype!r}; known: {', '.join([*_DTYPES, 'BYTES'])}") from None


def as_input(name: str, value: Any) -> np.ndarray:
    """A caller's input as an array; refuses what has no OIP datatype before anything is sent."""
    arr = np.asarray(value)
    try:
        datatype_of(arr)
    except TypeError as exc:
        raise TypeError(f"input {name!r}: {exc}") from None
    return arr


def to_raw(arr: np.ndarray) -> bytes:
    """Row-major little-endian bytes of `arr` as the protocol carries them."""
    if datatype_of(arr) == "BYTES":
        parts = []
        for item in arr.reshape(-1):
            b = item if isinstance(item, bytes) else str(item).encode("utf-8")
            parts.append(struct.pack("<I", len(b)))
            parts.append(b)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _count(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def from_raw(raw: bytes, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
    """Bytes of one output tensor back into an array of `shape`; checks the length adds up."""
    dims = tuple(int(d) for d in shape)
    count = _count(dims)
    if datatype == "BYTES":
        out = np.empty(count, dtype=object)
        offset = 0
        for i in range(count):
            if offset + 4 > len(raw):
                raise ValueError(f"output {name!r}: BYTES data ends after {i} of {count} elements")
            (n,) = struct.unpack_from("<I", raw, offset)
            offset += 4
            out[i] = bytes(raw[offset : offset + n])
            offset += n
        return out.reshape(dims)
    dt = numpy_dtype(datatype)
    if len(raw) != count * dt.itemsize:
        raise ValueError(
            f"output {name!r}: {len(raw)} bytes for {datatype}{list(dims)}, expected {count * dt.itemsize}"
        )
    return np.frombuffer(raw, dtype=dt).reshape(dims).copy()


def from_list(data: Any, datatype: str, shape: Sequence[int], name: str) -> np.ndarray:
    """A JSON `data` list (flat or nested, as REST answers without binary data) as an array."""
    dims = tuple(int(d) for d in shape)
    if datatype == "BYTES":
        flat = np.array(
            [d.encode("utf-8") if isinstance(d, str) else d for d in np.asarray(data, dtype=object).ravel()],
            dtype=object,
        )
    else:
        flat = np.asarray(data, dtype=numpy_dtype(datatype)).ravel()
    if flat.size != _count(dims):
        raise ValueError(f"output {name!r}: {flat.size} values for shape {list(dims)}")
    return flat.reshape(dims)


def to_list(arr: np.ndarray) -> list[Any]:
    """Flat JSON-able values of `arr` (BYTES as UTF-8 text) for the REST JSON form."""
    if datatype_of(arr) == "BYTES":
        return [
            (v.decode("utf-8") if isinstance(v, bytes) else str(v)) for v in np.asarray(arr, object).ravel()
        ]
    return arr.ravel().tolist()


def shapes(arrays: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in arrays.items()}
