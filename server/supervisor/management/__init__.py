"""The supervisor's management API: TorchServe's REST (`http`) and gRPC (`grpc`, with the
management server's assembly), describe documents, and the workflow API."""
