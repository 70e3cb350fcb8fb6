"""The benchmark's comparisons across client set-ups and peers: the streams against TorchServe's
unary gRPC, Mariner's HTTP against mosec, and the plan that skips what a server does not serve.

Nothing is measured or started: results are built by hand with known figures.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mariner.loadtest import bench
from mariner.loadtest.bench_report import render_markdown, targets
from mariner.loadtest.bench_summary import Side, cross_ratios, median_cross, throughput
from mariner.loadtest.bench_values import PROTOCOLS, Running, default_servers, unserved
from mariner.loadtest.closedloop import LevelResult, client_layout
from mariner.loadtest.servers import MarinerProcess, Ports
from mariner.loadtest.stream_clients import stream_callers
from tests.unit.test_bench_report import cell, make_report, named

pytestmark = pytest.mark.unit


def stream_run() -> list[LevelResult]:
    """Three repeats at 64 clients; repeat 1 ran on a busy machine (everyone slower)."""
    levels: list[LevelResult] = []
    for rep, scale in enumerate([1.0, 0.4, 1.0]):
        levels += [
            cell("mariner", "grpc-stream", 64, 6000 * scale, repeat=rep),
            cell("mariner", "oip-stream", 64, 5000 * scale, repeat=rep),
            cell("mariner", "grpc", 64, 3000 * scale, repeat=rep),
            cell("torchserve", "grpc", 64, 2000 * scale if rep != 2 else 4000, repeat=rep),
            cell("mariner", "http", 64, 5000 * scale, repeat=rep),
            cell("torchserve", "http", 64, 2000 * scale, repeat=rep),
            cell("mosec", "http", 64, 10000 * scale, repeat=rep),
        ]
    for proto, p50 in [("grpc", 2.0), ("grpc-stream", 0.25), ("oip-stream", 0.5), ("http", 1.0)]:
        levels.append(cell("mariner", proto, 1, 500, p50_ms=p50))
    levels += [cell("torchserve", "grpc", 1, 100, p50_ms=3.0), cell("torchserve", "http", 1, 100, p50_ms=4.0)]
    return levels


def test_cross_ratios_pair_different_protocols_by_repeat() -> None:
    levels = stream_run()
    m, t = Side("mariner", "grpc-stream"), Side("torchserve", "grpc")
    # 6000/2000, 2400/800, 6000/4000: the busy repeat cancels, the median is 3
    assert cross_ratios(levels, m, t, 64, throughput) == [3.0, 3.0, 1.5]
    assert median_cross(levels, m, t, 64, throughput) == 3.0
    assert math.isnan(median_cross(levels, m, Side("torchserve", "grpc-stream"), 64, throughput))


def test_stream_targets_against_torchserve_unary_and_its_own_stream() -> None:
    found = targets(make_report(stream_run(), servers=("raw", "mariner", "torchserve", "mosec")))
    vs_unary = named(found, "c=64: throughput mariner grpc-stream / torchserve grpc (median of 3;")
    assert (vs_unary.value, vs_unary.limit, vs_unary.held) == (3.0, 2.0, True)
    oip = named(found, "c=64: throughput mariner oip-stream / torchserve grpc (median of 3;")
    assert oip.value == pytest.approx(2.5)  # 5000/2000, 2000/800, 5000/4000 -> 2.5, 2.5, 1.25
    # TorchServe's own stream (the sequence-batching copy) was not in this run: not measured
    own = named(found, "c=64: throughput mariner grpc-stream / torchserve-seq grpc-stream")
    assert (own.limit, own.held, own.verdict) == (1.5, None, "not measured")
    seq = [cell("torchserve-seq", "grpc-stream", 64, 3000 * k, repeat=r) for r, k in enumerate([1, 0.4, 1])]
    seq.append(cell("torchserve-seq", "grpc-stream", 1, 100, p50_ms=1.0))
    with_own = targets(make_report(stream_run() + seq))
    own = named(with_own, "c=64: throughput mariner grpc-stream / torchserve-seq grpc-stream")
    assert (own.value, own.held) == (2.0, True)
    # at one client the stream is compared with TorchServe's own stream once it ran
    assert named(with_own, "c=1: p50 torchserve-seq grpc-stream / mariner grpc-stream").value == 4.0
    assert named(found, "c=64: throughput mariner oip-stream / torchserve oip-stream").verdict.startswith(
        "n/a (stock TorchServe 0.12 has no"
    )


def test_http_targets_against_torchserve_and_mosec() -> None:
    found = targets(make_report(stream_run(), servers=("raw", "mariner", "torchserve", "mosec")))
    ts = named(found, "c=64: throughput mariner http / torchserve http")
    assert (ts.value, ts.limit, ts.held) == (2.5, 2.0, True)
    mosec = named(found, "c=64: throughput mariner http / mosec http")
    assert (mosec.value, mosec.limit, mosec.held) == (0.5, 0.8, False)
    # without mosec in the run the mosec target says why it was not measured
    alone = targets(make_report(stream_run(), servers=("raw", "mariner", "torchserve")))
    assert named(alone, "c=64: throughput mariner http / mosec http").verdict.startswith("n/a (mosec not in")


def test_one_client_p50_for_every_protocol_streams_against_torchserve_unary() -> None:
    found = targets(make_report(stream_run()))
    assert named(found, "c=1: p50 torchserve grpc / mariner grpc-stream").value == 12.0
    assert named(found, "c=1: p50 torchserve grpc / mariner oip-stream").value == 6.0
    assert named(found, "c=1: p50 torchserve grpc / mariner grpc").value == 1.5
    held = named(found, "c=1: p50 torchserve http / mariner http")
    assert (held.value, held.held) == (4.0, False)
    assert not [t for t in found if "grpc-1ch" in t.what and t.what.startswith("c=1:")]


def test_report_shows_the_cross_protocol_table() -> None:
    text = render_markdown(make_report(stream_run(), servers=("raw", "mariner", "torchserve", "mosec")))
    assert "## Across client set-ups and peers" in text
    assert "| mariner grpc-stream | torchserve grpc | 64 | 3.00x | " in text
    assert "| mariner http | mosec http | 64 | 0.50x | " in text
    assert "| mariner oip-stream | mariner grpc | 64 | 1.67x | " in text


def test_plan_runs_streams_at_the_ends_and_skips_what_a_server_does_not_serve() -> None:
    s = bench.parse_args(["--levels", "1,8,64", "--repeats", "1", "--servers", "mariner,torchserve,mosec"])
    cells = {(c.level, c.server, c.protocol) for c in bench.plan_cells(s, list(s.servers))}
    assert (1, "mariner", "grpc-stream") in cells
    assert (64, "mariner", "oip-stream") in cells
    assert not [c for c in cells if c[0] == 8 and c[2] in ("grpc-stream", "oip-stream")]
    assert (8, "mariner", "grpc") in cells
    assert not [c for c in cells if c[1] == "torchserve" and c[2] in ("grpc-stream", "oip-stream")]
    seq = bench.plan_cells(s, ["mariner", "torchserve", "torchserve-seq"])
    assert {(c.level, c.protocol) for c in seq if c.server == "torchserve-seq"} == {
        (1, "grpc-stream"),
        (64, "grpc-stream"),
    }
    assert {c[2] for c in cells if c[1] == "mosec"} == {"http"}
    assert unserved("mariner", "grpc-stream") == ""
    assert s.load_for("oip-stream").grpc_channels == 16
    # --scaling keeps its three unary columns unless asked for the streams
    assert bench.parse_args(["--scaling"]).protocols == ("grpc", "grpc-1ch", "http")
    assert bench.parse_args(["--scaling", "--protocols", "oip-stream"]).protocols == ("oip-stream",)
    assert client_layout("grpc-stream", 64, 2, 16) == (2, [8, 8])  # streams spread like unary calls


def test_mosec_joins_the_default_servers_only_when_installed_and_only_for_digits() -> None:
    import importlib.util

    installed = importlib.util.find_spec("mosec") is not None
    assert ("mosec" in default_servers()) is installed
    assert ("mosec" in bench.parse_args([]).servers) is installed
    assert "mosec" not in bench.parse_args(["--model", "minilm_onnx"]).servers
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "minilm_onnx", "--servers", "mariner,mosec"])


def test_unknown_stream_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="not a stream protocol"):
        stream_callers("grpc", [], "m", [b"[]"], 1, 1.0)


def test_streams_go_to_the_grpc_port_and_http_to_the_inference_port() -> None:
    ports = Ports(inference=1, management=2, metrics=3, grpc_inference=4, grpc_management=5)
    running = Running("mariner", MarinerProcess(Path("/nonexistent"), ports=ports))
    assert {p: running.endpoint(p)[1] for p in PROTOCOLS} == {
        "grpc": 4, "grpc-1ch": 4, "http": 1, "grpc-stream": 4, "oip-stream": 4,
    }  # fmt: skip


def test_sequence_copy_turns_on_sequence_batching_and_keeps_the_rest(tmp_path: Path) -> None:
    import zipfile

    import yaml

    from mariner.loadtest.servers.sequence_archive import sequence_copy

    src = tmp_path / "src" / "digits_x.mar"
    src.parent.mkdir()
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", '{"model": {"modelName": "digits_x"}}')
        zf.writestr("model-config.yaml", "batchSize: 32\nmaxBatchDelay: 5\n")
        zf.writestr("weights.pt", b"\x00\x01")
    dest = sequence_copy(src, tmp_path / "seq", 64)
    with zipfile.ZipFile(dest) as zf:
        config = yaml.safe_load(zf.read("model-config.yaml"))
        assert zf.read("weights.pt") == b"\x00\x01"
    assert (config["batchSize"], config["maxBatchDelay"]) == (32, 5)
    assert config["sequenceBatching"] is True
    assert config["maxNumSequence"] == 64
    assert config["sequenceMaxIdleMSec"] > 0  # TorchServe only makes job groups when it is set
