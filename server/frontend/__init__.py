"""A frontend, the data-plane process (`main`): inference listeners, the protocol adapters
(`protocols/`), the DataPlane and one endpoint and batcher per served version, and the client of
each model worker (`worker_client`). It follows the supervisor over its control channel and
imports neither the supervisor nor the worker (`make lint` checks)."""
