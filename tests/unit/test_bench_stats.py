"""Mariner's batch statistics per benchmark measurement: parsed from real exposition text of
prometheus_client histograms, differenced per measurement, reported per server at the top level.

Nothing is started or timed: histograms are observed by hand with known values.
"""

from __future__ import annotations

import math
from typing import Any

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
    zero = BatchStats("m", "http", 8, 0, 10, 80, 5.0, 8.0, 80, 0.0, 0.0)  # histogram exposed, never observed
    assert math.isnan(zero.padded_tokens_per_batch)
    assert math.isnan(zero.padding_share)
    empty = BatchStats("m", "http", 8, 0, 0, 0, 0.0, 0.0, 0)
    assert math.isnan(empty.mean_batch)
    assert math.isnan(empty.compute_ms_per_batch)
    assert math.isnan(empty.queue_ms_per_request)


def test_report_shows_mariners_own_batches_at_the_top_level() -> None:
    from tests.unit.test_bench_workloads import cell, minilm_report

    report = minilm_report([cell("mariner", 90, 900, 0)], [100])
    report.batch_stats = [
        BatchStats("mariner", "http", 64, r, 10, 240, 20.0, 240.0, 240, 60000.0, 45000.0) for r in range(3)
    ] + [BatchStats("mariner", "http", 8, 0, 10, 80, 5.0, 8.0, 80)]  # a lower level: not shown
    from mariner.loadtest.bench_report import render_markdown

    text = render_markdown(report)
    assert "## Inside Mariner at c=64 (its /metrics)" in text
    assert "The raw ceiling's full batch of 32 took 320 ms (arrival order)." in text
    assert "| mariner | http | 3 | 24.0 | 2000 | 1000 | 6000 | 25% |" in text


async def _serve_then_close_idle(reader: Any, writer: Any) -> None:
    """Answer one request, then close the connection, as a keep-alive timer does when it idles."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    await writer.drain()
    writer.close()


def test_http_client_resends_once_on_a_keep_alive_connection_the_server_closed() -> None:
    import asyncio

    from mariner.loadtest.http_connection import HttpConnection

    async def main() -> tuple[int, int]:
        accepted = 0

        async def handler(reader: Any, writer: Any) -> None:
            nonlocal accepted
            accepted += 1
            await _serve_then_close_idle(reader, writer)

        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = HttpConnection("127.0.0.1", port, "/predictions/m", "text/plain")
        assert await conn.post(b"a") == (200, b"ok")
        await asyncio.sleep(0)  # the server's close is on its way; the client does not know yet
        assert await conn.post(b"b") == (200, b"ok")  # sent again on a new connection
        await conn.close()
        server.close()
        await server.wait_closed()
        return accepted, 2

    accepted, posts = asyncio.run(main())
    assert accepted == posts  # one connection per answer: the stale one was replaced, once


def test_http_client_does_not_resend_on_a_fresh_connection() -> None:
    import asyncio

    from mariner.loadtest.http_connection import HttpConnection

    async def main() -> None:
        async def slam(reader: Any, writer: Any) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.close()  # a server that drops the request: not a stale connection

        server = await asyncio.start_server(slam, "127.0.0.1", 0)
        conn = HttpConnection("127.0.0.1", server.sockets[0].getsockname()[1], "/p")
        with pytest.raises(asyncio.IncompleteReadError):
            await conn.post(b"a")
        server.close()
        await server.wait_closed()

    asyncio.run(main())
