"""Imports a helper module the archive ships with --extra-files."""

import helper_mod
from ts.torch_handler.base_handler import BaseHandler


class DepsHandler(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        out = []
        for row in data:
            value = row.get("data") or row.get("body")
            received = type(value).__name__  # what the server made of the body
            if isinstance(value, (bytes, bytearray)):
                value = value.decode("utf-8")
            out.append({**helper_mod.shout(value), "received": received})
        return out
