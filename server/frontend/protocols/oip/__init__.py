"""The Open Inference Protocol v2 (KServe/Triton) over gRPC and HTTP."""
