"""Open Inference Protocol tensors: datatypes, byte decoding and the model's declared signature.

Both OIP transports (gRPC `raw_input_contents`/`contents`, REST JSON `data` and the binary
extension) decode into numpy arrays here, so the checks (datatype known, shape x datatype x
byte length consistent, tensor matches the model's signature) and their messages are the same
whatever the wire. Tensors reach the handler as arrays, never as JSON text.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mariner.server.contracts.errors import Code, ServingError

try:  # bfloat16 for numpy; ships with onnx's dependencies
    from ml_dtypes import bfloat16 as _bf16
except ImportError:  # pragma: no cover
    _bf16 = None

DTYPES: dict[str, Any] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
if _bf16 is not None:
    DTYPES["BF16"] = np.dtype(_bf16)
_BY_DTYPE = {v: k for k, v in DTYPES.items() if k != "BYTES"}

MAX_DIMS = 8
MAX_ARRAY_ELEMENTS = 2**40  # far above any message size limit; below numpy's index range

# The OIP gRPC `InferTensorContents` field that carries each datatype's typed values (FP16, BF16
# have none: they travel only as raw bytes).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def bad(message: str) -> ServingError:
    return ServingError(Code.INVALID_ARGUMENT, message)


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output: -1 in `shape` is a variable dim (the batch dim first).

    `optional` inputs (Triton's `optional: true`) may be left out; a model that takes its data in
    one of several forms (encoded images as BYTES or a decoded FP32 tensor) declares each form
    optional, and a request must then carry at least one declared input.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def describe(self) -> str:
        return f"{self.name} {self.datatype}{list(self.shape)}" + (" (optional)" if self.optional else "")


@dataclass(frozen=True)
class ModelSignature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_config(cls, raw: Any) -> ModelSignature | None:
        """The model-config's `signature:` block, or None when the archive declares none."""
        if not raw:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError("model-config 'signature' must be a mapping with inputs and outputs")

        def specs(key: str) -> tuple[TensorSpec, ...]:
            out = []
            for item in raw.get(key) or []:
                datatype = str(item["datatype"]).upper()
                if datatype not in DTYPES:
                    raise ValueError(f"signature {key}: unknown datatype {datatype!r}")
                optional = item.get("optional", False)
                if not isinstance(optional, bool) or (optional and key != "inputs"):
                    raise ValueError(f"signature {key}: 'optional' is true or false, and only for inputs")
                out.append(
                    TensorSpec(str(item["name"]), datatype, tuple(int(d) for d in item["shape"]), optional)
                )
            return tuple(out)

        return cls(specs("inputs"), specs("outputs"))


def dtype_of(datatype: str, tensor: str) -> np.dtype:
    dt = DTYPES.get(datatype.upper())
    if dt is None:
        raise bad(f"tensor {tensor!r}: unknown datatype {datatype!r}; allowed: {', '.join(DTYPES)}")
    return dt


def datatype_of(arr: np.ndarray) -> str:
    if arr.dtype.kind in "OSU":
        return "BYTES"
    name = _BY_DTYPE.get(arr.dtype)
    if name is None:
        raise TypeError(f"no OIP datatype for numpy dtype {arr.dtype}")
    return name


def check_shape(shape: Sequence[int], tensor: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_DIMS or any(d < 0 for d in dims):
        raise bad(f"tensor {tensor!r}: shape {list(dims)} must have at most {MAX_DIMS} non-negative dims")
    # An empty tensor ([0, 2**62]) has no elements but no array can have such dims either.
    if element_count(max(d, 1) for d in dims) > MAX_ARRAY_ELEMENTS:
        raise bad(f"tensor {tensor!r}: shape {list(dims)} is larger than any array can be")
    return dims


def element_count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split_bytes(raw: bytes, count: int, tensor: str) -> np.ndarray:
    """BYTES wire format: each element is a 4-byte little-endian length, then that many bytes."""
    if count * 4 > len(raw):  # each element needs at least its length prefix: check before allocating
        raise bad(
            f"tensor {tensor!r}: {count} BYTES elements need at least {count * 4} bytes, received {len(raw)}"
        )
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(raw):
            raise bad(f"tensor {tensor!r}: BYTES data ends after {i} of {count} elements")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise bad(f"tensor {tensor!r}: BYTES element {i} claims {n} bytes, only {len(raw) - pos} remain")
        out[i] = raw[pos : pos + n]
        pos += n
    if pos != len(raw):
        raise bad(f"tensor {tensor!r}: {len(raw) - pos} bytes left over after {count} BYTES elements")
    return out


def decode_raw(name: str, datatype: str, shape: Sequence[int], raw: bytes) -> np.ndarray:
    """Raw little-endian bytes -> array of `shape`; the byte length must match exactly."""
    dims = check_shape(shape, name)
    dt = dtype_of(datatype, name)
    count = element_count(dims)
    if dt.kind == "O":
        return _split_bytes(raw, count, name).reshape(dims)
    expected = count * dt.itemsize
    if len(raw) != expected:
        raise bad(
            f"tensor {name!r}: shape {list(dims)} x {datatype} needs {expected} bytes, received {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dt.newbyteorder("<") if dt.itemsize > 1 else dt).reshape(dims)


def _holds_bool(values: Sequence[Any]) -> bool:
    stack: list[Any] = [values]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, bool):
            return True
    return False


def _as_array(values: Sequence[Any], dt: np.dtype) -> np.ndarray:
    """`values` as `dt` in one numpy call. A protobuf repeated field converts itself (`__array__`,
    typed) and numpy would then wrap an INT8 300 silently, so the range is checked on the array."""
    if isinstance(values, list):
        return np.asarray(values, dtype=dt)  # numpy refuses out-of-range Python ints itself
    src = np.asarray(values)
    if dt.kind in "iu" and src.dtype.kind in "iu" and src.size:
        info = np.iinfo(dt)
        low, high = src.min(), src.max()
        if low < info.min or high > info.max:
            raise OverflowError(f"{low if low < info.min else high} is out of range for {dt}")
    return src.astype(dt, copy=False)


def decode_values(
    name: str, datatype: str, shape: Sequence[int], values: Sequence[Any], *, may_hold_bools: bool = True
) -> np.ndarray:
    """Typed values (gRPC `contents`, REST JSON `data`, flattened row-major) -> array of `shape`.

    Numbers are converted by numpy in one call (`np.asarray(values, dtype)`), never one Python
    object per element; a flat list is counted before it is converted. `may_hold_bools=False`
    says the values cannot be booleans (a typed protobuf field, or JSON text without a `true` or
    `false` literal), which spares the walk that refuses JSON `true` as 1.0.
    """
    dims = check_shape(shape, name)
    dt = dtype_of(datatype, name)
    count = element_count(dims)
    nested = len(values) > 0 and isinstance(values[0], list)
    if not nested and len(values) != count:
        raise bad(f"tensor {name!r}: shape {list(dims)} needs {count} values, received {len(values)}")
    if dt.kind == "O":
        try:
            flat = np.asarray(values, dtype=object).reshape(-1)
        except ValueError as exc:
            raise bad(f"tensor {name!r}: values do not form shape {list(dims)}: {exc}") from None
        if flat.size != count:
            raise bad(f"tensor {name!r}: shape {list(dims)} needs {count} values, received {flat.size}")
        if not all(isinstance(v, (str, bytes)) for v in flat):  # bytes(10**10) would allocate 10 GB
            raise bad(f"tensor {name!r}: BYTES values must be strings")
        items = [v.encode() if isinstance(v, str) else v for v in flat]
        return np.array(items, dtype=object).reshape(dims)
    if may_hold_bools and dt.kind != "b" and _holds_bool(values):  # JSON true is not 1.0
        raise bad(f"tensor {name!r}: {datatype} values must be numbers, not booleans")
    try:
        arr = _as_array(values, dt)
    except (TypeError, ValueError, OverflowError) as exc:
        raise bad(f"tensor {name!r}: values are not valid {datatype}: {exc}") from None
    if arr.size != count:
        raise bad(f"tensor {name!r}: shape {list(dims)} needs {count} values, received {arr.size}")
    return arr.reshape(dims)


def encode_raw(arr: np.ndarray) -> bytes:
    if arr.dtype.kind in "OSU":
        parts = []
        for v in arr.reshape(-1):
            b = v.encode() if isinstance(v, str) else bytes(v)
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def shape_matches(declared: Sequence[int], dims: Sequence[int]) -> bool:
    """Same rank, and every declared dim other than -1 equal."""
    return len(declared) == len(dims) and all(
        want in (-1, got) for want, got in zip(declared, dims, strict=True)
    )


def check_against(spec: TensorSpec, datatype: str, dims: Sequence[int], max_rows: int | None) -> None:
    """One input's header (datatype, shape, rows) against its declared spec, before any of its
    elements is read, as Triton does: a wrong or oversized tensor costs no decoding."""
    name = spec.name
    if datatype.upper() != spec.datatype:
        raise bad(f"input {name!r}: expected datatype {spec.datatype}, received {datatype}")
    if not shape_matches(spec.shape, dims):
        raise bad(f"input {name!r}: expected shape {list(spec.shape)}, received {list(dims)}")
    if max_rows is not None and dims and dims[0] > max_rows:
        raise bad(
            f"input {name!r}: shape {list(dims)} has {dims[0]} rows; the model accepts at most "
            f"{max_rows} per request (its max batch size)"
        )


def match_signature(inputs: Mapping[str, tuple[str, np.ndarray]], signature: ModelSignature) -> int:
    """Check decoded inputs (name -> (datatype, array)) against the signature; return the row count."""
    declared = {s.name: s for s in signature.inputs}
    takes = ", ".join(s.describe() for s in signature.inputs)
    unknown = sorted(set(inputs) - set(declared))
    if unknown:
        raise bad(f"unknown input(s) {unknown}; the model takes: {takes}")
    missing = sorted({s.name for s in signature.inputs if not s.optional} - set(inputs))
    if missing:
        raise bad(f"missing input(s) {missing}; the model takes: {takes}")
    if not inputs:
        raise bad(f"the request has no inputs; the model takes at least one of: {takes}")
    rows: int | None = None
    for name, (datatype, arr) in inputs.items():
        check_against(declared[name], datatype, arr.shape, None)
        n = int(arr.shape[0]) if arr.shape else 1
        if rows is not None and n != rows:
            raise bad(f"inputs disagree on the batch dim: {name!r} has {n} rows, others {rows}")
        rows = n
    if not rows:
        raise bad("a request needs at least one row (batch dim >= 1)")
    return rows
