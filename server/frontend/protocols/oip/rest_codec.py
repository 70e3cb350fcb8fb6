"""The Open Inference Protocol's REST wire: a request body decoded into checked tensors (JSON
`data` or Triton's binary tensor data extension, gzip/deflate bodies inflated) and an answer's
outputs encoded (JSON, or JSON and binary parts). The shapes are `http`'s module docstring's;
the routes and the call are `http`'s, and the fast path's (`frontend.protocols.prediction_routes`).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from mariner.server.common import json_body
from mariner.server.common import oip_codec as oip
from mariner.server.common.http_common import BodyTooLarge, compact_json
from mariner.server.contracts.tensors import ModelSignature, bad, decode_raw, decode_values, encode_raw

HEADER_LENGTH = "inference-header-content-length"


# -- request decoding -------------------------------------------------------------------------
def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """A gzip/deflate request body, inflated to at most `limit` bytes (a zip bomb is a 413)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise bad(f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise bad(f"request body is not valid {encoding} data: {exc}") from None
    if len(out) > limit:
        raise BodyTooLarge(limit)
    if not inflater.eof:
        raise bad(f"request body is truncated {encoding} data")
    return out


def header_length(value: str | None, size: int) -> int | None:
    if value is None:
        return None
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > size:
        raise bad(
            f"Inference-Header-Content-Length must be a byte count within the {size}-byte body, got {value!r}"
        )
    return int(value)


def _check_json_values(name: str, datatype: str, data: Any) -> None:
    """JSON BYTES elements must be strings: anything else would become bytes(int) garbage."""
    if datatype != "BYTES":
        return
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, str):
            raise bad(f"input {name!r}: BYTES data in JSON must be strings, got {type(item).__name__}")


def _object(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad(f"{what} must be a JSON object")
    return value


class ParsedInfer:
    """A decoded REST infer request: tensors, requested outputs and their binary choices.

    Each input's header (datatype, shape, rows, element count) is checked against `sig` before
    its `data` or binary part is converted; conversion is numpy's, one call per tensor.
    """

    def __init__(
        self, body: bytes, header_length: int | None, max_elements: int, sig: ModelSignature, max_rows: int
    ) -> None:
        split = len(body) if header_length is None else header_length
        head = body[:split]
        # No `true`/`false` literal in the JSON text: no value can be a boolean, so the walk that
        # refuses JSON true as 1.0 is skipped (a C-speed byte search instead of one per element).
        self._may_hold_bools = b"true" in head or b"false" in head
        self._sig, self._max_rows = sig, max_rows
        try:
            doc = json_body.loads(head)
        except ValueError as exc:
            raise bad(f"inference request is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad("inference request is JSON nested too deeply") from None
        doc = _object(doc, "the inference request")
        client_id = doc.get("id", "")
        if not isinstance(client_id, str):
            raise bad("request 'id' must be a string")
        self.client_id = client_id
        self.params = _object(doc.get("parameters"), "request 'parameters'")
        self.binary_default = self.params.get("binary_data_output") is True
        self.inputs = self._inputs(doc.get("inputs"), memoryview(body)[split:], max_elements)
        self.requested: list[str] = []
        self.binary: dict[str, bool] = {}
        outputs = doc.get("outputs") or []
        if not isinstance(outputs, list):
            raise bad("request 'outputs' must be a list")
        for out in outputs:
            out = _object(out, "each requested output")
            name = out.get("name")
            if not isinstance(name, str) or not name:
                raise bad("each requested output needs a 'name'")
            params = _object(out.get("parameters"), f"output {name!r} 'parameters'")
            oip.check_tensor_params("output", name, params)
            self.requested.append(name)
            if "binary_data" in params:
                self.binary[name] = params["binary_data"] is True

    def _inputs(
        self, raw_inputs: Any, binary: memoryview, max_elements: int
    ) -> dict[str, tuple[str, np.ndarray]]:
        if not isinstance(raw_inputs, list) or not raw_inputs:
            raise bad("request 'inputs' must be a non-empty list of tensors")
        decoded: dict[str, tuple[str, np.ndarray]] = {}
        pos = 0
        for entry in raw_inputs:
            entry = _object(entry, "each input")
            name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
            if not isinstance(name, str) or not name:
                raise bad("each input needs a 'name'")
            if name in decoded:
                raise bad(f"input {name!r} is given more than once")
            if not isinstance(datatype, str):
                raise bad(f"input {name!r} needs a 'datatype' string")
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape
            ):
                raise bad(f"input {name!r} needs a 'shape' list of integers")
            datatype = datatype.upper()
            dims = oip.check_header(name, datatype, shape, max_elements)
            params = _object(entry.get("parameters"), f"input {name!r} 'parameters'")
            oip.check_tensor_params("input", name, params)
            oip.check_input(self._sig, self._max_rows, name, datatype, dims)
            size = params.get("binary_data_size")
            if size is not None:
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise bad(f"input {name!r}: binary_data_size must be a non-negative integer")
                if pos + size > len(binary):
                    raise bad(
                        f"input {name!r}: binary_data_size {size} runs past the body "
                        f"({len(binary) - pos} binary bytes left)"
                    )
                chunk = binary[pos : pos + size]
                pos += size
                raw = bytes(chunk) if datatype == "BYTES" else chunk
                # A memoryview only for fixed-size types, which decode_raw's np.frombuffer reads as is.
                decoded[name] = (datatype, decode_raw(name, datatype, dims, raw))  # type: ignore[arg-type]
                continue
            if "data" not in entry:
                raise bad(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
            data = entry["data"]
            if not isinstance(data, list):
                data = [data]
            _check_json_values(name, datatype, data)
            decoded[name] = (
                datatype,
                decode_values(name, datatype, dims, data, may_hold_bools=self._may_hold_bools),
            )
        if pos != len(binary):
            raise bad(
                f"{len(binary) - pos} bytes of binary data follow the JSON that no input's "
                "binary_data_size accounts for"
            )
        return decoded


# -- response encoding ------------------------------------------------------------------------
def _json_data(arr: np.ndarray) -> list[Any] | None:
    """Flat row-major JSON values, or None when they cannot be JSON (non-UTF-8 BYTES)."""
    flat = arr.reshape(-1)
    if flat.dtype.kind in "OSU":
        try:
            return [v if isinstance(v, str) else bytes(v).decode("utf-8") for v in flat]
        except UnicodeDecodeError:
            return None
    return flat.tolist()  # FP16 and BF16 included: numpy gives Python floats


def encode_response(
    outputs: list[oip.OutputTensor], parsed: ParsedInfer, header: dict[str, Any]
) -> tuple[bytes, int | None]:
    """JSON response body plus binary parts; returns (body, JSON length or None if no binary)."""
    entries: list[dict[str, Any]] = []
    parts: list[bytes] = []
    for out in outputs:
        entry: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.array.shape)}
        want_binary = parsed.binary.get(out.name, parsed.binary_default)
        data = None if want_binary else _json_data(out.array)
        if data is None:
            raw = encode_raw(out.array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            parts.append(raw)
        else:
            entry["data"] = data
        entries.append(entry)
    head = compact_json({**header, "outputs": entries})
    if not parts:
        return head, None
    return b"".join([head, *parts]), len(head)
