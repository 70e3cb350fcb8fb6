"""`mariner torchserve --start` / `--stop` as TorchServe users' scripts call `torchserve`.

The launcher returns at once, leaving the server running in a session of its own with its pid in
`$TMPDIR/.model_server.pid`; a second start is refused; `--stop --foreground` ends the server
(it drains and exits 0) and removes the pid file. Started for real on free loopback ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from mariner.loadtest.servers import pick_free_ports, wait_http_ok

pytestmark = pytest.mark.e2e


def _launcher(tmp_path: Path, *args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "mariner.server.cli", "torchserve", *args],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _flags(store: Path) -> list[str]:
    ports = dict(zip(("http", "mgmt", "metrics", "grpc", "grpc_mgmt"), pick_free_ports().all(), strict=True))
    return [
        "--model-store", str(store), "--ncs",
        "--inference-address", f"127.0.0.1:{ports['http']}",
        "--management-address", f"127.0.0.1:{ports['mgmt']}",
        "--metrics-address", f"127.0.0.1:{ports['metrics']}",
        "--grpc-inference-address", f"127.0.0.1:{ports['grpc']}",
        "--grpc-management-address", f"127.0.0.1:{ports['grpc_mgmt']}",
    ]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rpartition(")")[2].split()[0] != "Z"


def _wait_alive(url: str, pid: int, log: Path, timeout: float = 120.0) -> None:
    """Readiness poll of a server that is not our child (the launcher started it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert _alive(pid), f"the server exited while starting:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def test_start_returns_and_stop_ends_the_server(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    flags = _flags(store)
    mgmt = flags[flags.index("--management-address") + 1]
    log = tmp_path / "launcher.log"
    launcher = _launcher(tmp_path, "--start", *flags, log=log)
    assert launcher.wait(60) == 0  # returns without waiting for the server
    pid_file = tmp_path / ".model_server.pid"
    pid = int(pid_file.read_text())
    assert pid != launcher.pid
    try:
        _wait_alive(f"http://{mgmt}/healthz", pid, log)
        again = _launcher(tmp_path, "--start", *flags, log=log)
        assert again.wait(60) == 1
        assert "TorchServe is already running" in log.read_text()
        stopper = _launcher(tmp_path, "--stop", "--foreground", log=log)
        assert stopper.wait(120) == 0
        assert not _alive(pid), log.read_text()[-3000:]
        assert not pid_file.exists()
    finally:
        if _alive(pid):  # the launcher started it in a session of its own: end it whatever failed
            os.killpg(pid, signal.SIGKILL)
    final = _launcher(tmp_path, "--stop", log=log)
    assert final.wait(60) == 0
    assert log.read_text().rstrip().endswith("TorchServe is not currently running.")


def test_foreground_start_is_the_server(tmp_path: Path) -> None:
    """`--foreground`: the launcher process becomes `mariner serve`, so SIGTERM reaches the server
    and its exit status is the launcher's."""
    store = tmp_path / "store"
    store.mkdir()
    flags = _flags(store)
    mgmt = flags[flags.index("--management-address") + 1]
    log = tmp_path / "fg.log"
    proc = _launcher(tmp_path, "--start", "--foreground", *flags, log=log)
    try:
        wait_http_ok(f"http://{mgmt}/healthz", proc, 120)
        assert int((tmp_path / ".model_server.pid").read_text()) == proc.pid
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
