"""A BaseHandler subclass that fails some inputs the two ways users' handlers fail."""

from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException


class ErrorsHandler(BaseHandler):
    def initialize(self, context):
        self.initialized = True  # no model to load

    def handle(self, data, context):
        out = []
        for row in data:
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = value.decode("utf-8")
            if value == "custom":
                raise PredictionException("custom message", 513)
            if value == "value":
                raise ValueError("a plain ValueError from the handler")
            out.append({"ok": value})
        return out
