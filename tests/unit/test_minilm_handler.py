"""The MiniLM handler on a staged eager model dir: decoding rules, per-request 400s, padding,
truncation vs refusal, and the encoder against sentence-transformers' own encode().

The model dir is what the eager archive unpacks to, staged by the pipeline's own `stage()`
from the weights package (no archive build, no server), so these run in seconds after the
one-off model load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mariner.server.worker.context import Context
from mariner.training.export import Artefact
from mariner.training.minilm import package
from mariner.training.minilm.pipeline import weights_dir
from mariner.training.minilm.verify import load_handler, oracle_embeddings
from mariner.training.text_data import mixed_length, sentences

pytestmark = pytest.mark.unit

DIM = 384


def _stage(root: Path, name: str, **handler: Any) -> Any:
    weights = weights_dir()
    staged = package.stage(
        Artefact("eager", weights / "model.safetensors", "eager", "any", 0.0),
        weights_dir=weights, work=root, batch_size=8, max_batch_delay_ms=1, name=name,
    )  # fmt: skip
    staged.model_config["handler"].update(handler)
    return staged


def _load(staged: Any) -> Any:
    return load_handler(staged.dir, staged.manifest, staged.model_config)


@pytest.fixture(scope="module")
def staged_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("minilm_stage")


@pytest.fixture(scope="module")
def handler(staged_root: Path) -> Any:
    return _load(_stage(staged_root, "minilm_longest"))


def _run(handler: Any, rows: list[Any]) -> tuple[list[Any], Context]:
    """One batch through handle() with a real Context, so per-request statuses are recorded."""
    ctx = Context("minilm_test", ".", {}, batch_size=len(rows), gpu_id=None)
    ctx.begin_batch([f"r{i}" for i in range(len(rows))], [{} for _ in rows])
    return handler.handle(rows, ctx), ctx


def _unit(vec: Any) -> np.ndarray:
    arr = np.asarray(vec, dtype=np.float32)
    assert arr.shape[-1] == DIM
    np.testing.assert_allclose(np.linalg.norm(arr, axis=-1), 1.0, atol=1e-5)
    return arr


def test_every_request_form_answers_its_own_shape(handler: Any) -> None:
    a, b = sentences("heldout")[:2]
    rows = [
        {"body": a},  # text/plain (TorchServe decodes text/* to str)
        {"body": a.encode()},  # raw bytes of plain text
        {"body": json.dumps(a).encode()},  # a JSON string as raw bytes
        {"body": [a, b]},  # application/json list, already parsed
        {"data": json.dumps({"text": [a, b]}).encode()},  # gRPC `data`, object with a list
        {"body": {"text": b}},
        {"tensors": {"whatever": np.array([a.encode(), b.encode()], dtype=object).reshape(2, 1)}},
    ]
    out, ctx = _run(handler, rows)
    expect = handler.embed([a, b])
    for i in (0, 1, 2):
        np.testing.assert_allclose(_unit(out[i]["embedding"]), expect[0], atol=1e-6)
    for i in (3, 4):
        np.testing.assert_allclose(_unit(out[i]["embeddings"]), expect, atol=1e-6)
    np.testing.assert_allclose(_unit(out[5]["embedding"]), expect[1], atol=1e-6)
    tensor = out[6]["tensors"]["embedding"]
    assert tensor.dtype == np.float32
    assert tensor.shape == (2, DIM)
    np.testing.assert_allclose(tensor, expect, atol=1e-6)
    assert all(ctx.get_response_status(i)[0] == 200 for i in range(len(rows)))


def test_text_that_only_looks_like_json_is_one_text(handler: Any) -> None:
    text = "[1] is cited in the references section of the iris description."
    out, _ = _run(handler, [{"body": text.encode()}])
    np.testing.assert_allclose(out[0]["embedding"], handler.embed([text])[0], atol=1e-6)


BAD = [
    ({"body": b""}, "empty"),
    ({"body": "   \n"}, "empty"),
    ({"body": b"\xff\xfe not utf-8"}, "UTF-8"),
    ({"body": []}, "empty"),
    ({"body": ["fine", 3]}, "text 1 must be a string"),
    ({"body": ["fine", None]}, "null"),
    ({"body": ["fine", ""]}, "text 1 is empty"),
    ({"body": {"txt": "typo"}}, '"text"'),
    ({"body": {"text": 5}}, "must be a string"),
    ({"body": 42}, "not a text"),
    ({"body": ["x"] * 65}, "at most 64"),
    ({"tensors": {"a": np.array([b"x"], dtype=object), "b": np.array([b"y"], dtype=object)}}, "exactly one"),
    ({"tensors": {"text": np.zeros((2, 3), dtype=np.float32)}}, "BYTES"),
    ({"tensors": {"text": np.array([b"ok", b"\xc3\x28"], dtype=object)}}, "text[1] is not valid UTF-8"),
    ({}, "empty request"),
]


@pytest.mark.parametrize(("row", "needle"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_request_gets_400_alone_and_its_batch_mates_are_answered(
    handler: Any, row: Any, needle: str
) -> None:
    good = sentences("heldout")[3]
    out, ctx = _run(handler, [{"body": good}, row, {"body": [good]}])
    assert out[1]["code"] == 400
    assert needle in out[1]["error"]
    assert ctx.get_response_status(1) == (400, out[1]["error"])
    assert "embedding" not in out[1]
    expect = handler.embed([good])[0]
    np.testing.assert_allclose(out[0]["embedding"], expect, atol=1e-6)
    np.testing.assert_allclose(out[2]["embeddings"][0], expect, atol=1e-6)
    assert ctx.get_response_status(0)[0] == ctx.get_response_status(2)[0] == 200


def test_a_batch_of_only_bad_requests_is_all_400(handler: Any) -> None:
    out, ctx = _run(handler, [{"body": b""}, {"body": [1]}])
    assert [o["code"] for o in out] == [400, 400]
    assert [ctx.get_response_status(i)[0] for i in range(2)] == [400, 400]


def test_padding_to_max_length_gives_the_same_vectors_as_padding_to_longest(
    handler: Any, staged_root: Path
) -> None:
    fixed = _load(_stage(staged_root, "minilm_fixed", padding="max_length"))
    texts = mixed_length(6, seed=3, lo=5, hi=120)
    lengths = [len(ids) for ids in handler.rules.encode(texts)]
    assert max(lengths) < 256  # so max_length padding really pads every row
    assert min(lengths) < max(lengths)  # and longest padding pads some
    np.testing.assert_allclose(fixed.embed(texts), handler.embed(texts), atol=1e-5)


def test_budget_split_batches_give_the_same_vectors(handler: Any, staged_root: Path) -> None:
    """maxBatchTokens small enough that the batch runs as several forwards."""
    staged = _stage(staged_root, "minilm_small_budget")
    staged.model_config["maxBatchTokens"] = 256
    small = _load(staged)
    texts = mixed_length(5, seed=4, lo=40, hi=120)
    np.testing.assert_allclose(small.embed(texts), handler.embed(texts), atol=1e-5)


def test_over_long_text_is_truncated_or_refused_per_config(handler: Any, staged_root: Path) -> None:
    long_text = mixed_length(1, seed=5, lo=400, hi=450)[0]
    head = long_text[: len(long_text) // 3]
    assert len(handler.rules.encode([long_text])[0]) == 256  # [CLS] + 254 pieces + [SEP]
    out, ctx = _run(handler, [{"body": long_text}])
    assert ctx.get_response_status(0)[0] == 200
    _unit(out[0]["embedding"])

    strict = _load(_stage(staged_root, "minilm_strict", truncate=False))
    out, ctx = _run(strict, [{"body": head}, {"body": [head, long_text]}, {"body": head}])
    assert out[1]["code"] == 400
    assert "text 1 has" in out[1]["error"]
    assert "at most 256" in out[1]["error"]
    assert ctx.get_response_status(1)[0] == 400
    np.testing.assert_allclose(out[0]["embedding"], out[2]["embedding"], atol=1e-6)
    np.testing.assert_allclose(out[0]["embedding"], handler.embed([head])[0], atol=1e-6)


def test_bad_handler_config_fails_the_load(staged_root: Path) -> None:
    with pytest.raises(ValueError, match="padding must be longest or max_length"):
        _load(_stage(staged_root, "minilm_badpad", padding="shortest"))
    with pytest.raises(ValueError, match="truncate must be true or false"):
        _load(_stage(staged_root, "minilm_badtrunc", truncate="yes"))
    with pytest.raises(ValueError, match="format must be one of"):
        _load(_stage(staged_root, "minilm_badfmt", format="tensorrt"))


def test_encoder_matches_sentence_transformers(handler: Any) -> None:
    """The one-module encoder + archive tokenizer rules == sentence-transformers' encode(),
    including a text past the 256-piece cap (truncation the same way)."""
    texts = [*sentences("heldout")[:6], *mixed_length(1, seed=8, lo=300, hi=350)]
    ours = handler.embed(texts)
    theirs = oracle_embeddings(weights_dir(), texts)
    assert np.abs(ours - theirs).max() <= 1e-5


def test_staged_tokenizer_has_no_builtin_truncation_or_padding(staged_root: Path) -> None:
    staged = _stage(staged_root, "minilm_tok")
    raw = json.loads((staged.dir / "tokenizer.json").read_text())
    original = json.loads((weights_dir() / "tokenizer.json").read_text())
    assert original["truncation"] is not None
    assert original["padding"] is not None
    assert raw["truncation"] is None
    assert raw["padding"] is None
    assert staged.model_config["tokenCounter"] == {"tokenizer": "tokenizer.json", "maxLength": 256}
    assert staged.model_config["maxBatchTokens"] == package.MAX_BATCH_TOKENS
    assert staged.model_config["signature"]["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [-1, DIM]}
    ]


@pytest.mark.parametrize("name", ["minilm_handler.py", "minilm_text.py"])
def test_handler_modules_load_under_torchserve_rules(name: str) -> None:
    """TorchServe's loader takes the one class a handler module defines; neither module may
    import `ts` (Mariner runs them without TorchServe installed)."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[2] / "handlers" / name).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "ts" not in imported
    assert "mariner" not in imported  # the archive carries these files, not the mariner package
    if name == "minilm_handler.py":
        classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
        assert classes == ["MiniLMHandler"]


def test_bf16_autocast_on_the_cpu_stays_close_to_fp32(handler: Any, staged_root: Path) -> None:
    bf16 = _load(_stage(staged_root, "minilm_bf16", autocast="bf16"))
    texts = sentences("heldout")[:8]
    ours, ref = bf16.embed(texts), handler.embed(texts)
    assert ours.dtype == np.float32
    cos = (ours * ref).sum(axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99
    assert np.abs(ours - ref).max() > 0  # bf16 really ran: the vectors are not fp32's


def test_accel_settings_are_refused_for_formats_they_do_not_apply_to(staged_root: Path) -> None:
    staged = _stage(staged_root, "minilm_onnx_accel", autocast="bf16")
    staged.model_config["handler"]["format"] = "onnx"
    with pytest.raises(ValueError, match="apply to the eager format only"):
        _load(staged)
