"""A copy of an archive that stock TorchServe serves over StreamPredictions2.

TorchServe 0.12 answers StreamPredictions2 only for a model with sequence batching: for any other
it fails on the first message (a NullPointerException on the model's null job groups; the stream
ends UNKNOWN). With `sequenceBatching: true` it serves the stream, but no longer serves unary
`Predictions` (its batch aggregator polls sequences only), so the benchmark runs this copy as a
TorchServe of its own (`torchserve-seq`) for its own stream figure. Only the model-config changes:
same handler, weights, batchSize and maxBatchDelay; one job group per client stream, so at most
`max_sequences` streams at once (TorchServe takes at least batchSize x workers).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import yaml

from mariner.loadtest.padding import config_name

IDLE_MS = 600_000  # a stream stays open for a whole measurement and its warm-up


def sequence_config(config: dict[str, object], max_sequences: int) -> dict[str, object]:
    """The model-config with TorchServe's sequence batching on, for `max_sequences` streams."""
    return {
        **config,
        "sequenceBatching": True,
        "sequenceMaxIdleMSec": IDLE_MS,
        "maxNumSequence": max_sequences,
        "maxSequenceJobQueueSize": 4,
    }


def sequence_copy(src: Path, dest_store: Path, max_sequences: int) -> Path:
    """Write `src` into `dest_store` (same file name) with `sequence_config`; the new path."""
    dest_store.mkdir(parents=True, exist_ok=True)
    dest = dest_store / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        name = config_name(zin)
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename == name:
                config = yaml.safe_load(data) or {}
                data = yaml.safe_dump(sequence_config(config, max_sequences), sort_keys=False).encode()
            zout.writestr(info, data)
    return dest
