"""`mariner predict MODEL FILE` and `mariner infer MODEL FILE`: ask a running server from a shell.

predict  sends FILE through the TorchServe API: a JSON file as JSON, anything else (a PNG or
         JPEG) as raw bytes, which is what the handler sniffs; prints the handler's answer.
infer    sends FILE through the Open Inference Protocol: JSON pixel rows (`[[...], ...]`, one row
         `[...]`, or `{"input name": rows}`), cast to the datatype the model declares (read from
         its metadata, so a user need not know it); prints each output as JSON.

HTTP by default (`--url`, default http://127.0.0.1:8080); `--grpc HOST:PORT` uses gRPC instead.
Exit status: 0 answered, 1 the server (or the network) said no, 2 bad usage or unreadable file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mariner.client import tensors
from mariner.client.errors import MarinerError
from mariner.client.grpc_client import GrpcClient
from mariner.client.http_client import HttpClient
from mariner.client.types import DEFAULT_HTTP_URL, DEFAULT_TIMEOUT_S

Client = GrpcClient | HttpClient


class UsageError(Exception):
    """The user's input cannot be sent (unreadable file, wrong JSON shape): exit 2."""


def _parser(command: str) -> argparse.ArgumentParser:
    what = {
        "predict": "send FILE (JSON, or PNG/JPEG bytes) to MODEL through the TorchServe API",
        "infer": "send FILE (JSON pixel rows) to MODEL through the Open Inference Protocol",
    }[command]
    p = argparse.ArgumentParser(prog=f"mariner {command}", description=what)
    p.add_argument("model", help="model name, e.g. digits_torchscript")
    p.add_argument("file", type=Path, help="input file")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help=f"HTTP inference URL (default {DEFAULT_HTTP_URL})")
    where.add_argument("--grpc", metavar="HOST:PORT", default=None, help="use gRPC at this address instead")
    p.add_argument("--version", default=None, help="model version (default: the default version)")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the call, retries included"
    )
    if command == "infer":
        p.add_argument(
            "--output", action="append", default=None, help="only this output (repeatable; default all)"
        )
    return p


def _client(args: argparse.Namespace) -> Client:
    if args.grpc:
        return GrpcClient(args.grpc, timeout_s=args.timeout)
    return HttpClient(args.url or DEFAULT_HTTP_URL, timeout_s=args.timeout)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None


def predict_payload(path: Path) -> Any:
    """A .json file (or bytes that parse as JSON) is sent as JSON; anything else as raw bytes."""
    raw = _read(path)
    try:
        return json.loads(raw)
    except ValueError:
        if path.suffix.lower() == ".json":
            raise UsageError(f"{path} is not valid JSON") from None
        return raw


def _format_answer(body: bytes) -> str:
    try:
        return json.dumps(json.loads(body), indent=2)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def infer_inputs(path: Path, signature: dict[str, Any]) -> dict[str, np.ndarray]:
    """The file's rows as arrays of each input's declared datatype, batch dim added if missing."""
    try:
        doc = json.loads(_read(path))
    except ValueError:
        raise UsageError(f"{path} is not valid JSON") from None
    specs = {s["name"]: s for s in signature.get("inputs", [])}
    if isinstance(doc, dict):
        unknown = sorted(set(doc) - set(specs))
        if unknown:
            raise UsageError(f"{path}: unknown input(s) {unknown}; the model takes {sorted(specs)}")
        named = doc
    elif len(specs) == 1:
        named = {next(iter(specs)): doc}
    else:
        raise UsageError(
            f"{path} is a bare list but the model takes {len(specs)} inputs {sorted(specs)}: "
            'write {"input name": rows, ...}'
        )
    arrays: dict[str, np.ndarray] = {}
    for name, value in named.items():
        spec = specs[name]
        try:
            arr = np.asarray(value, dtype=tensors.numpy_dtype(spec["datatype"]))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{path}: input {name!r} is not a {spec['datatype']} array: {exc}") from None
        if arr.ndim == len(spec["shape"]) - 1:  # one row: add the batch dimension
            arr = arr[np.newaxis, ...]
        arrays[name] = arr
    return arrays


def _json_values(arr: np.ndarray) -> Any:
    """Nested lists for JSON; FP32/FP16 as their shortest round-trip text, not float64 noise."""
    if arr.dtype == object:
        return np.asarray(tensors.to_list(arr), dtype=object).reshape(arr.shape).tolist()
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 8:
        # astype(str) prints each value at its own precision; float() of that is exact in JSON.
        return (
            np.asarray([float(v) for v in arr.astype(str).ravel()], dtype=object).reshape(arr.shape).tolist()
        )
    return arr.tolist()


def _format_outputs(outputs: dict[str, np.ndarray]) -> str:
    """One output per line, the whole still one JSON object, so both people and `jq` can read it."""
    lines = [f"  {json.dumps(name)}: {json.dumps(_json_values(arr))}" for name, arr in outputs.items()]
    return "{\n" + ",\n".join(lines) + "\n}"


def run(command: str, argv: Sequence[str]) -> int:
    args = _parser(command).parse_args(argv)
    try:
        with _client(args) as client:
            if command == "predict":
                answer = client.predict(args.model, predict_payload(args.file), version=args.version)
                print(_format_answer(answer.body))
            else:
                signature = client.metadata(args.model, version=args.version)
                inputs = infer_inputs(args.file, signature)
                outputs = client.infer(args.model, inputs, outputs=args.output, version=args.version)
                print(_format_outputs(outputs))
    except UsageError as exc:
        print(f"mariner {command}: {exc}", file=sys.stderr)
        return 2
    except MarinerError as exc:
        print(f"mariner {command}: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point used by `mariner.server.cli` for its `predict` and `infer` subcommands."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("predict", "infer"):
        print("usage: mariner {predict,infer} MODEL FILE [--url URL | --grpc HOST:PORT]", file=sys.stderr)
        return 2
    return run(args[0], args[1:])


if __name__ == "__main__":
    sys.exit(main())
