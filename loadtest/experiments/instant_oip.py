"""An Open Inference Protocol gRPC server that answers at once, with none of Mariner behind it.

It tells a load generator's own faults from ours: a client that hangs against this server too
(it serves one model, "instant", version "1", one FP32 [-1, 64] input, answered with zeros) hangs
for reasons of its own. It speaks the calls perf_analyzer makes (server and model metadata,
model config, statistics, infer) with grpc's default server options, no batcher and no worker:
the fastest answer a client can get here, which is what makes a client's start-up races show.

    python -m mariner.loadtest.experiments.instant_oip --port 17270
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import grpc

from mariner.server._proto.inference import grpc_service_pb2 as pb
from mariner.server._proto.inference import grpc_service_pb2_grpc as pb_grpc

MODEL = "instant"
VERSION = "1"
FEATURES = 64


class InstantServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Every answer built at once; statistics count the infers it answered."""

    def __init__(self) -> None:
        self.count = 0
        self.last_ms = 0

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(ready=request.name == MODEL)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="instant", version="0", extensions=["statistics"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=MODEL,
            versions=[VERSION],
            platform="instant",
            inputs=[tensor(name="pixels", datatype="FP32", shape=[-1, FEATURES])],
            outputs=[tensor(name="logits", datatype="FP32", shape=[-1, 10])],
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        response = pb.ModelConfigResponse()
        config = response.config
        config.name = MODEL
        config.platform = "instant"
        config.max_batch_size = 32
        entry = config.input.add(name="pixels", dims=[FEATURES])
        entry.data_type = 11  # TYPE_FP32
        out = config.output.add(name="logits", dims=[10])
        out.data_type = 11
        return response

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        ns = self.count * 1000
        duration = {"count": self.count, "ns": ns}
        stats = pb.ModelStatistics(
            name=MODEL,
            version=VERSION,
            last_inference=self.last_ms,
            inference_count=self.count,
            execution_count=self.count,
        )
        for field in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            getattr(stats.inference_stats, field).CopyFrom(pb.StatisticDuration(**duration))
        return pb.ModelStatisticsResponse(model_stats=[stats])

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        rows = request.inputs[0].shape[0] if request.inputs and request.inputs[0].shape else 1
        self.count += 1
        self.last_ms = int(time.time() * 1000)
        output = pb.ModelInferResponse.InferOutputTensor(name="logits", datatype="FP32", shape=[rows, 10])
        return pb.ModelInferResponse(
            model_name=MODEL,
            model_version=VERSION,
            id=request.id,
            outputs=[output],
            raw_output_contents=[bytes(4 * 10 * rows)],
        )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InstantServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"instant OIP gRPC server on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
