"""Request bodies for the load tools: real digits from the held-out test split, not constants.

A constant payload lets every cache on the way (and a handler's branch predictor) look better
than real traffic does; the 270 test-set digits are what the model was verified on, so the
load tools send those, as the JSON list of 64 integer intensities the README documents (the
TorchServe API) or as an FP32 [1, 64] `pixels` tensor (the Open Inference Protocol).
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np


@cache
def test_digits() -> tuple[np.ndarray, np.ndarray]:
    """The test split (mariner.training.data.load_splits, seeded): (pixels (N, 64) float32, labels).

    Imports torch and scikit-learn (through mariner.training.data) and rebuilds the split (about
    3 s on a small machine), so callers prepare this before any clock starts, and callers that
    fan out to many processes compute it once and pass the bytes on.
    """
    from mariner.training.data import load_splits

    test = load_splits().test
    return test.x, test.y


@cache
def test_digit_bodies() -> tuple[bytes, ...]:
    """The test split as TorchServe-API JSON bodies, one per digit."""
    return tuple(json.dumps([int(v) for v in row]).encode() for row in test_digits()[0])
