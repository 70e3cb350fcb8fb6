"""tritonclient's gRPC stream client, following a plan; run under .venv-triton's python.

`python stream_client.py TARGET PLAN.json` performs the plan's steps in order on one
`start_stream` and prints one JSON list: every callback in arrival order, as
{"id", "error", "outputs": {name: list}}. Steps:
  {"send": [{"model", "id", "inputs": [{"name", "datatype", "shape", "data"}]}]}
  {"wait_file": path}           wait until the file exists (the test says when to go on)
  {"touch": path}               create the file
  {"wait_answers": n}           wait until n callbacks arrived
The stream is stopped at the end (tritonclient half-closes and waits for the server to end it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

CAP_S = 120.0
DTYPES = {"FP32": np.float32, "INT64": np.int64}


def main() -> None:
    target, plan_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    answers: list[dict[str, object]] = []
    cond = threading.Condition()

    def callback(result: object, error: object) -> None:
        with cond:
            if error is not None:
                answers.append({"id": None, "error": str(error), "outputs": {}})
            else:
                response = result.get_response()  # type: ignore[attr-defined]
                outputs = {o.name: result.as_numpy(o.name).tolist() for o in response.outputs}  # type: ignore[attr-defined]
                answers.append({"id": response.id, "error": None, "outputs": outputs})
            cond.notify_all()

    client = grpcclient.InferenceServerClient(target)
    client.start_stream(callback=callback)
    try:
        for step in plan:
            if "send" in step:
                for req in step["send"]:
                    inputs = []
                    for spec in req["inputs"]:
                        arr = np.asarray(spec["data"], dtype=DTYPES[spec["datatype"]]).reshape(spec["shape"])
                        tensor = grpcclient.InferInput(spec["name"], list(arr.shape), spec["datatype"])
                        tensor.set_data_from_numpy(arr)
                        inputs.append(tensor)
                    client.async_stream_infer(req["model"], inputs, request_id=req["id"])
            elif "wait_file" in step:
                end = time.monotonic() + CAP_S
                while not os.path.exists(step["wait_file"]) and time.monotonic() < end:
                    time.sleep(0.005)
            elif "touch" in step:
                open(step["touch"], "w").close()
            elif "wait_answers" in step:
                wanted = int(step["wait_answers"])
                with cond:
                    cond.wait_for(lambda n=wanted: len(answers) >= n, CAP_S)
    finally:
        client.stop_stream()
        client.close()
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
