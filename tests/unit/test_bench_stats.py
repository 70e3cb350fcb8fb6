"""Mariner's batch statistics per benchmark measurement: parsed from real exposition text of
prometheus_client histograms, differenced per measurement, reported per server at the top level.

Nothing is started or timed: histograms are observed by hand with known values.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from mariner.loadtest.server_stats import BatchStats, difference, parse

pytestmark = pytest.mark.unit


def exposition(
    batches: list[tuple[int, float]], tokens: list[tuple[int, int]], other_model: bool = True
) -> str:
    """Histograms shaped like Mariner's: per batch (items, handler seconds); per batch (padded,
    unpadded) tokens; one queue observation of 0.5 s per item."""
    reg = CollectorRegistry()
    size = Histogram("mariner_batch_size", "", ("model", "version"), registry=reg, buckets=(1, 8, 32))
    compute = Histogram("mariner_compute_duration_seconds", "", ("model", "version"), registry=reg)
    queue = Histogram("mariner_queue_duration_seconds", "", ("model", "version"), registry=reg)
    tok = Histogram("mariner_batch_tokens", "", ("model", "version", "kind"), registry=reg)
    for items, seconds in batches:
        size.labels("minilm_onnx", "1.0").observe(items)
        compute.labels("minilm_onnx", "1.0").observe(seconds)
        for _ in range(items):
            queue.labels("minilm_onnx", "1.0").observe(0.5)
    for padded, unpadded in tokens:
        tok.labels("minilm_onnx", "1.0", "padded").observe(padded)
        tok.labels("minilm_onnx", "1.0", "unpadded").observe(unpadded)
    if other_model:  # another model's figures never leak into this one's
        size.labels("digits_eager", "1.0").observe(30)
        compute.labels("digits_eager", "1.0").observe(100.0)
    return generate_latest(reg).decode()


def test_parse_sums_the_models_histograms_only() -> None:
    got = parse(exposition([(32, 2.0), (16, 1.0)], [(3200, 2000)]), "minilm_onnx")
    assert got["items_count"] == 2
    assert got["items_sum"] == 48
    assert got["compute_sum"] == pytest.approx(3.0)
    assert got["queue_count"] == 48
    assert got["queue_sum"] == pytest.approx(24.0)
    assert got["tokens_padded"] == 3200
    assert got["tokens_unpadded"] == 2000
    assert parse(exposition([], []), "resnet18_onnx") == {}


def test_difference_belongs_to_the_measurement_alone() -> None:
    before = parse(exposition([(32, 2.0)], [(3200, 2000)]), "minilm_onnx")
    after = parse(
        exposition([(32, 2.0), (16, 1.0), (16, 3.0)], [(3200, 2000), (1000, 900), (1000, 500)]), "minilm_onnx"
    )
    s = difference(before, after, server="mariner", protocol="http", concurrency=64, repeat=1)
    assert s is not None
    assert (s.batches, s.items) == (2, 32)
    assert s.mean_batch == 16
    assert s.compute_ms_per_batch == pytest.approx(2000.0)
    assert s.queue_ms_per_request == pytest.approx(500.0)
    assert s.padded_tokens_per_batch == 1000
    assert s.padding_share == pytest.approx(1 - 1400 / 2000)
    assert difference({}, after, server="m", protocol="http", concurrency=64, repeat=0) is None


def test_a_model_without_a_token_counter_has_no_padding_figures() -> None:
    before = parse(exposition([(32, 2.0)], []), "minilm_onnx")
    after = parse(exposition([(32, 2.0), (8, 1.0)], []), "minilm_onnx")
    s = difference(before, after, server="m", protocol="http", concurrency=8, repeat=0)
    assert s is not None
    assert math.isnan(s.padded_tokens_per_batch)
    assert math.isnan(s.padding_share)
    empty = BatchStats("m", "http", 8, 0, 0, 0, 0.0, 0.0, 0)
    assert math.isnan(empty.mean_batch)
    assert math.isnan(empty.compute_ms_per_batch)
    assert math.isnan(empty.queue_ms_per_request)
