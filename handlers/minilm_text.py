"""Requests -> texts -> padded token arrays, for the MiniLM handler.

Split out of `minilm_handler.py` because TorchServe's loader wants exactly one class in a
handler module and because the decoding rules are the contract other code reads too (the
frontend's token counter groups requests by the same texts). Shipped beside the handler in the
archive and imported by path; it imports only numpy, json and tokenizers.

One request is one of:
    text/plain UTF-8 body (one text)            -> {"embedding": [384 floats]}
    JSON string (one text)                      -> {"embedding": [...]}
    JSON list of strings (several texts)        -> {"embeddings": [[...], ...]}
    JSON object {"text": str | list[str]}       -> as a string or a list
    Open Inference Protocol BYTES tensor, any name, shape [N] or [N, 1], UTF-8 elements
                                                -> tensor "embedding" FP32 [N, 384]
Raw bytes of unknown type are UTF-8 text, read as JSON when they start like JSON and parse.
Anything else (empty text, non-UTF-8 bytes, a non-string item, too many texts) is a ValueError
whose message says what is allowed; the handler answers it with 400 for that request only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAX_TEXTS_PER_REQUEST = 64  # JSON lists; tensor requests are cut into row chunks by the server
_ALLOWED = (
    "send one text as a text/plain body or JSON string, several as a JSON list of strings, "
    'or a JSON object {"text": ...}'
)


@dataclass(frozen=True)
class Texts:
    """A request's texts and how its answer is shaped: "one", "list" or "tensor"."""

    texts: tuple[str, ...]
    kind: str


def _check_text(value: Any, where: str) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where} is not valid UTF-8 text") from None
    if not isinstance(value, str):
        shown = "null" if value is None else type(value).__name__
        raise ValueError(f"{where} must be a string, got {shown}; {_ALLOWED}")
    if not value.strip():
        raise ValueError(f"{where} is empty; texts must contain at least one non-space character")
    return value


def _from_list(items: list[Any], cap: int) -> Texts:
    if not items:
        raise ValueError(f"the list of texts is empty; send 1 to {cap} strings")
    if len(items) > cap:
        raise ValueError(f"{len(items)} texts in one request; at most {cap} are allowed (split the request)")
    return Texts(tuple(_check_text(v, f"text {i}") for i, v in enumerate(items)), "list")


def _from_json(value: Any, cap: int) -> Texts:
    if isinstance(value, str):
        return Texts((_check_text(value, "the text"),), "one")
    if isinstance(value, list):
        return _from_list(value, cap)
    if isinstance(value, dict):
        if set(value) != {"text"}:
            raise ValueError(f'a JSON object must have exactly one key, "text", got {sorted(value)[:5]}')
        inner = value["text"]
        if isinstance(inner, list):
            return _from_list(inner, cap)
        return Texts((_check_text(inner, '"text"'),), "one")
    raise ValueError(f"a JSON {type(value).__name__} is not a text; {_ALLOWED}")


def _from_tensors(tensors: dict[str, np.ndarray]) -> Texts:
    if len(tensors) != 1:
        raise ValueError(
            f"send exactly one BYTES input of texts, got {len(tensors)} inputs {sorted(tensors)}"
        )
    ((name, arr),) = tensors.items()
    if arr.dtype.kind not in "OSU" or not (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[1] == 1)):
        raise ValueError(
            f"input {name!r} must be BYTES of shape [N] or [N, 1], got {arr.dtype} {list(arr.shape)}"
        )
    if arr.shape[0] == 0:
        raise ValueError(f"input {name!r} holds no texts; send at least one")
    return Texts(tuple(_check_text(v, f"{name}[{i}]") for i, v in enumerate(arr.reshape(-1))), "tensor")


def is_tensor_request(row: Any) -> bool:
    """Mariner's OIP path hands numpy arrays, which JSON from a client can never produce."""
    tensors = row.get("tensors") if isinstance(row, dict) else None
    return (
        isinstance(tensors, dict)
        and bool(tensors)
        and all(isinstance(v, np.ndarray) for v in tensors.values())
    )


def decode_request(row: Any, cap: int = MAX_TEXTS_PER_REQUEST) -> Texts:
    """One TorchServe-shaped request (`data`/`body`/`tensors`) -> its texts; ValueError if bad."""
    if is_tensor_request(row):
        return _from_tensors(row["tensors"])
    if not isinstance(row, dict):
        raise ValueError(f"a request is a mapping with 'data' or 'body', got {type(row).__name__}")
    payload = row.get("data") if row.get("data") is not None else row.get("body")
    if payload is None:
        raise ValueError(f"empty request; {_ALLOWED}")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        text = _check_text(payload, "the body")
        stripped = text.lstrip()
        if stripped[:1] in ('"', "[", "{"):
            try:
                return _from_json(json.loads(text), cap)
            except (json.JSONDecodeError, RecursionError):
                pass  # text that merely starts like JSON is one text
        return Texts((text,), "one")
    return _from_json(payload, cap)


@dataclass(frozen=True)
class Batch:
    """Token arrays for a forward pass: int64 [rows, length], padding id 0, mask 0 on padding."""

    input_ids: np.ndarray
    attention_mask: np.ndarray


class TokenizerRules:
    """The archive's tokenizer.json with the handler section's padding and truncation rules.

    The stock all-MiniLM tokenizer.json truncates at 128 and pads to 128; both are switched off
    and applied here instead, so `maxLength` (256, what sentence-transformers uses) and
    `padding` mean what model-config says.
    """

    def __init__(self, tokenizer_json: Path, *, max_length: int, padding: str, truncate: bool) -> None:
        from tokenizers import Tokenizer

        if padding not in ("longest", "max_length"):
            raise ValueError(f"handler.padding must be longest or max_length, got {padding!r}")
        if max_length < 3:
            raise ValueError(f"handler.maxLength must be at least 3 (two special tokens), got {max_length}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_length = max_length
        self.padding = padding
        self.truncate = truncate
        sep = self.tokenizer.token_to_id("[SEP]")
        if sep is None:
            raise ValueError(f"{tokenizer_json} has no [SEP] token")
        self.sep_id = sep

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Ids per text, with [CLS]/[SEP]; an over-long text is cut (keeping [SEP]) when
        `truncate`, else left long for `too_long` to report."""
        out = [e.ids for e in self.tokenizer.encode_batch(texts)]
        if self.truncate:
            cut = self.max_length - 1
            out = [ids if len(ids) <= self.max_length else [*ids[:cut], self.sep_id] for ids in out]
        return out

    def too_long(self, ids: list[int]) -> bool:
        return len(ids) > self.max_length

    def pad(self, rows: list[list[int]], length: int | None = None) -> Batch:
        """Rows padded to `length`, else to the longest row (padding: longest) or maxLength."""
        if length is None:
            length = max(map(len, rows)) if self.padding == "longest" else self.max_length
        ids = np.zeros((len(rows), length), dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return Batch(ids, mask)


def chunks(lengths: list[int], padded_to: int | None, max_tokens: int) -> list[list[int]]:
    """Row indices grouped so each group's padded tokens (rows x longest) stay within max_tokens.

    One group when the whole batch fits (the usual case: one forward per batch). Otherwise rows
    are taken shortest first, so long texts do not pad short ones; a single row is always allowed.
    """

    def cost(group: list[int]) -> int:
        return len(group) * (padded_to or max(lengths[i] for i in group))

    everything = list(range(len(lengths)))
    if not everything or cost(everything) <= max_tokens:
        return [everything] if everything else []
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(everything, key=lambda k: lengths[k]):
        if current and cost([*current, i]) > max_tokens:
            groups.append(current)
            current = []
        current.append(i)
    groups.append(current)
    return groups
