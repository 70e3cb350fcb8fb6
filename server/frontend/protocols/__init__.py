"""Wire protocols: adapters that translate gRPC/HTTP messages to the contracts' types and back."""
