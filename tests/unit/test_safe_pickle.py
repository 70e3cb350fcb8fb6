"""Frames between our processes load values only; peers are checked by their credentials."""

from __future__ import annotations

import enum
import io
import os
import pickle
import socket
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mariner.server.contracts import safe_pickle
from mariner.server.contracts import worker_wire as protocol
from mariner.server.contracts.peer import PeerRefused, check_peer, peer_credentials
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol


class _Reduce:
    """Pickles as `fn(*args)`."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


class _Payload:
    """What an attacker's worker would answer: loading it calls os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_the_protocols_values_round_trip() -> None:
    result = InferResult(body=b"x" * 10, content_type="application/json")
    msg = protocol.Result(
        3,
        (result,),
        error=protocol.BatchError("internal", "m", (500, "T", "m")),
    )
    assert safe_pickle.loads(pickle.dumps(msg, protocol=5)) == msg
    values = {
        "a": [1, 2.5, "s", None, True, b"b", bytearray(b"c"), 1j, {1, 2}, frozenset({3}), (4,)],
        "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.float64(1.5),
        "i": np.int64(7),
    }
    loaded = safe_pickle.loads(pickle.dumps(values, protocol=5))
    assert loaded["a"] == values["a"]
    assert np.array_equal(loaded["arr"], values["arr"])
    assert loaded["scalar"] == 1.5
    assert loaded["i"] == 7
    req = InferRequest(
        model="m", version="1", data={"data": b"x"}, protocol=WireProtocol.TS_HTTP, request_id="r"
    )
    assert safe_pickle.loads(pickle.dumps(protocol.Batch(1, (req,)), protocol=5)).requests[0] == req


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    frame, _ = protocol.encode(_Payload(marker))
    size, header = struct.unpack(">II", frame[:8])
    with pytest.raises(protocol.FrameError, match=r"refused to load posix\.system"):
        protocol.decode(frame[8 : 8 + header], frame[8 + header :])
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("builtins", "eval"),
        ("builtins", "setattr"),  # getattr resolves to an enum-member lookup only: tested below
        ("subprocess", "Popen"),
        ("mariner.server.frontend.worker_client", "kill_worker"),  # ours, but a function
        ("mariner.server.supervisor.worker_process", "os"),  # a module reached through one of ours
        ("numpy", "load"),
    ],
)
def test_only_value_types_resolve(module: str, name: str) -> None:
    with pytest.raises(safe_pickle.UnsafePickle):
        safe_pickle.SafeUnpickler.find_class(
            safe_pickle.SafeUnpickler(__import__("io").BytesIO()), module, name
        )


def test_a_peer_of_our_uid_passes_and_another_uid_or_pid_is_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        cred = check_peer(a, what="test", expected_pid=os.getpid())
        assert (cred.pid, cred.uid) == (os.getpid(), os.geteuid())
        with pytest.raises(PeerRefused, match=r"runs as uid \d+; only uid"):
            check_peer(a, what="test", euid=os.geteuid() + 1)
        with pytest.raises(PeerRefused, match="not pid 1,|not pid 1, the process"):
            check_peer(a, what="test", expected_pid=1)


def test_the_check_reads_so_peercred_of_the_peer() -> None:
    class FakeSock:
        def getsockopt(self, level: int, opt: int, size: int) -> bytes:
            assert (level, opt, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            return struct.pack("3i", 4242, 1001, 1001)

    assert peer_credentials(FakeSock()).uid == 1001
    with pytest.raises(PeerRefused, match="uid 1001"):
        check_peer(FakeSock(), what="worker socket /x")


def test_an_enum_pickled_by_name_loads_and_getattr_on_anything_else_is_refused() -> None:
    """Debian's Python 3.11.2 (the images') pickles an enum member as getattr(cls, name); the
    pyenv 3.11.7 here pickles it as cls(value). Both must load; getattr may name nothing else."""

    def by_name(member: enum.Enum) -> bytes:
        class Pickler(pickle.Pickler):
            def reducer_override(self, obj: Any) -> Any:
                if isinstance(obj, enum.Enum):
                    return getattr, (type(obj), obj.name)
                return NotImplemented

        buf = io.BytesIO()
        Pickler(buf, protocol=5).dump(member)
        return buf.getvalue()

    assert safe_pickle.loads(by_name(WireProtocol.OIP_GRPC)) is WireProtocol.OIP_GRPC
    assert safe_pickle.loads(pickle.dumps(WireProtocol.OIP_GRPC, protocol=5)) is WireProtocol.OIP_GRPC
    for evil in (
        pickle.dumps(_Reduce(getattr, (InferRequest, "__init__"))),  # ours, not an enum
        pickle.dumps(_Reduce(getattr, (WireProtocol, "__class__"))),  # not a member
        pickle.dumps(_Reduce(getattr, (WireProtocol, "_missing_"))),
    ):
        with pytest.raises(safe_pickle.UnsafePickle):
            safe_pickle.loads(evil)
