"""The benchmark's stream clients and its mosec peer against real servers on 127.0.0.1.

The closed-loop engine (`mariner.loadtest.closedloop.run_level`) drives `mariner serve` over
`grpc-stream` (StreamPredictions2) and `oip-stream` (ModelStreamInfer) in spawned client
processes, exactly as the benchmark does; every answer is checked. Runs are bounded by request
counts, never by a clock, and assert what was counted: every timed request answered with a
prediction, one stream per client, an in-stream error counted as an error. The mosec peer
(`mariner.loadtest.servers.mosec`) is started for real and must answer the same bytes as Mariner.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import requests

from mariner.loadtest.closedloop import LevelResult, LoadSpec, run_level
from mariner.loadtest.servers import MarinerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "digits_torchscript"
REQUESTS = 48
CLIENTS = 4


@pytest.fixture(scope="module")
def bodies() -> tuple[bytes, ...]:
    from mariner.loadtest.workloads import workload

    return workload("digits").bodies


@pytest.fixture(scope="module")
def mariner(shared_loadtest_mariner: MarinerProcess) -> MarinerProcess:
    """The session's shared server (tests/integration/conftest.py): these tests only send requests."""
    assert shared_loadtest_mariner.running, shared_loadtest_mariner.log_tail()
    return shared_loadtest_mariner


def drive(
    server: MarinerProcess, protocol: str, bodies: tuple[bytes, ...], *, model: str = MODEL, **kw: object
) -> LevelResult:
    port = server.ports.inference if protocol == "http" else server.ports.grpc_inference
    return run_level(
        server="mariner", protocol=protocol, host=server.host, port=port, model=model,
        concurrency=CLIENTS, load=LoadSpec(REQUESTS, 8, None, client_procs=2, grpc_channels=2),
        bodies=bodies, server_pid=server.pid, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("protocol", ["grpc-stream", "oip-stream"])
def test_every_streamed_request_is_answered_with_a_prediction(
    mariner: MarinerProcess, bodies: tuple[bytes, ...], protocol: str
) -> None:
    r = drive(mariner, protocol, bodies)
    assert r.errors == 0, r.first_error
    assert r.latency.n == REQUESTS
    assert r.connections == 2  # the streams spread over the channels, as unary calls are
    assert r.protocol == protocol


@pytest.mark.parametrize("protocol", ["grpc-stream", "oip-stream"])
def test_an_in_stream_error_answer_counts_as_an_error(
    mariner: MarinerProcess, bodies: tuple[bytes, ...], protocol: str
) -> None:
    r = drive(mariner, protocol, bodies, model="no_such_model")
    assert r.latency.n == 0
    assert r.errors == REQUESTS  # the stream stayed usable: every request got its own error
    assert r.first_error.startswith("StreamAnswerError: in-stream error"), r.first_error


@pytest.mark.skipif(importlib.util.find_spec("mosec") is None, reason="mosec is not installed (bench extra)")
def test_mosec_peer_answers_the_same_bytes_as_mariner(
    model_store: Path, mariner: MarinerProcess, bodies: tuple[bytes, ...]
) -> None:
    from mariner.loadtest.servers.mosec import MosecPeer

    with MosecPeer(model_store / f"{MODEL}.mar", batch_size=32, max_wait_ms=5) as peer:
        for body in bodies[:8]:
            ours = requests.post(
                f"{mariner.http_url}/predictions/{MODEL}", data=body, timeout=30,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            theirs = requests.post(peer.inference_url, data=body, timeout=30)
            assert (ours.status_code, theirs.status_code) == (200, 200)
            assert theirs.content == ours.content
        port = peer.ports.inference
        r = run_level(
            server="mosec", protocol="http", host=peer.host, port=port, model=MODEL, concurrency=CLIENTS,
            load=LoadSpec(REQUESTS, 8, None, client_procs=2), bodies=bodies, server_pid=peer.pid,
            http_path=peer.inference_path,
        )  # fmt: skip
        assert r.errors == 0, r.first_error
        assert r.latency.n == REQUESTS
        assert r.server_cores >= 0.0
