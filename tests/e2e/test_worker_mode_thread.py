"""`mariner serve --worker-mode thread --frontends 1`: the single-process server of the previous
release, kept as the benchmark's baseline. It serves a prediction from handler code running in
the serving process itself (no supervisor, no frontend, no worker process) and exits 0 on
SIGTERM with its drain accounting balanced."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.serve_process import ServeProcess, drain_totals

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    """Every live process whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def test_thread_mode_serves_in_one_process_and_exits_0_on_sigterm(model_store: Path, tmp_path: Path) -> None:
    srv = ServeProcess(
        model_store,
        "digits_torchscript.mar",
        tmp_path / "serve.log",
        ["--worker-mode", "thread", "--frontends", "1"],
    )
    try:
        srv.wait_ready()
        body = json.dumps([4.0] * 64).encode()
        predictions = 3
        for _ in range(predictions):
            req = urllib.request.Request(
                f"{srv.url()}/predictions/digits_torchscript",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
                answer = json.loads(resp.read())
            assert answer, answer

        # The handler ran in the serving process: its worker is this process, and it has no
        # child processes (no supervisor's frontends, no model workers).
        with urllib.request.urlopen(f"{srv.url('mgmt')}/models/digits_torchscript", timeout=30) as resp:
            described = json.loads(resp.read())
        pids = {w["pid"] for m in described for w in m["workers"]}
        assert pids == {srv.proc.pid}, described
        assert _children(srv.proc.pid) == []

        srv.proc.send_signal(signal.SIGTERM)
        rc = srv.proc.wait(60)
        log = srv.log_path.read_text()
        assert rc == 0, log[-3000:]
        accepted, answered, ok, processes = drain_totals(log)
        assert processes == 1, log[-3000:]  # one process drained: the server itself
        assert (accepted, answered, ok) == (predictions, predictions, predictions), log[-3000:]
        assert "supervisor" not in log, log[-3000:]
    finally:
        srv.kill()
