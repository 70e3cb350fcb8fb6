"""A BaseHandler subclass for rows an envelope unwrapped (lists of numbers), a TorchScript model."""

import torch
from ts.torch_handler.base_handler import BaseHandler


class EnvelopeHandler(BaseHandler):
    """One answer per row the envelope hands over: a JSON instance, or a KServe v2 input."""

    def handle(self, data, context):
        out = []
        for row in data:
            value = row.get("data") if isinstance(row, dict) else row
            x = torch.tensor(value, dtype=torch.float32).reshape(-1, 4)
            with torch.inference_mode():
                y = self.model(x)
            out.append([round(float(v), 4) for v in y.flatten()])
        return out
