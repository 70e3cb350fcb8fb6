"""Request bodies for the load tools: real digits from the held-out test split, not constants.

A constant payload lets every cache on the way (and a handler's branch predictor) look better
than real traffic does; the 270 test-set digits are what the model was verified on, so the
load tools send those, as the JSON list of 64 integer intensities the README documents.
"""

from __future__ import annotations

import json
from functools import cache


@cache
def test_digit_bodies() -> tuple[bytes, ...]:
    """The test split (mariner.training.data.load_splits, seeded) as JSON bodies, one per digit.

    Imports torch and scikit-learn (through mariner.training.data), so callers that fan out to many
    processes compute this once and pass the bytes on.
    """
    from mariner.training.data import load_splits

    test = load_splits().test
    return tuple(json.dumps([int(v) for v in row]).encode() for row in test.x)
