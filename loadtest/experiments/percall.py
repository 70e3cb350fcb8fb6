"""Mariner's own work per call, piece by piece, with the transport and the model taken away.

The live benchmark gives a frontend's CPU per request and the bare transport's under the same
load; their difference is what Mariner adds, but on a shared 2-core machine both figures move
by tens of percent between runs. This tool measures the pieces themselves in one process, on the
real code: the TorchServe gRPC servicer's `Predictions` (request parsing, headers, the call path
and its metrics, the DataPlane, the endpoint's deadline, the batcher) driven by 64 concurrent
coroutines with a runner that answers at once, HTTP's `/predictions` through the inference
listener's real protocol both ways (the ASGI app and the fast path), what every call pays for its
request id, metrics, drain accounting and access line, and the frame codec between a frontend and a
worker (a batch of 32 requests out, 32 results back, both pickled and checked against the
allowlist). CPU time (`time.process_time`) over many calls, best of several rounds: a lower
bound that noise can only raise.

    python -m mariner.loadtest.experiments.percall            # prints the per-piece table in microseconds
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

CONCURRENCY = 64
BATCH = 32
BODY = json.dumps(list(range(64))).encode()
ANSWER = json.dumps({"label": 3, "topk": [{"label": 3, "probability": 0.99}]}, indent=2).encode()


@dataclass(frozen=True)
class Piece:
    name: str
    us_per_request: float
    note: str


class _Context:
    """What the servicer reads of a grpc.aio ServicerContext on the success path."""

    def __init__(self) -> None:
        self._metadata = (("user-agent", "grpc-python/1.85"),)

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: Any, details: str) -> None:  # pragma: no cover - success path only
        raise RuntimeError(f"aborted: {code} {details}")


def _best(rounds: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(rounds))


def _cpu_per_call(calls: int, run: Callable[[], object]) -> float:
    t0 = time.process_time()
    run()
    return (time.process_time() - t0) / calls * 1e6


def _plane() -> Any:
    """A DataPlane with one ready digits endpoint whose runner answers at once."""
    from mariner.server.common.metrics import Metrics
    from mariner.server.common.model_settings import ModelSettings
    from mariner.server.contracts.types import InferRequest, InferResult, ModelState
    from mariner.server.contracts.worker_api import ModelEntry
    from mariner.server.frontend.dataplane import DataPlane
    from mariner.server.frontend.endpoint import ModelEndpoint

    class Instant:
        id = "digits-1"

        async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
            await asyncio.sleep(0)  # one loop turn, as an answer from a worker would take
            return [InferResult(body=ANSWER, model_version="1") for _ in requests]

    metrics = Metrics()
    plane = DataPlane(metrics)
    settings = ModelSettings(batch_size=BATCH, max_batch_delay_ms=5.0)
    entry = ModelEntry("digits", "1", "digits.mar", "00" * 32, ".", {}, {}, settings, True, True)
    ep = ModelEndpoint(entry, metrics)
    ep._start_batcher([Instant()])  # noqa: SLF001 - an in-process runner instead of a worker's connection
    ep.state = ModelState.READY
    plane.install_endpoint(ep)
    return plane


async def _drive(call: Callable[[int], Any], calls: int) -> None:
    per = calls // CONCURRENCY

    async def one(k: int) -> None:
        for i in range(per):
            await call(k * per + i)

    await asyncio.gather(*(one(k) for k in range(CONCURRENCY)))


def servicer_pieces(calls: int, rounds: int) -> list[Piece]:
    from mariner.server.frontend.protocols.torchserve import grpc as ts_grpc
    from mariner.server.frontend.protocols.torchserve import grpc_request as ts_request

    pb = ts_grpc.inference_pb2
    wire = pb.PredictionsRequest(model_name="digits", input={"data": BODY}).SerializeToString()
    parse = ts_request.ShallowPredictionsRequest.FromString
    context = _Context()

    def parse_only() -> float:
        return _cpu_per_call(calls, lambda: [parse(wire) for _ in range(calls)] and None)

    def to_request() -> float:
        req = parse(wire)

        def run() -> None:
            for _ in range(calls):
                ts_request.to_infer_request(req, metadata=context.invocation_metadata(), time_remaining=None)

        return _cpu_per_call(calls, run)

    async def plane_and_batcher() -> float:
        plane = _plane()
        req = ts_request.to_infer_request(parse(wire), metadata=(), time_remaining=None)

        async def call(i: int) -> None:
            await plane.infer(req)

        await _drive(call, CONCURRENCY * 20)
        t0 = time.process_time()
        await _drive(call, calls)
        return (time.process_time() - t0) / calls * 1e6

    async def servicer() -> float:
        plane = _plane()
        svc = ts_grpc.InferenceServicer(plane)

        async def call(i: int) -> None:
            await svc.Predictions(parse(wire), context)

        await _drive(call, CONCURRENCY * 20)
        t0 = time.process_time()
        await _drive(call, calls)
        return (time.process_time() - t0) / calls * 1e6

    def run_async(fn: Callable[[], Any]) -> float:
        from mariner.server.common import event_loop

        return event_loop.run(fn())

    whole = _best(rounds, lambda: run_async(servicer))
    inner = _best(rounds, lambda: run_async(plane_and_batcher))
    return [
        Piece("parse the PredictionsRequest (shallow)", _best(rounds, parse_only), "protobuf FromString"),
        Piece("to_infer_request (input map, headers, id)", _best(rounds, to_request), "per call"),
        Piece("DataPlane + endpoint deadline + batcher", inner, f"{CONCURRENCY} in flight, batch {BATCH}"),
        Piece("whole servicer Predictions (all of the above + run_call, metrics)", whole, "per call"),
    ]


def _http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(BODY)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080),
    }  # fmt: skip


def http_receiver() -> Callable[[], Any]:
    """An ASGI `receive` for one call: the request's body, then nothing until cancelled."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # the disconnect watcher waits here until cancelled
        raise AssertionError("unreachable")

    return receive


async def http_send(message: MutableMapping[str, Any]) -> None:
    """An ASGI `send` that checks the answer is a 200."""
    if message["type"] == "http.response.start" and message["status"] != 200:
        raise RuntimeError(f"answered {message['status']}")


def http_pieces(calls: int, rounds: int) -> list[Piece]:
    """TorchServe's `/predictions` over the inference listener's real ASGI app, driven directly
    (no uvicorn, no socket): the listener's app (which sends predictions straight to their
    endpoint), the same routes through Starlette's middleware and router, and the route's endpoint
    called with a Request built by hand."""
    from starlette.requests import Request

    from mariner.server.common.http_limits import DISCONNECT_HOOK
    from mariner.server.frontend.protocols.http_listener import inference_app

    receiver, send = http_receiver, http_send

    async def interleaved() -> dict[str, float]:
        """One plane for all three ways in, taken in turn in small blocks, so the drift of a
        shared machine falls on each alike: CPU µs per call of each."""
        listener = inference_app(_plane())
        predict = listener.predict

        async def by_hand(scope: dict[str, Any], receive: Any, send: Any) -> None:
            scope = {**scope, "path_params": {"model": "digits"}}
            response = await predict(Request(scope, receive))
            await response(scope, receive, send)

        on_lost: set[Callable[[], None]] = set()

        def hook(callback: Callable[[], None]) -> Callable[[], None]:  # as the protocol's own
            on_lost.add(callback)
            return functools.partial(on_lost.discard, callback)

        async def hooked(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await listener({**scope, "extensions": {DISCONNECT_HOOK: hook}}, receive, send)

        ways: dict[str, Any] = {
            "listener": listener, "hooked": hooked, "starlette": listener.app, "endpoint": by_hand
        }  # fmt: skip
        spent = dict.fromkeys(ways, 0.0)
        block = CONCURRENCY * 20
        for _ in range(max(1, calls // block)):
            for name, app in ways.items():

                async def call(i: int, app: Any = app) -> None:
                    await app(_http_scope("/predictions/digits"), receiver(), send)

                t0 = time.process_time()
                await _drive(call, block)
                spent[name] += time.process_time() - t0
        n = max(1, calls // block) * block
        return {name: cpu / n * 1e6 for name, cpu in spent.items()}

    from mariner.server.common import event_loop

    event_loop.run(interleaved())  # warm-up
    best = [event_loop.run(interleaved()) for _ in range(rounds)]
    whole, hooked, routed, alone = (
        min(r[k] for r in best) for k in ("listener", "hooked", "starlette", "endpoint")
    )
    return [
        Piece(
            "HTTP /predictions, the inference listener's app (ASGI, no server)", whole, "disconnect: a task"
        ),
        Piece("HTTP /predictions, the same with the protocol's disconnect hook", hooked, "as served"),
        Piece("HTTP /predictions through Starlette's middleware and router", routed, "per call"),
        Piece("HTTP /predictions, the route's endpoint alone", alone, "Request built by hand"),
    ]


class _Transport:
    """A socket transport's surface for uvicorn's protocol: what is written is dropped, and the
    connection's driver is woken when an answer's last byte (the known body) is written."""

    def __init__(self) -> None:
        self.answered: asyncio.Future[None] | None = None
        self.closing = False

    def write(self, data: bytes) -> None:
        if data.endswith(ANSWER) and self.answered is not None and not self.answered.done():
            self.answered.set_result(None)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8080)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def protocol_pieces(calls: int, rounds: int) -> list[Piece]:
    """TorchServe's `/predictions` through the inference listener's real protocol (uvicorn's
    httptools parser with our limits) and its whole app stack (access log, drain, tokens off),
    with a transport in place of the socket: the fast path (answered from the protocol's
    callbacks), the ASGI app, and the fast path's own work on a bare httptools protocol
    (`bare_prediction`: what uvicorn's protocol and our limits add is the difference), taken in
    turn on one plane. Each of 64 keep-alive connections
    sends its next request when its answer is written; the driver's own cost (a future per
    request) is in both figures alike."""
    from uvicorn.server import ServerState

    from mariner.loadtest.experiments.bare_prediction import bare_prediction
    from mariner.server.common.config import ServerConfig
    from mariner.server.common.http_common import DEFAULT_MAX_HEADERS
    from mariner.server.common.listeners import listener_auth
    from mariner.server.common.security import load_tokens
    from mariner.server.frontend.protocols.http_inference import inference_listener

    request = (
        b"POST /predictions/digits HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )

    async def interleaved() -> dict[str, float]:
        plane = _plane()
        auth = listener_auth(load_tokens(None, None), None)
        loop = asyncio.get_running_loop()
        ways: dict[str, Callable[[], Any]] = {}
        for way, fast in (("fast", True), ("app", False)):
            config = inference_listener(
                plane, ServerConfig(), auth, port=0, thread="percall", held=None, fast_predictions=fast
            )
            config.load()
            ways[way] = functools.partial(
                config.http_protocol_class,
                config=config,
                server_state=ServerState(),
                app_state={},
                _loop=loop,
            )
        ways["bare"] = bare_prediction(plane, DEFAULT_MAX_HEADERS)

        async def drive(way: str, n: int) -> None:
            async def one() -> None:
                proto = ways[way]()
                transport = _Transport()
                proto.connection_made(transport)  # type: ignore[arg-type]
                for _ in range(n):
                    transport.answered = loop.create_future()
                    proto.data_received(request)
                    await transport.answered
                proto.connection_lost(None)

            await asyncio.gather(*(one() for _ in range(CONCURRENCY)))

        spent = dict.fromkeys(ways, 0.0)
        per = 20
        for way in ways:
            await drive(way, per)  # warm-up
        blocks = max(1, calls // (CONCURRENCY * per))
        for _ in range(blocks):
            for way in ways:
                t0 = time.process_time()
                await drive(way, per)
                spent[way] += time.process_time() - t0
        return {way: cpu / (blocks * CONCURRENCY * per) * 1e6 for way, cpu in spent.items()}

    from mariner.server.common import event_loop

    best = [event_loop.run(interleaved()) for _ in range(rounds)]
    fast, app, bare = (min(r[k] for r in best) for k in ("fast", "app", "bare"))
    return [
        Piece("HTTP /predictions through the protocol: the ASGI app", app, "parse + app stack + plane"),
        Piece("HTTP /predictions through the protocol: the fast path", fast, "parse + path + plane"),
        Piece(
            "HTTP /predictions through a bare protocol: the fast path's work", bare, "no uvicorn, no limits"
        ),
    ]


def codec_pieces(calls: int, rounds: int) -> list[Piece]:
    from mariner.server.contracts import worker_wire as protocol
    from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol

    requests = tuple(
        InferRequest(
            model="digits",
            version=None,
            data={"data": BODY},
            protocol=WireProtocol.TS_GRPC,
            request_id=f"{i:032x}",
            headers={"user-agent": "grpc-python/1.85"},
            deadline=time.monotonic() + 60,
        )  # fmt: skip
        for i in range(BATCH)
    )
    results = tuple(InferResult(body=ANSWER, model_version="1") for _ in range(BATCH))
    batches = max(1, calls // BATCH)

    def frame(msg: Any) -> tuple[bytes, bytes]:
        data, _ = protocol.encode(msg)
        size, header = protocol._LEN.unpack(data[: protocol._LEN.size])
        body = data[protocol._LEN.size :]
        return body[:header], body[header:]

    def enc(msg: Any) -> float:
        return _cpu_per_call(batches * BATCH, lambda: [protocol.encode(msg) for _ in range(batches)] and None)

    def dec(msg: Any) -> float:
        header, body = frame(msg)
        return _cpu_per_call(
            batches * BATCH, lambda: [protocol.decode(header, body) for _ in range(batches)] and None
        )

    batch = protocol.Batch(1, requests)
    result = protocol.Result(1, results)
    return [
        Piece("encode a Batch (frontend)", _best(rounds, lambda: enc(batch)), f"per request, batch {BATCH}"),
        Piece("decode a Batch (worker)", _best(rounds, lambda: dec(batch)), "allowlisted unpickling"),
        Piece("encode a Result (worker)", _best(rounds, lambda: enc(result)), "per request"),
        Piece("decode a Result (frontend)", _best(rounds, lambda: dec(result)), "allowlisted unpickling"),
    ]


def bookkeeping_pieces(calls: int, rounds: int) -> list[Piece]:
    """What every HTTP prediction pays beside its own work, on both ways alike: its request id,
    its metrics (`call.record`: the call's count and duration, the OIP statistics book,
    TorchServe's call metrics; written to the memory-mapped files once per loop turn, here one
    turn per batch of 32 answers as a batch's answers come), the drain's accounting, and its
    TorchServe access line (formatted and handed to a record pipe, which writes to /dev/null)."""
    from mariner.server.common.request_ids import new_request_id
    from mariner.server.compat.torchserve.logs import emit
    from mariner.server.compat.torchserve.logs.access import log_http_access
    from mariner.server.compat.torchserve.logs.records import RecordPipe
    from mariner.server.contracts.types import WireProtocol
    from mariner.server.frontend.protocols.call import record

    batches = max(1, calls // BATCH)
    scope = _http_scope("/predictions/digits")

    async def in_turns(one: Callable[[], object]) -> float:
        t0 = time.process_time()
        for _ in range(batches):
            for _ in range(BATCH):
                one()
            await asyncio.sleep(0)  # the turn ends: deferred metric writes, the pipe's flush
        return (time.process_time() - t0) / (batches * BATCH) * 1e6

    async def best(one: Callable[[], object]) -> float:
        return min([await in_turns(one) for _ in range(rounds)])

    async def measure() -> list[Piece]:
        plane = _plane()
        start = time.perf_counter()

        def drain() -> None:
            plane.begin_call()
            plane.end_call()

        sink = os.open(os.devnull, os.O_WRONLY)
        pipe = RecordPipe(sink)
        pipe.attach(asyncio.get_running_loop())
        previous = emit.current()
        emit.set_target(pipe.put_fields)
        try:
            access = await best(lambda: log_http_access("frontend-0", scope, 200, time.time()))
        finally:
            emit.set_target(previous)
            pipe.close()
        return [
            Piece("request id", await best(new_request_id), "per call"),
            Piece(
                "call metrics (count, duration, OIP book, TorchServe's)",
                await best(lambda: record(plane, WireProtocol.TS_HTTP, "digits", None, "200", start)),
                "written once per turn",
            ),
            Piece("drain accounting (begin_call, end_call)", await best(drain), "per call"),
            Piece("TorchServe access line into the record pipe", access, "written once per turn"),
        ]

    return asyncio.run(measure())


def table(pieces: Sequence[Piece]) -> str:
    lines = ["| piece | µs per request | |", "|---|---:|---|"]
    lines += [f"| {p.name} | {p.us_per_request:.1f} | {p.note} |" for p in pieces]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.experiments.percall", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--calls", type=int, default=CONCURRENCY * 200, help="calls per round (%(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the best is kept (default %(default)s)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mariner-percall-") as tmp:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tmp)  # metrics as a frontend writes them
        # TorchServe's names on Prometheus, as the benchmark serves them (its log mode's lines are
        # measured by ts_logs_cost).
        os.environ.setdefault("MARINER_METRICS_MODE", "prometheus")
        pieces = [
            *servicer_pieces(a.calls, a.rounds),
            *http_pieces(a.calls, a.rounds),
            *protocol_pieces(a.calls, a.rounds),
            *bookkeeping_pieces(a.calls, a.rounds),
            *codec_pieces(a.calls, a.rounds),
        ]
    print(table(pieces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
