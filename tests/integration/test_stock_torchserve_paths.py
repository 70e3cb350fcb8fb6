"""Stock TorchServe (the oracle) starts from a deep temp root.

Its frontend reaches each Python worker over a Unix socket in java.io.tmpdir, and a socket path
is limited to 107 bytes: a private temp dir under a long root (a test's tmp_path, a deep TMPDIR)
made every worker fail to bind, so the oracle never became ready.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests

from mariner.loadtest.servers import SOCKET_PATH_MAX, StockTorchServe, leftover_processes

pytestmark = pytest.mark.integration


def test_stock_torchserve_serves_from_a_temp_root_too_long_for_a_socket_path(
    model_store: Path, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    ts = StockTorchServe(model_store, "digits_onnx", temp_root=deep, max_worker_restarts=1)
    with ts:
        assert ts.workdir is not None
        assert ts.workdir.parent == deep, "logs and config stay where asked"
        assert len(str(ts.workdir / ".ts.sock.9000")) > SOCKET_PATH_MAX
        assert ts.temp_dir is not None
        assert len(str(ts.temp_dir / ".ts.sock.65535")) <= SOCKET_PATH_MAX
        short = ts.temp_dir
        r = requests.post(f"{ts.http_url}/predictions/digits_onnx", data=json.dumps([0.0] * 64), timeout=60)
        assert r.status_code == 200, r.text
        assert "label" in r.json()
    assert not short.exists(), "the short temp dir is removed with the instance"
    assert leftover_processes(deep) == []
    assert list(deep.iterdir()) == []
