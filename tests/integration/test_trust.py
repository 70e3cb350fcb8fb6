"""Trust only what we made: a worker socket answered by someone else, or by a process that is
not the worker we started, is refused before a frame is read; a frame that would run code is
refused without running it; a work dir another user could write to stops the server starting."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mariner.server.common.batch_policy import InstanceFailed
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, WireProtocol
from mariner.server.contracts.worker_api import WorkerEndpoint
from mariner.server.frontend.worker_client import WorkerConnection

REPO = Path(__file__).resolve().parents[2]

# A stand-in for a worker, as an attacker who swapped the socket would run it: it listens, reads
# whatever comes, and answers with a frame whose pickle calls os.system when loaded.
FAKE_WORKER = """
import os, socket, sys
from mariner.server.contracts import worker_wire as protocol

class Payload:
    def __reduce__(self):
        return os.system, ("touch " + sys.argv[2],)

path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o777)
srv.listen(4)
print("listening", flush=True)
while True:
    conn, _ = srv.accept()
    conn.settimeout(5)
    try:
        conn.recv(1 << 20)
        frame, _ = protocol.encode(Payload())
        conn.sendall(frame)
        conn.recv(1)
    except OSError:
        pass
    conn.close()
"""


# The same stand-in run as another user: it needs nothing of ours (it is never read from).
FOREIGN_WORKER = """
import os, socket, sys, time
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o777)
srv.listen(4)
print("listening", flush=True)
conn, _ = srv.accept()
time.sleep(10)
"""
SYSTEM_PYTHON = "/usr/bin/python3"  # the venv under /root is out of another user's reach


def _start_fake(sock_dir: Path, marker: Path, *, user: int | None = None) -> subprocess.Popen[str]:
    path = sock_dir / "w.sock"
    argv = (
        [sys.executable, "-c", FAKE_WORKER, str(path), str(marker)]
        if user is None
        else [SYSTEM_PYTHON, "-c", FOREIGN_WORKER, str(path)]
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, cwd=REPO if user is None else "/", user=user
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "listening"
    return proc


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A dir another user can reach (pytest's own temp root is private to us)."""
    d = Path(tempfile.mkdtemp(prefix="mariner-trust-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _endpoint(sock_dir: Path, pid: int) -> WorkerEndpoint:
    return WorkerEndpoint(
        id="m:1:0",
        instance=0,
        generation=1,
        socket_path=str(sock_dir / "w.sock"),
        pid=pid,
        device="cpu",
        status="READY",
        start_time=time.time(),
        load_seconds=0.0,
    )


def _request() -> InferRequest:
    return InferRequest(
        model="m", version="1", data={"body": b"{}"}, protocol=WireProtocol.TS_HTTP, request_id="r1"
    )


@pytest.fixture
def sock_dir(tmp_path: Path) -> Path:
    d = tmp_path / "socks"
    d.mkdir()
    d.chmod(0o777)  # the fake may run as another user
    return d


def test_a_reply_that_would_run_code_is_refused_and_runs_nothing(sock_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    fake = _start_fake(sock_dir, marker)
    try:

        async def scenario() -> str:
            conn = WorkerConnection(_endpoint(sock_dir, fake.pid), batch_size=1)
            await conn.start()  # same uid, the pid we were told: the peer check passes
            try:
                with pytest.raises(InstanceFailed) as failed:
                    await asyncio.wait_for(conn.run([_request()]), 20)
                return str(failed.value)
            finally:
                conn.close()

        message = asyncio.run(scenario())
    finally:
        fake.kill()
        fake.wait()
    assert "refused to load posix.system" in message, message
    assert not marker.exists(), "the peer's pickle ran code in the frontend"


def test_a_socket_answered_by_another_pid_is_refused_before_any_frame(sock_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    fake = _start_fake(sock_dir, marker)
    try:

        async def scenario() -> ServingError:
            conn = WorkerConnection(_endpoint(sock_dir, os.getpid()), batch_size=1)  # not the fake's pid
            with pytest.raises(ServingError) as refused:
                await conn.start()
            assert conn.status == "FAILED"
            return refused.value

        err = asyncio.run(scenario())
    finally:
        fake.kill()
        fake.wait()
    assert err.code is Code.UNAVAILABLE
    assert f"the peer is pid {fake.pid}, not pid {os.getpid()}" in err.message
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root")
def test_a_socket_answered_by_another_user_is_refused(shared_dir: Path) -> None:
    sock_dir = shared_dir
    marker = shared_dir / "pwned"
    fake = _start_fake(sock_dir, marker, user=65534)
    try:

        async def scenario() -> ServingError:
            conn = WorkerConnection(_endpoint(sock_dir, fake.pid), batch_size=1)
            with pytest.raises(ServingError) as refused:
                await conn.start()
            return refused.value

        err = asyncio.run(scenario())
    finally:
        fake.kill()
        fake.wait()
    assert "runs as uid 65534; only uid 0" in err.message, err.message
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root")
def test_a_connection_from_another_user_is_refused(shared_dir: Path) -> None:
    """The check a worker makes on every connection it accepts, against a real other-uid client."""
    from mariner.server.contracts.peer import PeerRefused, check_peer

    path = shared_dir / "s.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    path.chmod(0o777)
    srv.listen(1)
    client = subprocess.Popen(
        [
            SYSTEM_PYTHON,
            "-c",
            f"import socket,time;s=socket.socket(socket.AF_UNIX);s.connect({str(path)!r});time.sleep(5)",
        ],  # fmt: skip
        user=65534,
        cwd="/",
    )
    try:
        srv.settimeout(20)
        conn, _ = srv.accept()
        with conn, pytest.raises(PeerRefused, match="runs as uid 65534"):
            check_peer(conn, what="worker")
    finally:
        client.kill()
        client.wait()
        srv.close()


def _serve(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TS_", "MARINER_"))}
    return subprocess.run(
        [sys.executable, "-m", "mariner.server.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def test_serve_refuses_a_work_dir_others_can_write(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o777)
    store = tmp_path / "store"
    store.mkdir()
    done = _serve(["--work-dir", str(work), "--model-store", str(store)])
    assert done.returncode == 2, done.stderr
    assert f"work dir {work} is owned by uid {os.geteuid()} with mode 0777" in done.stderr
    assert "chmod 700 or pick another --work-dir" in done.stderr
    assert list(work.iterdir()) == [], "nothing may be created in a refused work dir"


@pytest.mark.skipif(os.geteuid() != 0, reason="a dir owned by another uid needs root to make")
def test_serve_refuses_a_work_dir_owned_by_another_user(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    os.chown(work, 65534, 65534)
    store = tmp_path / "store"
    store.mkdir()
    done = _serve(["--work-dir", str(work), "--model-store", str(store)])
    assert done.returncode == 2, done.stderr
    assert f"work dir {work} is owned by uid 65534 with mode 0700" in done.stderr


def test_the_zygote_refuses_a_control_socket_its_parent_did_not_make() -> None:
    """The zygote forks workers for whoever holds its control socket: that must be its parent.
    Here the socketpair is made by this process and handed to the zygote through a middleman,
    so the zygote's parent (the middleman) is not its peer."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    middleman = (
        "import subprocess, sys; fd = int(sys.argv[1]); sys.exit(subprocess.call("
        "[sys.executable, '-m', 'mariner.server.worker.zygote', str(fd)], pass_fds=(fd,)))"
    )
    with ours, theirs:
        done = subprocess.run(
            [sys.executable, "-c", middleman, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert done.returncode == 1, done.stderr
    assert f"zygote control socket: the peer is pid {os.getpid()}" in done.stderr
