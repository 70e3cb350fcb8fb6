"""The transport floor: the same RPC and route as Mariner, answering fixed bytes, no model.

Used by the benchmarks to show how much of a request's latency is the transport stack itself
(grpc.aio + protobuf; uvicorn + Starlette), i.e. the best any server on these stacks can do.
The program `FloorProcess` (`mariner.loadtest.servers.mariner`) runs on two free ports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Iterator
from concurrent import futures

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

ANSWER = json.dumps({"label": 0, "topk": [{"label": 0, "probability": 1.0}]}, indent=2).encode()


def _servicer() -> object:
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    class Floor(inference_pb2_grpc.InferenceAPIsServiceServicer):
        async def Predictions(self, request, context):  # noqa: N802 - gRPC method name
            return inference_pb2.PredictionResponse(prediction=ANSWER)

    return Floor()


async def _predict(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


async def _ping(request: Request) -> Response:
    return Response(b'{"status": "Healthy"}', media_type="application/json")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _threaded(grpc_port: int, hop: asyncio.AbstractEventLoop | None) -> grpc.Server:
    """grpcio's threaded server answering the same bytes; with `hop`, each call is handed to
    that asyncio loop and back, as a threaded frontend over Mariner's asyncio batcher would be."""
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    async def on_loop() -> bytes:
        return ANSWER

    class Floor(inference_pb2_grpc.InferenceAPIsServiceServicer):
        def Predictions(self, request, context):  # noqa: N802 - gRPC method name
            body = ANSWER if hop is None else asyncio.run_coroutine_threadsafe(on_loop(), hop).result()
            return inference_pb2.PredictionResponse(prediction=body)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(Floor(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    server.start()
    return server


async def serve(grpc_port: int, http_port: int, grpc_server: str = "aio") -> None:
    from mariner.server import protogen

    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2_grpc

    if grpc_server == "aio":
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(_servicer(), server)
        server.add_insecure_port(f"127.0.0.1:{grpc_port}")
        await server.start()
    else:
        hop = asyncio.get_running_loop() if grpc_server == "threaded-hop" else None
        threaded = _threaded(grpc_port, hop)  # noqa: F841 - serves until the process ends
    app = Starlette(routes=[Route("/predictions/{model}", _predict, methods=["POST"]), Route("/ping", _ping)])
    http = _Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning", loop="none"))
    await http.serve()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument(
        "--grpc-server",
        choices=("aio", "threaded", "threaded-hop"),
        default="aio",
        help="grpc.aio (default), grpcio's threaded server, or the threaded server handing each "
        "call to the asyncio loop and back",
    )
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.grpc_port, args.http_port, args.grpc_server))


if __name__ == "__main__":
    main()
