"""What an archive's model-config YAML says for serving: its settings layer, and its
length-aware batching settings (`maxBatchTokens`, `tokenCounter`).

Kept apart from `model_settings` because only the archive gives these: its keys are checked for
near misses of ours (the rest are the handler's), its deviceIds for the worker pool, and its
tokenizer path against the unpacked archive's files.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from mariner.server.common.archive_fields import inside
from mariner.server.common.model_settings import TS_KEY_ALIASES, TS_KEYS, SettingsOverrides
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.setting_values import bad_value as _bad
from mariner.server.contracts.setting_values import device_ids as _device_ids
from mariner.server.contracts.setting_values import positive_int as _positive_int

log = logging.getLogger("mariner.management")

# The archive's length-aware batching keys (see `token_settings`).
TOKEN_KEYS = ("maxBatchTokens", "tokenCounter")
_TOKEN_COUNTER_KEYS = frozenset({"tokenizer", "maxLength"})
DEFAULT_TOKEN_MAX_LENGTH = 512  # BERT-style encoders' position limit, when tokenCounter omits it


def _misspelt(key: str) -> str | None:
    """The key of ours `key` almost is (batch_size, BatchSize -> batchSize), else None."""
    folded = key.replace("_", "").replace("-", "").lower()
    known = (*TS_KEYS.values(), *TS_KEY_ALIASES.values(), *TOKEN_KEYS)
    return next((ts for ts in known if ts.lower() == folded and ts != key), None)


def archive_overrides(model_config: Mapping[str, Any], archive_file: str) -> SettingsOverrides:
    """The archive's model-config YAML as a layer. Keys other than TorchServe's are the
    handler's, except a near miss of one of ours (`batch_size`): that is a typo that would
    silently leave the default in place, so it is refused naming the key meant."""
    source = f"the model-config of {archive_file}"
    for key in model_config:
        meant = _misspelt(str(key))
        if meant is not None:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"model-config key {key!r} is not one the server reads; did you mean {meant!r}? "
                f"(from {source})",
            )
    layer = SettingsOverrides.parse(model_config, source)
    _device_ids("deviceIds", model_config.get("deviceIds"), source)  # read by the worker pool
    if layer.min_workers == 0:
        # TorchServe reads an archive's minWorkers only when it is above 0 (ModelServer and
        # ApiUtils.handleRegister): 0 leaves the count to the server, as there.
        log.warning("%s: minWorkers 0 is ignored, as TorchServe ignores it; the server's worker count "
                    "applies", source)  # fmt: skip
        layer = replace(layer, min_workers=None, max_workers=None)
    return layer


@dataclass(frozen=True)
class TokenSettings:
    """An archive's length-aware batching settings (model-config `maxBatchTokens` and
    `tokenCounter`), for models that pad each batch to its longest member.

    `max_batch_tokens` is the budget of padded tokens per batch (rows x longest row, as TEI's
    max_batch_tokens); None counts tokens without a budget (batches are still grouped by
    length). `tokenizer` is the tokenizer.json path as the archive names it; `tokenizer_file`
    the file it resolves to inside the unpacked archive (None when read without the archive's
    directory, as a worker does, which needs only the budget).

    These keys are read from the archive only: the tokenizer is a file of the archive, and the
    budget is tied to the model (its memory per padded token), so a worker merging batches from
    several frontends reads the same budget from the same model-config.
    """

    max_batch_tokens: int | None
    tokenizer: str
    max_length: int
    tokenizer_file: Path | None = None


def token_settings(
    model_config: Mapping[str, Any], archive_file: str, model_dir: Path | None = None
) -> TokenSettings | None:
    """The archive's token settings, checked; None when it sets neither key (batching as before).

    With `model_dir` (the unpacked archive), the tokenizer path must resolve to a file inside it
    (symlinks followed), as every file an archive names must. Errors are ServingError
    (INVALID_ARGUMENT) naming the key, the value, what is allowed and the archive.
    """
    source = f"the model-config of {archive_file}"
    budget_value = model_config.get("maxBatchTokens")
    counter = model_config.get("tokenCounter")
    if budget_value is None and counter is None:
        return None
    budget = None if budget_value is None else _positive_int("maxBatchTokens", budget_value, source)
    if counter is None:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            "maxBatchTokens needs tokenCounter ({tokenizer: <tokenizer.json in the archive>, "
            f"maxLength: <int>}}) to count each request's tokens (from {source})",
        )
    allowed = "a mapping {tokenizer: <path of a tokenizer.json inside the archive>, maxLength: <int>}"
    if not isinstance(counter, Mapping) or not set(counter) <= _TOKEN_COUNTER_KEYS:
        raise _bad("tokenCounter", allowed, counter, source)
    tokenizer = counter.get("tokenizer")
    if not isinstance(tokenizer, str) or not tokenizer.strip():
        raise _bad(
            "tokenCounter.tokenizer", "the path of a tokenizer.json inside the archive", tokenizer, source
        )
    outside = (
        PurePosixPath(tokenizer).is_absolute()
        or tokenizer.startswith(("/", "\\"))
        or ".." in PurePosixPath(tokenizer.replace("\\", "/")).parts
    )
    resolved = None
    if not outside and model_dir is not None:
        resolved = inside(model_dir, tokenizer)
        outside = resolved is None
    if outside:
        raise _bad(
            "tokenCounter.tokenizer",
            "a relative path inside the archive (no '..', no absolute path, no symlink out)",
            tokenizer,
            source,
        )
    if resolved is not None and not resolved.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"tokenCounter.tokenizer {tokenizer!r} is not a file of the archive (from {source})",
        )
    max_length = DEFAULT_TOKEN_MAX_LENGTH
    if counter.get("maxLength") is not None:
        max_length = _positive_int("tokenCounter.maxLength", counter["maxLength"], source)
    return TokenSettings(budget, tokenizer, max_length, resolved)
