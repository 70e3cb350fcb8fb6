"""Wire protocols: adapters that translate gRPC/HTTP messages to the core's types and back."""
