"""KServe's Python SDK against a live Mariner: run by test_kserve_v1.py in .venv-kserve.

Imports only the SDK, numpy and the standard library (never mariner: the SDK's pins live in their
own virtualenv). Prints one JSON object: check name -> what the SDK returned, or
{"raised": "<type>: <message>", "status": <http status>} when it raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def _capture(coro: Any) -> Any:
    try:
        return await coro
    except Exception as exc:  # the test asserts on what a KServe user would see
        response = getattr(exc, "response", None)
        return {"raised": f"{type(exc).__name__}: {exc}", "status": getattr(response, "status_code", None)}


async def run(base: str, model: str, pixels: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    v1 = InferenceRESTClient(RESTConfig(protocol="v1", timeout=120))
    try:
        instances = [row.tolist() for row in pixels]
        out["live"] = await _capture(v1.is_server_live(base))
        out["ready"] = await _capture(v1.is_model_ready(base, model))
        out["ready_unknown"] = await _capture(v1.is_model_ready(base, "no_such_model"))
        out["predict"] = await _capture(v1.infer(base, {"instances": instances}, model_name=model))
        out["explain"] = await _capture(v1.explain(base, model, {"instances": instances[:2]}))
        out["predict_bad"] = await _capture(v1.infer(base, {"instances": [[99.0] * 64]}, model_name=model))
        out["predict_unknown"] = await _capture(v1.infer(base, {"instances": instances}, model_name="nope"))
    finally:
        await v1.close()
    v2 = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
    try:
        tensor = InferInput("pixels", list(pixels.shape), "FP32", pixels.tolist())
        response = await _capture(v2.infer(base, InferRequest(model, [tensor]), model_name=model))
        if isinstance(response, dict):
            out["v2_infer"] = response
        else:
            out["v2_infer"] = {o.name: o.as_numpy().tolist() for o in response.outputs}
        out["v2_ready"] = await _capture(v2.is_model_ready(base, model))
    finally:
        await v2.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="npz with `pixels` (N, 64)")
    args = parser.parse_args()
    pixels = np.load(args.data)["pixels"].astype(np.float32)
    print(json.dumps(asyncio.run(run(args.url, args.model, pixels))))


if __name__ == "__main__":
    main()
