"""Stock TorchServe as the oracle for /explanations, /invocations and KServe v1.

The same archives (with this tree's digits handler) run on stock TorchServe and on Mariner; the
answers must agree: status codes, and JSON bodies up to float rounding. With TorchServe's
`service_envelope=kserve`, its `/v1/models/{m}:predict|:explain` is the reference for ours.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from mariner.loadtest.servers import StockTorchServe
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MODELS = ("digits_torchscript", "digits_onnx")
TIMEOUT = 60


def same_json(a: Any, b: Any) -> bool:
    """Equal JSON, numbers within 1e-5 (both servers round; the last digit may differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        return bool(np.isclose(a, b, atol=1e-5, rtol=0))
    return a == b


@pytest.fixture(scope="module")
def store(current_digits_store: Path) -> Path:
    """MODELS with this tree's digits handler (`current_digits_archive`): the session's store
    (tests/integration/conftest.py), which stock TorchServe serves here too."""
    assert sorted(p.stem for p in current_digits_store.glob("*.mar")) == sorted(MODELS)
    return current_digits_store


@pytest.fixture(scope="module")
def mariner(shared_current_digits: MarinerServe) -> MarinerServe:
    """The session's shared server on that store: these tests only send requests."""
    return shared_current_digits.alive()


def stock(store: Path, **extra: str) -> StockTorchServe:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    return StockTorchServe(store, list(MODELS), batch_size=1, extra_config=extra or None)


@pytest.fixture(scope="module")
def torchserve(store: Path) -> Iterator[StockTorchServe]:
    with stock(store) as ts:
        yield ts


def both(ts: str, ours: str, path: str, body: Any) -> tuple[requests.Response, requests.Response]:
    return (
        requests.post(f"{ts}{path}", json=body, timeout=TIMEOUT),
        requests.post(f"{ours}{path}", json=body, timeout=TIMEOUT),
    )


def test_explanations_match_stock_torchserve(
    torchserve: StockTorchServe, mariner: MarinerServe, eager_reference: Any
) -> None:
    px = [r.tolist() for r in eager_reference.test_pixels[:3]]
    cases: list[tuple[Any, int]] = [
        (px[0], 200),
        (px[1], 200),
        ({"data": px[2], "target": 5}, 200),
        ([99.0] * 64, 400),
    ]
    for body, status in cases:
        theirs, ours = both(torchserve.http_url, mariner.http, "/explanations/digits_torchscript", body)
        assert (theirs.status_code, ours.status_code) == (status, status), (theirs.text, ours.text)
        assert same_json(ours.json(), theirs.json()), (theirs.text[:300], ours.text[:300])
    theirs, ours = both(torchserve.http_url, mariner.http, "/explanations/digits_onnx", px[0])
    assert (theirs.status_code, ours.status_code) == (501, 501)
    assert ours.json() == theirs.json()


def test_invocations_match_stock_torchserve(
    torchserve: StockTorchServe, mariner: MarinerServe, eager_reference: Any
) -> None:
    px = eager_reference.test_pixels[0].tolist()
    theirs, ours = both(torchserve.http_url, mariner.http, "/invocations?model_name=digits_torchscript", px)
    assert (theirs.status_code, ours.status_code) == (200, 200)
    assert same_json(ours.json(), theirs.json())
    theirs, ours = both(torchserve.http_url, mariner.http, "/models/digits_onnx/invoke", px)
    assert same_json(ours.json(), theirs.json())
    # Two models loaded at startup and no model_name: both refuse with 400.
    theirs, ours = both(torchserve.http_url, mariner.http, "/invocations", px)
    assert (theirs.status_code, ours.status_code) == (400, 400)


def test_kserve_v1_matches_torchserves_kserve_envelope(
    store: Path, mariner: MarinerServe, eager_reference: Any
) -> None:
    instances = [r.tolist() for r in eager_reference.test_pixels[:3]]
    with stock(store, service_envelope="kserve") as ts:
        for verb in ("predict", "explain"):
            path = f"/v1/models/digits_torchscript:{verb}"
            theirs, ours = both(ts.http_url, mariner.http, path, {"instances": instances})
            assert (theirs.status_code, ours.status_code) == (200, 200), (theirs.text, ours.text)
            assert same_json(ours.json(), theirs.json()), (theirs.text[:300], ours.text[:300])
