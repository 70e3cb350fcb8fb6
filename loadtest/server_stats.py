"""What happened inside Mariner during one measurement, from its own /metrics: batches formed,
the handler's time per batch, the queue wait per request and, for a model with a token counter,
the padded tokens per batch.

When a model's batch takes seconds, the closed-loop figures alone cannot say whether a server
lost throughput to its transport, to its queue or to the model; the server's own histograms can.
The benchmark scrapes Mariner's metrics endpoint before and after each measurement and keeps the
difference (histogram sums and counts are cumulative), so every figure belongs to that
measurement alone. TorchServe has no such per-batch histograms, so this is Mariner's side only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import requests

# metric -> key prefix; histograms expose _sum and _count
HISTOGRAMS = {
    "mariner_batch_size": "items",
    "mariner_compute_duration_seconds": "compute",
    "mariner_queue_duration_seconds": "queue",
}
TOKENS = "mariner_batch_tokens"


def parse(text: str, model: str) -> dict[str, float]:
    """Sums and counts of the batch histograms for `model` (all versions) from exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            for metric, key in HISTOGRAMS.items():
                if s.name == f"{metric}_sum":
                    out[f"{key}_sum"] = out.get(f"{key}_sum", 0.0) + s.value
                elif s.name == f"{metric}_count":
                    out[f"{key}_count"] = out.get(f"{key}_count", 0.0) + s.value
            if s.name == f"{TOKENS}_sum":
                key = f"tokens_{s.labels.get('kind', '')}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(metrics_url: str, model: str) -> dict[str, float]:
    """The counters now; empty when the endpoint does not answer (the stats are then n/a)."""
    with contextlib.suppress(requests.RequestException):
        r = requests.get(f"{metrics_url}/metrics", timeout=5)
        if r.status_code == 200:
            return parse(r.text, model)
    return {}


@dataclass(frozen=True)
class BatchStats:
    """One measurement's share of Mariner's batch histograms (after minus before)."""

    server: str
    protocol: str
    concurrency: int
    repeat: int
    batches: float
    items: float
    compute_s: float
    queue_s: float
    queued: float  # requests that waited in the queue (one queue observation each)
    padded_tokens: float = math.nan  # rows x longest row, summed over batches
    unpadded_tokens: float = math.nan  # each request padded only to its own longest

    @property
    def mean_batch(self) -> float:
        return self.items / self.batches if self.batches else math.nan

    @property
    def compute_ms_per_batch(self) -> float:
        return self.compute_s / self.batches * 1e3 if self.batches else math.nan

    @property
    def queue_ms_per_request(self) -> float:
        return self.queue_s / self.queued * 1e3 if self.queued else math.nan

    @property
    def padded_tokens_per_batch(self) -> float:
        """NaN without a token counter (the histogram is then absent, or present but empty)."""
        if not self.batches or not self.padded_tokens or math.isnan(self.padded_tokens):
            return math.nan
        return self.padded_tokens / self.batches

    @property
    def padding_share(self) -> float:
        """Share of the computed tokens that were padding to a batch's longest row."""
        if not self.padded_tokens or math.isnan(self.padded_tokens):
            return math.nan
        return 1.0 - self.unpadded_tokens / self.padded_tokens


def difference(
    before: dict[str, float],
    after: dict[str, float],
    *,
    server: str,
    protocol: str,
    concurrency: int,
    repeat: int,
) -> BatchStats | None:
    """The measurement's stats; None when either scrape failed."""
    if not before or not after:
        return None

    def d(key: str, missing: float = 0.0) -> float:
        if key not in after:
            return missing
        return after[key] - before.get(key, 0.0)

    return BatchStats(
        server=server,
        protocol=protocol,
        concurrency=concurrency,
        repeat=repeat,
        batches=d("items_count"),
        items=d("items_sum"),
        compute_s=d("compute_sum"),
        queue_s=d("queue_sum"),
        queued=d("queue_count"),
        padded_tokens=d("tokens_padded", math.nan),
        unpadded_tokens=d("tokens_unpadded", math.nan),
    )
