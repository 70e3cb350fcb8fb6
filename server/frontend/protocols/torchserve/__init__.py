"""TorchServe's inference API over gRPC and HTTP."""
