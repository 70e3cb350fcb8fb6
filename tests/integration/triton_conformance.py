"""tritonclient against a live Mariner: the Open Inference Protocol as Triton users speak it.

Runs under `.venv-triton/bin/python` (made by scripts/ensure_triton_venv.sh), never under the
project's venv: tritonclient 2.x needs protobuf < 7 and its generated `inference` stubs clash
with ours in one process. tests/integration/test_tritonclient.py starts the server, writes the
rows and the eager model's logits to an .npz, runs this script in a subprocess and asserts on
the JSON report it prints (one entry per check, so a failure names the check and the detail).

Every client uses tritonclient's DEFAULT options, as a user's code would: binary tensors on the
HTTP client, raw contents on gRPC. Nothing here imports the project: `CHECKS` is importable
without tritonclient so the test can tell a missing check from a failed one.

Usage: triton_conformance.py --grpc HOST:PORT --http HOST:PORT --grpc-management HOST:PORT
    --http-management HOST:PORT --model NAME --data FILE.npz (model management on)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CHECKS: tuple[str, ...] = (
    "grpc.server_live",
    "grpc.server_ready",
    "grpc.model_ready",
    "grpc.server_metadata",
    "grpc.model_metadata",
    "grpc.infer_fp32_rows",
    "grpc.infer_batch_one_request",
    "grpc.infer_requested_output",
    "grpc.async_infer_concurrent",
    "grpc.unknown_model_not_found",
    "grpc.wrong_shape_invalid_argument",
    "grpc.wrong_datatype_invalid_argument",
    "grpc.stream_infer",
    "grpc.stream_infer_error",
    "http.server_live",
    "http.server_ready",
    "http.model_ready",
    "http.server_metadata",
    "http.model_metadata",
    "http.infer_fp32_rows",
    "http.infer_batch_one_request",
    "http.infer_requested_output",
    "http.infer_json_tensors",
    "http.async_infer_concurrent",
    "http.unknown_model_not_found",
    "http.wrong_shape_invalid_argument",
    "http.wrong_datatype_invalid_argument",
    "grpc.model_config",
    "grpc.statistics",
    "grpc.repository_index",
    "grpc.unknown_model_config_error",
    "grpc.load_refused_on_inference_port",
    "grpc.load_unload_on_management_port",
    "http.model_config",
    "http.statistics",
    "http.repository_index",
    "http.unknown_model_config_error",
    "http.unknown_route_error",
    "http.load_refused_on_inference_port",
    "http.load_unload_on_management_port",
)
# A model of the store that the server does not load at start (load_model brings it in).
LOADABLE = "digits_onnx"

LOGIT_TOL = 1e-4
STREAM_TIMEOUT_S = 30.0
SIGNATURE = {
    "inputs": {"pixels": ("FP32", [-1, 64])},
    "outputs": {"logits": ("FP32", [-1, 10]), "probabilities": ("FP32", [-1, 10]), "label": ("INT64", [-1])},
}


class CheckFailed(AssertionError):
    """A conformance expectation that did not hold; its message is the report's detail."""


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


@dataclass
class Env:
    np: Any
    grpc: Any  # tritonclient.grpc module
    http: Any  # tritonclient.http module
    exc: type[Exception]  # tritonclient.utils.InferenceServerException
    gc: Any  # tritonclient.grpc.InferenceServerClient
    hc: Any  # tritonclient.http.InferenceServerClient
    hc_url: str
    model: str
    pixels: Any  # (N, 64) float32
    logits: Any  # (N, 10) float32, the eager model's
    gm: Any = None  # tritonclient.grpc client on the gRPC management port
    hm: Any = None  # tritonclient.http client on the HTTP management port


def _close(env: Env, got: Any, want: Any, what: str) -> None:
    np = env.np
    expect(got.shape == want.shape, f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size else 0.0
    expect(diff <= LOGIT_TOL, f"{what}: max |logit - eager| = {diff:.3g} > {LOGIT_TOL}")


def _inputs(env: Env, mod: Any, arr: Any, datatype: str = "FP32", name: str = "pixels") -> list[Any]:
    inp = mod.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)  # default options: binary data on for HTTP
    return [inp]


def _expect_error(
    env: Env, call: Callable[[], Any], grpc_status: str, http_status: str, transport: str
) -> str:
    """Run `call`; it must raise tritonclient's exception with the right status and a real message."""
    try:
        call()
    except env.exc as e:
        want = grpc_status if transport == "grpc" else http_status
        expect(e.status() == want, f"status {e.status()!r}, expected {want!r} (message: {e.message()})")
        msg = e.message() or ""
        expect(bool(msg.strip()), "error has no message")
        expect(
            "exception occurred in the client while decoding" not in msg,
            f"tritonclient could not read the error body (OIP wants {{'error': ...}}): {msg[:300]}",
        )
        return msg
    raise CheckFailed(f"no error raised; expected {grpc_status if transport == 'grpc' else http_status}")


def _check_signature(
    inputs: list[tuple[str, str, list[int]]], outputs: list[tuple[str, str, list[int]]]
) -> None:
    got_in = {n: (d, s) for n, d, s in inputs}
    got_out = {n: (d, s) for n, d, s in outputs}
    expect(got_in == SIGNATURE["inputs"], f"inputs {got_in}, expected {SIGNATURE['inputs']}")
    expect(got_out == SIGNATURE["outputs"], f"outputs {got_out}, expected {SIGNATURE['outputs']}")


# -- checks, one function each; the name in CHECKS is "<transport>.<function name>" -----------
def server_live(env: Env, t: str) -> None:
    expect((env.gc if t == "grpc" else env.hc).is_server_live() is True, "is_server_live() is not True")


def server_ready(env: Env, t: str) -> None:
    expect((env.gc if t == "grpc" else env.hc).is_server_ready() is True, "is_server_ready() is not True")


def model_ready(env: Env, t: str) -> None:
    c = env.gc if t == "grpc" else env.hc
    expect(c.is_model_ready(env.model) is True, f"is_model_ready({env.model!r}) is not True")
    try:  # an unknown model is simply not ready; gRPC may also answer NOT_FOUND
        unknown = c.is_model_ready("no_such_model")
    except env.exc as e:
        expect(t == "grpc" and e.status() == "StatusCode.NOT_FOUND", f"unknown model: {e.status()} {e}")
    else:
        expect(unknown is False, f"is_model_ready('no_such_model') is {unknown!r}")


def server_metadata(env: Env, t: str) -> None:
    if t == "grpc":
        m = env.gc.get_server_metadata()
        name, version, ext = m.name, m.version, list(m.extensions)
    else:
        m = env.hc.get_server_metadata()
        name, version, ext = m.get("name"), m.get("version"), m.get("extensions")
    expect(bool(name), f"server metadata has no name: {m}")
    expect(bool(version), f"server metadata has no version: {m}")
    expect(isinstance(ext, list), f"extensions is not a list: {ext!r}")
    for served in ("binary_tensor_data", "model_configuration", "statistics", "model_repository"):
        expect(served in ext, f"extensions {ext} do not list {served}")


def model_metadata(env: Env, t: str) -> None:
    if t == "grpc":
        m = env.gc.get_model_metadata(env.model)
        name = m.name
        ins = [(x.name, x.datatype, [int(d) for d in x.shape]) for x in m.inputs]
        outs = [(x.name, x.datatype, [int(d) for d in x.shape]) for x in m.outputs]
    else:
        m = env.hc.get_model_metadata(env.model)
        name = m.get("name")
        ins = [(x["name"], x["datatype"], [int(d) for d in x["shape"]]) for x in m.get("inputs", [])]
        outs = [(x["name"], x["datatype"], [int(d) for d in x["shape"]]) for x in m.get("outputs", [])]
    expect(name == env.model, f"metadata name {name!r}, expected {env.model!r}")
    _check_signature(ins, outs)
    versions = list(m.versions) if t == "grpc" else m.get("versions") or []
    for v in versions[:1]:  # an advertised version must be addressable
        c = env.gc if t == "grpc" else env.hc
        expect(c.is_model_ready(env.model, model_version=str(v)) is True, f"version {v!r} is not ready")
    try:
        (env.gc if t == "grpc" else env.hc).get_model_metadata("no_such_model")
    except env.exc as e:
        want = "StatusCode.NOT_FOUND" if t == "grpc" else "404"
        expect(e.status() == want, f"metadata of an unknown model: status {e.status()!r}, expected {want!r}")
    else:
        raise CheckFailed("metadata of an unknown model did not fail")


def infer_fp32_rows(env: Env, t: str) -> None:
    """One row per request, as most users call it; request id echoed."""
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    for i in range(min(4, len(env.pixels))):
        row = env.pixels[i : i + 1]
        result = c.infer(env.model, _inputs(env, mod, row), request_id=f"row-{i}")
        _close(env, result.as_numpy("logits"), env.logits[i : i + 1], f"row {i} logits")
        label = result.as_numpy("label")
        expect(label.dtype == env.np.int64, f"label dtype {label.dtype}, expected int64")
        expect(
            int(label[0]) == int(env.logits[i].argmax()),
            f"row {i}: label {label}, eager {env.logits[i].argmax()}",
        )
        response = result.get_response()
        rid = response.id if t == "grpc" else response.get("id")
        expect(rid == f"row-{i}", f"request id not echoed: {rid!r}")


def infer_batch_one_request(env: Env, t: str) -> None:
    """All rows in one [N, 64] request: rows come back together and in order."""
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    result = c.infer(env.model, _inputs(env, mod, env.pixels))
    _close(env, result.as_numpy("logits"), env.logits, "batch logits")
    probs = result.as_numpy("probabilities")
    expect(probs.shape == env.logits.shape, f"probabilities shape {list(probs.shape)}")
    expect(bool(env.np.allclose(probs.sum(axis=1), 1.0, atol=1e-5)), "probabilities rows do not sum to 1")
    labels = result.as_numpy("label")
    expect(
        labels.tolist() == env.logits.argmax(axis=1).tolist(),
        f"labels {labels.tolist()} differ from eager argmax",
    )


def infer_requested_output(env: Env, t: str) -> None:
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    result = c.infer(
        env.model, _inputs(env, mod, env.pixels[:3]), outputs=[mod.InferRequestedOutput("label")]
    )
    response = result.get_response()
    names = [o.name for o in response.outputs] if t == "grpc" else [o["name"] for o in response["outputs"]]
    expect(names == ["label"], f"asked for ['label'], got {names}")
    expect(result.as_numpy("label").tolist() == env.logits[:3].argmax(axis=1).tolist(), "labels differ")


def async_infer_concurrent(env: Env, t: str) -> None:
    """Several single-row requests in flight at once (the batcher may merge them): each its own answer."""
    n = min(8, len(env.pixels))
    if t == "grpc":
        results: dict[int, Any] = {}
        done = threading.Semaphore(0)

        def make_cb(i: int) -> Callable[[Any, Any], None]:
            def cb(result: Any, error: Any) -> None:
                results[i] = error if error is not None else result
                done.release()

            return cb

        for i in range(n):
            env.gc.async_infer(env.model, _inputs(env, env.grpc, env.pixels[i : i + 1]), make_cb(i))
        for _ in range(n):
            expect(done.acquire(timeout=STREAM_TIMEOUT_S), f"only {len(results)} of {n} async answers came")
    else:
        hc = env.http.InferenceServerClient(env.hc_url, concurrency=n)
        try:
            pending = [
                hc.async_infer(env.model, _inputs(env, env.http, env.pixels[i : i + 1])) for i in range(n)
            ]
            results = {}
            for i, p in enumerate(pending):
                try:
                    results[i] = p.get_result(timeout=STREAM_TIMEOUT_S)
                except env.exc as e:
                    results[i] = e
        finally:
            hc.close()
    for i in range(n):
        r = results[i]
        expect(not isinstance(r, Exception), f"async request {i}: {r}")
        _close(env, r.as_numpy("logits"), env.logits[i : i + 1], f"async row {i} logits")


def infer_json_tensors(env: Env, t: str) -> None:
    """HTTP with binary_data=False both ways: the plain-JSON tensor form of the protocol."""
    inp = env.http.InferInput("pixels", list(env.pixels[:2].shape), "FP32")
    inp.set_data_from_numpy(env.pixels[:2], binary_data=False)
    out = env.http.InferRequestedOutput("logits", binary_data=False)
    result = env.hc.infer(env.model, [inp], outputs=[out])
    expect("data" in result.get_response()["outputs"][0], "JSON output has no 'data'")
    _close(env, result.as_numpy("logits"), env.logits[:2], "JSON logits")


def unknown_model_not_found(env: Env, t: str) -> None:
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    msg = _expect_error(
        env,
        lambda: c.infer("no_such_model", _inputs(env, mod, env.pixels[:1])),
        "StatusCode.NOT_FOUND",
        "404",
        t,
    )
    expect("no_such_model" in msg, f"message does not name the model: {msg}")


def wrong_shape_invalid_argument(env: Env, t: str) -> None:
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    bad = env.np.zeros((2, 63), dtype=env.np.float32)
    msg = _expect_error(
        env, lambda: c.infer(env.model, _inputs(env, mod, bad)), "StatusCode.INVALID_ARGUMENT", "400", t
    )
    expect("pixels" in msg, f"message does not name the tensor: {msg}")


def wrong_datatype_invalid_argument(env: Env, t: str) -> None:
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)
    bad = env.pixels[:1].astype(env.np.float64)
    msg = _expect_error(
        env,
        lambda: c.infer(env.model, _inputs(env, mod, bad, "FP64")),
        "StatusCode.INVALID_ARGUMENT",
        "400",
        t,
    )
    expect("FP32" in msg, f"message does not say what is allowed: {msg}")


def _stream(env: Env, requests: list[tuple[str, Any, str]]) -> dict[str, tuple[Any, Any]]:
    """Send (model, array, id) over one stream; return id -> (result, error) once all answered."""
    answers: dict[str, tuple[Any, Any]] = {}
    done = threading.Event()
    lock = threading.Lock()
    errors_without_id: list[Any] = []

    def callback(result: Any, error: Any) -> None:
        with lock:
            if result is not None:
                answers[result.get_response().id] = (result, None)
            else:
                errors_without_id.append(error)  # stream errors carry no request id
            if len(answers) + len(errors_without_id) >= len(requests):
                done.set()

    env.gc.start_stream(callback=callback)
    try:
        for model, arr, rid in requests:
            env.gc.async_stream_infer(model, _inputs(env, env.grpc, arr), request_id=rid)
        expect(
            done.wait(STREAM_TIMEOUT_S),
            f"stream: {len(answers)} of {len(requests)} answers in {STREAM_TIMEOUT_S}s",
        )
    finally:
        env.gc.stop_stream()
    for i, err in enumerate(errors_without_id):
        answers[f"error-{i}"] = (None, err)
    return answers


def stream_infer(env: Env, t: str) -> None:
    n = min(6, len(env.pixels))
    reqs = [(env.model, env.pixels[i : i + 1], f"s{i}") for i in range(n)]
    reqs.append((env.model, env.pixels[:n], "s-batch"))
    answers = _stream(env, reqs)
    for i in range(n):
        result, error = answers.get(f"s{i}", (None, f"no answer for s{i}"))
        expect(error is None, f"s{i}: {error}")
        _close(env, result.as_numpy("logits"), env.logits[i : i + 1], f"stream s{i} logits")
    result, error = answers.get("s-batch", (None, "no answer for s-batch"))
    expect(error is None, f"s-batch: {error}")
    _close(env, result.as_numpy("logits"), env.logits[:n], "stream batch logits")


def stream_infer_error(env: Env, t: str) -> None:
    """A bad request on a stream is answered with an error message; the stream keeps serving."""
    answers = _stream(env, [("no_such_model", env.pixels[:1], "bad"), (env.model, env.pixels[:1], "good")])
    errors = [e for r, e in answers.values() if e is not None]
    expect(len(errors) == 1, f"expected one error, got {errors}")
    expect("no_such_model" in str(errors[0]), f"stream error does not name the model: {errors[0]}")
    result, error = answers.get("good", (None, "no answer for the good request"))
    expect(error is None, f"good request after a bad one failed: {error}")
    _close(env, result.as_numpy("logits"), env.logits[:1], "stream logits after an error")


# -- Triton's extensions: configuration, statistics, repository ------------------------------
def _as_dict(env: Env, t: str, message: Any) -> Any:
    if t == "http":
        return message
    from google.protobuf import json_format

    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def model_config(env: Env, t: str) -> None:
    c = env.gc if t == "grpc" else env.hc
    got = c.get_model_config(env.model)
    config = _as_dict(env, t, got.config if t == "grpc" else got)
    expect(config.get("name") == env.model, f"config names {config.get('name')!r}")
    inputs = {i["name"]: (i["data_type"], [int(d) for d in i["dims"]]) for i in config.get("input", [])}
    expect(inputs == {"pixels": ("TYPE_FP32", [64])}, f"config inputs {inputs}")
    outputs = {o["name"]: o["data_type"] for o in config.get("output", [])}
    expect(
        outputs == {"logits": "TYPE_FP32", "probabilities": "TYPE_FP32", "label": "TYPE_INT64"}, str(outputs)
    )
    expect(int(config.get("max_batch_size", 0)) > 1, f"max_batch_size {config.get('max_batch_size')}")


def statistics(env: Env, t: str) -> None:
    """Counts move by exactly what this check sends: 3 calls of 2 rows, 1 failed call."""
    mod, c = (env.grpc, env.gc) if t == "grpc" else (env.http, env.hc)

    def stats() -> dict[str, Any]:
        got = _as_dict(env, t, c.get_inference_statistics(env.model))
        entries = got.get("model_stats", [])
        expect(len(entries) == 1, f"{len(entries)} model_stats entries for one model")
        return entries[0]

    def num(entry: dict[str, Any], *path: str) -> int:
        for key in path:
            entry = entry.get(key, {}) if isinstance(entry, dict) else {}
        return int(entry or 0)

    before = stats()
    for _ in range(3):
        c.infer(env.model, _inputs(env, mod, env.pixels[:2]))
    with contextlib.suppress(env.exc):
        c.infer(env.model, _inputs(env, mod, env.np.zeros((1, 63), dtype=env.np.float32)))
    after = stats()
    expect(
        after["name"] == env.model and after.get("version"),
        f"entry {after.get('name')}/{after.get('version')}",
    )
    for phase, want in (("success", 3), ("fail", 1), ("queue", 3)):
        got = num(after, "inference_stats", phase, "count") - num(before, "inference_stats", phase, "count")
        expect(got == want, f"{phase}.count grew by {got}, expected {want}")
        ns = num(after, "inference_stats", phase, "ns") - num(before, "inference_stats", phase, "ns")
        expect(ns > 0, f"{phase}.ns grew by {ns}")
    items = num(after, "inference_count") - num(before, "inference_count")
    expect(items == 6, f"inference_count grew by {items}, expected 6 (3 calls x 2 rows)")
    runs = num(after, "execution_count") - num(before, "execution_count")
    expect(1 <= runs <= 3, f"execution_count grew by {runs}, expected 1..3 batches")
    computed = num(after, "inference_stats", "compute_infer", "count")
    expect(
        computed - num(before, "inference_stats", "compute_infer", "count") == runs,
        "compute_infer.count != batches",
    )
    expect(num(after, "last_inference") > 0, "last_inference is unset")


def _index(env: Env, t: str, c: Any) -> dict[str, str]:
    got = c.get_model_repository_index()
    entries = got if t == "http" else _as_dict(env, t, got).get("models", [])
    return {e["name"]: e.get("state", "") for e in entries}


def repository_index(env: Env, t: str) -> None:
    index = _index(env, t, env.gc if t == "grpc" else env.hc)
    expect(index.get(env.model) == "READY", f"index {index}")


def unknown_model_config_error(env: Env, t: str) -> None:
    c = env.gc if t == "grpc" else env.hc
    msg = _expect_error(env, lambda: c.get_model_config("no_such_model"), "StatusCode.NOT_FOUND", "404", t)
    expect("no_such_model" in msg, f"message does not name the model: {msg}")


def unknown_route_error(env: Env, t: str) -> None:
    """A /v2 route Mariner lacks (CUDA shared memory) is a 404 tritonclient can read."""
    msg = _expect_error(env, env.hc.get_cuda_shared_memory_status, "", "404", t)
    expect("/v2/cudasharedmemory" in msg, f"message does not name the path: {msg}")


def load_refused_on_inference_port(env: Env, t: str) -> None:
    c = env.gc if t == "grpc" else env.hc
    msg = _expect_error(env, lambda: c.load_model(LOADABLE), "StatusCode.PERMISSION_DENIED", "403", t)
    expect("management" in msg, f"message does not say where to load: {msg}")


def load_unload_on_management_port(env: Env, t: str) -> None:
    m = env.gm if t == "grpc" else env.hm
    expect(LOADABLE not in _index(env, t, m), f"{LOADABLE} is served before load_model")
    m.load_model(LOADABLE)
    expect(_index(env, t, m).get(LOADABLE) == "READY", f"after load_model: {_index(env, t, m)}")
    c, mod = (env.gc, env.grpc) if t == "grpc" else (env.hc, env.http)
    expect(c.is_model_ready(LOADABLE), f"{LOADABLE} is not ready on the inference port after load_model")
    out = c.infer(LOADABLE, _inputs(env, mod, env.pixels[:2])).as_numpy("logits")
    expect(out is not None and out.shape == (2, 10), f"logits of the loaded model: {out}")
    m.unload_model(LOADABLE)
    expect(LOADABLE not in _index(env, t, m), f"after unload_model: {_index(env, t, m)}")
    msg = _expect_error(env, lambda: m.unload_model(LOADABLE), "StatusCode.NOT_FOUND", "404", t)
    expect(LOADABLE in msg, f"unloading it twice: {msg}")


def run_checks(env: Env) -> list[dict[str, Any]]:
    report = []
    for name in CHECKS:
        transport, func = name.split(".", 1)
        try:
            globals()[func](env, transport)
        except CheckFailed as e:
            report.append({"check": name, "ok": False, "detail": str(e)})
        except Exception as e:  # an unexpected exception is a failure of that check, not of the run
            report.append({"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}"})
        else:
            report.append({"check": name, "ok": True, "detail": ""})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grpc", required=True, help="OIP gRPC address HOST:PORT")
    p.add_argument("--http", required=True, help="OIP HTTP address HOST:PORT (no scheme)")
    p.add_argument("--grpc-management", required=True, help="gRPC management address HOST:PORT")
    p.add_argument("--http-management", required=True, help="HTTP management address HOST:PORT")
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help=".npz with 'pixels' (N,64) float32 and 'logits' (N,10)")
    args = p.parse_args(argv)

    from importlib.metadata import version

    import numpy as np
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
    from tritonclient.utils import InferenceServerException

    data = np.load(args.data)
    gc = tgrpc.InferenceServerClient(args.grpc)
    hc = thttp.InferenceServerClient(args.http)
    gm = tgrpc.InferenceServerClient(args.grpc_management)
    hm = thttp.InferenceServerClient(args.http_management)
    try:
        env = Env(
            np,
            tgrpc,
            thttp,
            InferenceServerException,
            gc,
            hc,
            args.http,
            args.model,
            data["pixels"].astype(np.float32),
            data["logits"].astype(np.float32),
            gm,
            hm,
        )
        report = run_checks(env)
    finally:
        for client in (gc, hc, gm, hm):
            client.close()
    json.dump({"tritonclient": version("tritonclient"), "checks": report}, sys.stdout)
    return 0 if all(r["ok"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
