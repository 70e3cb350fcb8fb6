"""Cutting one tensor request into row chunks and joining the chunks' answers.

A batch holds at most `batchSize` items, but one Open Inference Protocol request may carry any
number of rows, and a model's activations grow with the rows of one forward pass: one request of
100,000 rows could allocate tens of GB on the device. The runner therefore never hands a handler
more than `max_rows` rows of one request (`ModelHost`), and halves a request's rows when even
one request runs out of memory. Outputs are joined along their first dimension, which must be the
row dimension (the same contract the batcher relies on when it stacks requests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult

MAX_ROWS_KEY = "maxRowsPerCall"  # model-config key; TorchServe ignores keys it does not know
DEFAULT_ROWS_PER_BATCH_SIZE = 4  # default cap: this many times the model's batchSize


def max_rows_for(model_config: Mapping[str, Any], batch_size: int) -> int:
    """Rows one handler call may take from a single tensor request: the model-config's
    `maxRowsPerCall`, else 4 x batchSize (room for clients that send a few rows per request,
    without letting one request build activations for thousands)."""
    raw = model_config.get(MAX_ROWS_KEY)
    if raw is None:
        return max(1, DEFAULT_ROWS_PER_BATCH_SIZE * batch_size)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 1 or isinstance(raw, bool) or (isinstance(raw, float) and raw != value):
        raise ServingError(Code.INVALID_ARGUMENT, f"{MAX_ROWS_KEY} must be an integer >= 1, got {raw!r}")
    return value


def splittable(req: InferRequest) -> bool:
    """Whether `req` is a tensor request of several rows whose every input has them first."""
    return (
        req.tensors is not None
        and req.items > 1
        and all(getattr(a, "shape", ())[:1] == (req.items,) for a in req.tensors.values())
    )


def split_rows(req: InferRequest, rows: int) -> list[InferRequest]:
    """`req` as consecutive requests of at most `rows` rows each (same id, headers, deadline)."""
    assert req.tensors is not None
    out = []
    for start in range(0, req.items, rows):
        stop = min(start + rows, req.items)
        tensors = {name: a[start:stop] for name, a in req.tensors.items()}
        out.append(dataclasses.replace(req, tensors=tensors, items=stop - start))
    return out


def join_rows(parts: Sequence[InferResult], rows: Sequence[int]) -> InferResult:
    """One answer from the answers of a request's chunks (`rows[i]` rows each).

    A chunk the handler answered with an error status (or without tensors) is the answer: the
    request failed. Outputs whose first dimension is not the chunk's rows cannot be joined."""
    for part in parts:
        if part.status != 200 or part.tensors is None:
            return part
    first = parts[0]
    assert first.tensors is not None
    joined: dict[str, np.ndarray] = {}
    for name in first.tensors:
        arrays = [np.asarray(p.tensors[name]) for p in parts if p.tensors is not None and name in p.tensors]
        if len(arrays) != len(parts) or any(a.shape[:1] != (n,) for a, n in zip(arrays, rows, strict=True)):
            raise ServingError(
                Code.INTERNAL,
                f"the model's output {name!r} has no row dimension, so a request split into chunks "
                f"of rows cannot be answered; raise the model's {MAX_ROWS_KEY} or send fewer rows",
            )
        joined[name] = np.concatenate(arrays, axis=0)
    return dataclasses.replace(first, tensors=joined)
