"""The shape of TorchServe's ONNX handler (test/pytest/onnx_handler.py): BaseHandler loads the
.onnx file into an onnxruntime session; handle runs it on the request's numbers."""

import json

import numpy as np
from ts.torch_handler.base_handler import BaseHandler


class ONNXHandler(BaseHandler):
    def handle(self, data, context):
        answers = []
        for row in data:
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            x = np.asarray(value, dtype=np.float32).reshape(-1, 4)
            (out,) = self.model.run(None, {"modelInput": x})
            answers.append([[round(float(v), 4) for v in r] for r in out])
        return answers
