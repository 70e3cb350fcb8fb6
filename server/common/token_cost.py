"""What one request costs a text model that pads each batch to its longest member, counted in the
frontend before the request is queued.

A sentence encoder pads a batch to its longest text: a 5-token text batched with a 200-token one
costs 200 tokens of compute. With the archive's `tokenCounter` the frontend counts each request's
word pieces (rows and longest row) with the archive's tokenizer.json, so the batcher can group
requests of similar length and keep every batch's padded tokens (rows x longest) within
`maxBatchTokens`, as TEI's max_batch_tokens does.

The tokenizer.json is data read by the `tokenizers` library, never code from the archive. Texts
are found the way the MiniLM handler reads them (its `minilm_text` module is the contract): a
text/plain or raw UTF-8 body, a JSON string, a JSON list of strings, a JSON object {"text": str
| list[str]}, or an Open Inference Protocol BYTES tensor of UTF-8 texts. The counter never
raises into the caller: a request it cannot read as texts costs its rows x maxLength (the most
it could cost), and the handler answers it (usually 400 for that request alone).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mariner.server.common.archive_settings import TokenSettings, token_settings
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, TokenCost

log = logging.getLogger("mariner.tokens")

# More texts than this in one request are not encoded (the MiniLM handler takes at most 64): the
# request costs rows x maxLength, so counting never costs the event loop more than this many texts.
MAX_COUNTED_TEXTS = 256
# Each text is cut to this many characters per allowed token before encoding: a text that long
# has at least maxLength word pieces unless its words average more than this (English averages
# about 4.5 characters per MiniLM word piece), and a megabyte of text then costs the event loop
# what a few kilobytes do.
CHARS_PER_TOKEN_CAP = 10


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def _from_json(value: Any) -> list[str] | None:
    if isinstance(value, dict):
        if set(value) != {"text"}:
            return None
        value = value["text"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None


def _from_tensors(tensors: Mapping[str, np.ndarray]) -> list[str] | None:
    if len(tensors) != 1:
        return None
    (arr,) = tensors.values()
    if arr.dtype.kind not in "OSU" or not (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[1] == 1)):
        return None
    texts = [_text(v) for v in arr.reshape(-1)]
    strings = [t for t in texts if t is not None]
    return strings if texts and len(strings) == len(texts) else None


def texts_of(req: InferRequest) -> list[str] | None:
    """The request's texts as the MiniLM handler reads them, or None when it holds none."""
    if req.tensors is not None:
        return _from_tensors(req.tensors)
    row = req.data
    payload: Any = row
    if "data" in row or "body" in row:
        payload = row.get("data") if row.get("data") is not None else row.get("body")
    if isinstance(payload, bytes | bytearray | memoryview):
        text = _text(payload)
        if text is None:
            return None
        if text.lstrip()[:1] in ('"', "[", "{"):
            try:
                parsed = _from_json(json.loads(text))
            except (json.JSONDecodeError, RecursionError):
                parsed = None  # text that merely starts like JSON is one text, as the handler says
            if parsed is not None:
                return parsed
        return [text]
    if isinstance(payload, Mapping) and not isinstance(payload, dict):
        payload = dict(payload)
    return _from_json(payload)


class TokenCounter:
    """Counts a request's texts in word pieces (capped at `max_length`) with a tokenizer.json,
    and carries the model's budget (`max_batch_tokens`, None for none) to the batcher."""

    def __init__(self, tokenizer: Any, *, max_length: int, max_batch_tokens: int | None) -> None:
        tokenizer.no_padding()  # the stock all-MiniLM file pads to 128: lengths must be the texts'
        tokenizer.no_truncation()  # the cap is applied here, at max_length
        self._tokenizer = tokenizer
        self.max_length = max_length
        self.max_batch_tokens = max_batch_tokens
        self._chars = max_length * CHARS_PER_TOKEN_CAP

    @classmethod
    def from_settings(cls, settings: TokenSettings) -> TokenCounter:
        """Load the tokenizer the settings name; a file the tokenizers library cannot read is a
        ServingError (INVALID_ARGUMENT) naming it."""
        from tokenizers import Tokenizer

        if settings.tokenizer_file is None:
            raise ValueError("token settings read without the archive's directory name no tokenizer file")
        try:
            tokenizer = Tokenizer.from_file(str(settings.tokenizer_file))
        except Exception as exc:  # the library raises bare Exception for a malformed file
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"tokenCounter.tokenizer {settings.tokenizer!r} is not a tokenizer.json the tokenizers "
                f"library can read ({str(exc)[:200]})",
            ) from None
        return cls(tokenizer, max_length=settings.max_length, max_batch_tokens=settings.max_batch_tokens)

    def fallback(self, req: InferRequest) -> TokenCost:
        """The cost of a request whose texts cannot be read: the most its rows could cost."""
        return TokenCost(max(1, req.items), self.max_length)

    def cost(self, req: InferRequest) -> TokenCost:
        """Rows and longest row of `req` in word pieces (special tokens included, as the model
        sees them), at most `max_length`; never raises."""
        try:
            texts = texts_of(req)
            if texts is None or len(texts) > MAX_COUNTED_TEXTS:
                return self.fallback(req)
            cut = self._chars
            texts = [t if len(t) <= cut else t[:cut] for t in texts]
            # The fast batch call skips character offsets (about 20% of the cost), which a count
            # does not need.
            longest = max(len(e) for e in self._tokenizer.encode_batch_fast(texts))
            return TokenCost(len(texts), max(1, min(longest, self.max_length)))
        except Exception:  # a counter bug must not fail the request: the handler still answers it
            log.exception("counting the tokens of request %s failed; using its largest cost", req.request_id)
            return self.fallback(req)


def load_token_counter(
    model_config: Mapping[str, Any], archive_file: str, model_dir: Path | None
) -> TokenCounter | None:
    """The archive's token counter, None when its model-config asks for none. Raises
    ServingError(INVALID_ARGUMENT) for bad keys, a tokenizer outside the archive or one that
    does not load, so an archive is refused when it is opened rather than at its first request."""
    settings = token_settings(model_config, archive_file, model_dir)
    if settings is None:
        return None
    return TokenCounter.from_settings(settings)


def token_counter_or_none(
    model_config: Mapping[str, Any], archive_file: str, model_dir: Path
) -> TokenCounter | None:
    """As `load_token_counter`, for a process that did not open the archive (a frontend): the
    supervisor already refused a bad one, so a failure here is logged and batching goes on
    without a token budget rather than taking the frontend down."""
    try:
        return load_token_counter(model_config, archive_file, model_dir)
    except Exception as exc:
        log.error("model archive %s: token counter not loaded, batching by rows only: %s", archive_file, exc)
        return None
