"""A custom function entry point, named on the archiver's command line as `mymod:my_fn`."""

import json

_state = {"loads": 0}


def my_fn(data, context):
    if data is None:  # the load-time call
        _state["loads"] += 1
        return None
    out = []
    for index, row in enumerate(data):
        value = row.get("data") or row.get("body")
        if isinstance(value, (bytes, bytearray)):
            value = value.decode("utf-8")
        out.append(
            json.dumps(
                {
                    "echo": value,
                    "loads": _state["loads"],
                    "model": context.model_name,
                    "header": context.get_request_header(index, "x-dropin"),
                    "header_as_sent": context.get_request_header(index, "X-Dropin"),
                }
            )
        )
    return out
