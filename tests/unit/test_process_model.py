"""The pieces of `mariner serve`'s process model that need no child process: the frontend count,
the supervisor's port reservation, GPU counting without CUDA, the control channel, and the
batcher growing and shrinking with the workers a frontend is told about."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Sequence

import pytest

from mariner.server.common import control_channel as channel
from mariner.server.common.batch_policy import BatchPolicy
from mariner.server.common.config import ServerConfig, default_frontends, frontend_count
from mariner.server.common.config_loading import load_config
from mariner.server.common.listeners import reuseport_listener
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.contracts.worker_api import ModelEntry, WorkerEndpoint
from mariner.server.frontend.batcher import Batcher
from mariner.server.supervisor.devices import visible_gpus
from mariner.server.supervisor.ports import reserve_port


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (4, 1), (7, 1), (8, 2), (16, 4), (64, 8)])
def test_default_frontends_follow_the_core_count(cores: int, expected: int) -> None:
    assert default_frontends(cores) == expected


def test_frontends_come_from_flag_env_or_default() -> None:
    assert load_config(["--frontends", "3"], env={}).frontends == 3
    assert load_config([], env={"MARINER_FRONTENDS": "2"}).frontends == 2
    assert frontend_count(ServerConfig(frontends=None)) == default_frontends()
    with pytest.raises(ValueError, match="frontends must be a positive integer"):
        frontend_count(ServerConfig(frontends=0))


@pytest.mark.parametrize(("visible", "expected"), [("0,1", 2), ("3", 1), ("", 0), ("-1", 0)])
def test_visible_gpus_reads_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, expected: int
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpus() == expected


def test_a_reserved_inference_port_admits_frontends_and_refuses_a_foreign_server() -> None:
    held = reserve_port("127.0.0.1:0")
    try:
        port = held.getsockname()[1]
        assert port != 0
        # A server that does not share ports (say a stock TorchServe) cannot take it...
        foreign = socket.socket()
        with pytest.raises(OSError, match="in use") as refused:
            foreign.bind(("127.0.0.1", port))
        foreign.close()
        assert refused.value.errno == errno.EADDRINUSE
        # ...while two frontends listen on it side by side.
        a, b = reuseport_listener("127.0.0.1", port), reuseport_listener("127.0.0.1", port)
        a.close()
        b.close()
    finally:
        held.close()


def test_a_port_in_use_fails_the_reservation_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match=f"cannot listen on '{address}'"):
            reserve_port(address)


def test_control_channel_carries_a_model_table_both_ways() -> None:
    endpoint = WorkerEndpoint("m-1.0-0", 0, 0, "/tmp/w.sock", 4242, "cpu", "READY")
    entry = ModelEntry("m", "1.0", "m.mar", "ab" * 32, "/tmp/m", {}, {}, None, True, True, (endpoint,))
    table = channel.ModelTable(7, (entry,))

    async def roundtrip() -> tuple[object, object, object]:
        left, right = socket.socketpair()
        r1, w1 = await asyncio.open_unix_connection(sock=left)
        r2, w2 = await asyncio.open_unix_connection(sock=right)
        await channel.send(w1, table)
        got = await channel.receive(r2)
        await channel.send(w2, channel.TableApplied(7))
        ack = await channel.receive(r1)
        w2.close()
        eof = await channel.receive(r1)
        w1.close()
        return got, ack, eof

    got, ack, eof = asyncio.run(roundtrip())
    assert got == table
    assert ack == channel.TableApplied(7)
    assert eof is None


class Recorder:
    def __init__(self, id: str) -> None:
        self.id = id
        self.batches = 0

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        self.batches += 1
        await asyncio.sleep(0)
        return [InferResult(body=self.id.encode()) for _ in requests]


def _req(i: int) -> InferRequest:
    return InferRequest(model="m", version=None, data={}, protocol=WireProtocol.TS_HTTP, request_id=str(i))


def test_batcher_takes_added_workers_and_stops_using_retired_ones() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes], int]:
        first, second = Recorder("first"), Recorder("second")
        batcher = Batcher([first], BatchPolicy(max_batch_size=1))
        batcher.start()
        batcher.add_runner(second)
        both = await asyncio.gather(*(batcher.submit(_req(i)) for i in range(20)))
        batcher.retire_runner(first)
        before = first.batches
        after = [await batcher.submit(_req(i)) for i in range(20)]
        await batcher.close(1.0)
        return [r.body for r in both], [r.body for r in after], first.batches - before

    both, after, first_after_retire = asyncio.run(scenario())
    assert set(both) == {b"first", b"second"}
    assert set(after) == {b"second"}
    assert first_after_retire == 0


def test_a_loading_worker_is_described_on_the_device_it_was_placed_on() -> None:
    """Before its worker is ready an instance reports its planned device, not a placeholder."""
    from types import SimpleNamespace

    from mariner.server.contracts.worker_api import WorkerEndpoint
    from mariner.server.supervisor.versions import Instance, instance_device

    loading = Instance(index=1, process=SimpleNamespace(spec=SimpleNamespace(device="cuda:0")))
    assert instance_device(loading) == "cuda:0"
    ready = Instance(
        index=0,
        process=SimpleNamespace(spec=SimpleNamespace(device="cuda:1")),
        endpoint=WorkerEndpoint(
            id="m-1.0-0", instance=0, generation=0, socket_path="/s", pid=7, device="cuda:1", status="READY"
        ),
        status="READY",
    )
    assert instance_device(ready) == "cuda:1"
    assert instance_device(Instance(index=2)) == "cpu"
