"""Stock TorchServe as the oracle for the sentence-encoder and image-classifier archives.

The same archives (minilm_onnx, resnet18_torchscript from the default store) are served by stock
TorchServe 0.12 and by Mariner, and the same requests, sent concurrently so both servers batch
them, must get the same answers: embeddings within 1e-5 (batch composition changes the padded
length, which may move the last float bits), identical top-5 classes with probabilities within
1e-5, the same status codes, and a 4xx on both for a bad input (an empty text, bytes that are no
image) while its batch-mates are answered. One TorchServe and one Mariner serve the module.

If model_store/ lacks these archives (a store built before the families existed), they are
built into a temporary store by the families' own pipelines.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from mariner.loadtest.servers import StockTorchServe, leftover_processes
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

MINILM = "minilm_onnx"
RESNET = "resnet18_torchscript"
MODELS = (MINILM, RESNET)
TOL = 1e-5
TIMEOUT = 120
SEED = 20261130


def _indexed(store: Path) -> set[str]:
    index = store / "index.json"
    if not index.is_file():
        return set()
    return {a["file"] for a in json.loads(index.read_text())["archives"]}


@pytest.fixture(scope="module")
def store(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("oracle-workloads")
    built = repo_root / "model_store"
    have = _indexed(built)
    for name in MODELS:
        if f"{name}.mar" in have:
            try:  # archives are 45-90 MB: a hard link where the file system allows one
                os.link(built / f"{name}.mar", out / f"{name}.mar")
            except OSError:
                shutil.copy(built / f"{name}.mar", out / f"{name}.mar")
    missing = [m for m in MODELS if not (out / f"{m}.mar").exists()]
    if missing:
        from mariner.training.minilm.pipeline import build as build_minilm
        from mariner.training.resnet.pipeline import build as build_resnet

        work = tmp_path_factory.mktemp("oracle-workloads-build")
        common = {"full": False, "batch_size": 8, "max_batch_delay_ms": 20}
        if MINILM in missing:
            fb = build_minilm(out, work, variants=("eager", "onnx"), **common)
            assert not fb.failed, fb.report_markdown
        if RESNET in missing:
            fb = build_resnet(out, work, variants=("torchscript",), **common)
            assert not fb.failed, fb.report_markdown
    return out


@pytest.fixture(scope="module")
def torchserve(store: Path) -> Iterator[StockTorchServe]:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    with StockTorchServe(store, list(MODELS)) as ts:
        workdir = ts.workdir
        assert workdir is not None
        yield ts
    assert leftover_processes(workdir) == [], "stock TorchServe left processes running after stop()"


@pytest.fixture(scope="module")
def mariner(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(store, ",".join(f"{m}.mar" for m in MODELS)).start()
    try:
        yield srv
    finally:
        srv.stop()


Request = tuple[bytes, str]  # body, Content-Type


def post_all(base: str, model: str, reqs: list[Request]) -> list[requests.Response]:
    """Concurrently (8 at a time), so the server batches them; answers in request order."""

    def one(req: Request) -> requests.Response:
        body, ctype = req
        return requests.post(
            f"{base}/predictions/{model}", data=body, headers={"Content-Type": ctype}, timeout=TIMEOUT
        )

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, reqs))


def both(
    ts: StockTorchServe, ours: MarinerServe, model: str, reqs: list[Request]
) -> list[tuple[requests.Response, requests.Response]]:
    return list(zip(post_all(ts.http_url, model, reqs), post_all(ours.http, model, reqs), strict=True))


def text_requests() -> list[Request]:
    from mariner.training.text_data import mixed_length, sentences

    texts = sentences("heldout")[:10] + mixed_length(4, seed=SEED, lo=5, hi=200)
    reqs: list[Request] = [(t.encode(), "text/plain; charset=utf-8") for t in texts]
    reqs += [
        (json.dumps(texts[0]).encode(), "application/json"),  # a JSON string
        (json.dumps(texts[1:4]).encode(), "application/json"),  # a list of texts
        (json.dumps({"text": texts[4:6]}).encode(), "application/json"),
        (json.dumps({"text": texts[6]}).encode(), "application/json"),
    ]
    return reqs


def vectors(answer: dict[str, Any]) -> np.ndarray:
    if "embedding" in answer:
        return np.asarray([answer["embedding"]], dtype=np.float64)
    return np.asarray(answer["embeddings"], dtype=np.float64)


def test_minilm_embeddings_match_stock_torchserve(torchserve: StockTorchServe, mariner: MarinerServe) -> None:
    reqs = text_requests()
    identical = 0
    for i, (theirs, ours) in enumerate(both(torchserve, mariner, MINILM, reqs)):
        assert (theirs.status_code, ours.status_code) == (200, 200), (i, theirs.text[:200], ours.text[:200])
        a, b = theirs.json(), ours.json()
        assert a.keys() == b.keys(), i
        va, vb = vectors(a), vectors(b)
        assert va.shape == vb.shape
        assert va.shape[1] == 384
        assert np.abs(va - vb).max() <= TOL, (i, float(np.abs(va - vb).max()))
        np.testing.assert_allclose(np.linalg.norm(vb, axis=1), 1.0, atol=1e-4)
        identical += theirs.content == ours.content
    # one text per plain or string body, a list where a list was sent
    assert vectors(both(torchserve, mariner, MINILM, reqs[-3:-2])[0][1].json()).shape == (3, 384)
    print(f"minilm: {identical}/{len(reqs)} answers byte-identical on both servers")


def image_requests() -> list[Request]:
    from mariner.training.image_data import encoded_set

    jpegs = [(j, "image/jpeg") for j in encoded_set(12, SEED)]
    pngs = [(p, "image/png") for p in encoded_set(3, SEED + 1, fmt="png")]
    return jpegs + pngs


def test_resnet_top5_matches_stock_torchserve(torchserve: StockTorchServe, mariner: MarinerServe) -> None:
    reqs = image_requests()
    identical = 0
    for i, (theirs, ours) in enumerate(both(torchserve, mariner, RESNET, reqs)):
        assert (theirs.status_code, ours.status_code) == (200, 200), (i, theirs.text[:200], ours.text[:200])
        a, b = theirs.json()["topk"], ours.json()["topk"]
        assert len(a) == 5
        assert [(t["index"], t["label"]) for t in a] == [(t["index"], t["label"]) for t in b], i
        pa = np.asarray([t["probability"] for t in a])
        pb = np.asarray([t["probability"] for t in b])
        assert np.abs(pa - pb).max() <= TOL, (i, pa, pb)
        assert list(pb) == sorted(pb, reverse=True)
        identical += theirs.content == ours.content
    print(f"resnet18: {identical}/{len(reqs)} answers byte-identical on both servers")


@pytest.mark.parametrize(
    ("model", "bad"),
    [
        (MINILM, (b'""', "application/json")),  # an empty text
        (MINILM, (b"[]", "application/json")),  # no text at all
        (MINILM, (b'{"text": ["fine", 7]}', "application/json")),  # a list item that is no text
        (RESNET, (b"these bytes are not an image" * 4, "application/octet-stream")),
        (RESNET, (b"\xff\xd8\xff\xe0 truncated jpeg", "image/jpeg")),
    ],
)
def test_a_bad_input_is_a_4xx_on_both_and_fails_alone(
    torchserve: StockTorchServe, mariner: MarinerServe, model: str, bad: Request
) -> None:
    good = text_requests()[:7] if model == MINILM else image_requests()[:7]
    reqs = [*good[:3], bad, *good[3:]]  # released together: the bad one shares a batch
    answers = both(torchserve, mariner, model, reqs)
    theirs, ours = answers[3]
    assert 400 <= theirs.status_code < 500, theirs.text[:300]
    assert 400 <= ours.status_code < 500, ours.text[:300]
    assert theirs.status_code == ours.status_code
    for i, (t, o) in enumerate(answers):
        if i != 3:
            assert (t.status_code, o.status_code) == (200, 200), (i, t.text[:200], o.text[:200])
