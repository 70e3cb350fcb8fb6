"""TorchServe's startupTimeout: how long a worker may take to start and initialise its handler,
from the archive's model-config (or default_startup_timeout, else 120 s), reported by describe
and enforced: a worker still initialising after it is killed and the model says why."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.integration.fault_archive import write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

SLOW = """
import time

class Slow:
    def initialize(self, context):
        time.sleep(600)

    def handle(self, data, context):
        return [1 for _ in data]
"""

QUICK = "def handle(data, context):\n    return data and [1 for _ in data]\n"


def test_a_worker_slower_than_its_startup_timeout_is_killed_and_the_model_says_why(tmp_path: Path) -> None:
    store = tmp_path / "store"
    files = {"slow.py": SLOW, "model-config.yaml": "minWorkers: 1\nmaxWorkers: 1\nstartupTimeout: 3\n"}
    write_handler_archive(store / "slow.mar", "slow", "slow.py", files)
    write_handler_archive(
        store / "quick.mar",
        "quick",
        "quick.py",
        {
            "quick.py": "def handle(data, context):\n    return data and [1 for _ in data]\n",
            "model-config.yaml": "",
        },
    )
    srv = MarinerServe(store, "slow.mar,quick.mar", default_startup_timeout=45).start(require_ready=False)
    try:
        (slow,) = srv.describe("slow")
        (quick,) = srv.describe("quick")
        assert (slow["startupTimeout"], quick["startupTimeout"]) == (3, 45)  # archive > default_*
        assert "was not ready within its startupTimeout (3 s) and was killed" in srv.log_text()
        answer = requests.post(f"{srv.http}/predictions/quick", data=b"x", timeout=30)
        assert (answer.status_code, answer.text) == (200, "1")  # the other model is unaffected
    finally:
        srv.stop()
