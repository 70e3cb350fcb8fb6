"""A module-level entry point as in TorchServe's docs/custom_service.md: `handle(data, context)`.

TorchServe calls `handle(None, context)` once at load time to initialise the service.
"""

import torch
from ts.torch_handler.base_handler import BaseHandler


class _Service(BaseHandler):
    def preprocess(self, data):
        rows = []
        for row in data:
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = value.decode("utf-8")
            rows.append([float(v) for v in str(value).split(",")])
        return torch.tensor(rows)

    def postprocess(self, data):
        return [{"sum": round(float(r.sum()), 4)} for r in data]


_service = _Service()


def handle(data, context):
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    return _service.handle(data, context)
