"""The transport floor: the same RPC and route as Mariner, answering fixed bytes, no model.

Used by the benchmarks to show how much of a request's latency is the transport stack itself
(grpc.aio + protobuf; uvicorn + Starlette), i.e. the best any server on these stacks can do.
The program `FloorProcess` (`mariner.loadtest.servers.mariner`) runs on two free ports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator

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


async def serve(grpc_port: int, http_port: int) -> None:
    from mariner.server import protogen

    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2_grpc

    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(_servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{grpc_port}")
    await server.start()
    app = Starlette(routes=[Route("/predictions/{model}", _predict, methods=["POST"]), Route("/ping", _ping)])
    http = _Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning", loop="none"))
    await http.serve()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--http-port", type=int, required=True)
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.grpc_port, args.http_port))


if __name__ == "__main__":
    main()
