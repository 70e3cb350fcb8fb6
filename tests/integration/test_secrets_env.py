"""No secret in handler reach: tokens given to `mariner serve` in its environment are in no
child's environment. The handler (arbitrary archive code) dumps what it can see; the frontend's
and the worker's /proc/<pid>/environ are read too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests

from tests.integration.fault_archive import write_handler_archive
from tests.mariner_serve import MarinerServe

INF = "inference-secret-4f1c9e"
MGMT = "management-secret-8a2d7b"
SECRETS = (INF, MGMT, "MARINER_INFERENCE_TOKEN", "MARINER_MANAGEMENT_TOKEN")

HANDLER = """
import json
import os


class EnvHandler:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        with open("/proc/self/environ", "rb") as f:
            raw = f.read().decode(errors="replace")
        seen = {"pid": os.getpid(), "env": sorted(os.environ.items()), "proc_environ": raw}
        return [json.dumps(seen) for _ in data]
"""
CONFIG = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nmaxBatchDelay: 0\nresponseTimeout: 30\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("store")
    write_handler_archive(
        store / "envdump.mar",
        "envdump",
        "env_handler.py",
        {"env_handler.py": HANDLER, "model-config.yaml": CONFIG},
    )
    srv = MarinerServe(
        store, "envdump.mar", env={"MARINER_INFERENCE_TOKEN": INF, "MARINER_MANAGEMENT_TOKEN": MGMT}
    ).start()
    yield srv
    srv.stop()


def _environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def test_the_handler_sees_no_token_nor_its_variable(server: MarinerServe) -> None:
    r = requests.post(
        f"{server.http}/predictions/envdump",
        data=b"{}",
        headers={"Authorization": f"Bearer {INF}"},
        timeout=30,
    )
    assert r.status_code == 200, r.text  # the frontend has the token: it came over its channel
    for secret in SECRETS:
        assert secret not in r.text, f"the handler can read {secret!r}"
    worker = r.json()["pid"]
    assert "PATH" in dict(r.json()["env"]), "the dump must show the environment the handler has"
    frontends = server.frontend_pids()
    assert frontends
    assert server.supervisor_pid is not None
    zygotes = [
        p.pid
        for p in psutil.Process(server.supervisor_pid).children()
        if "mariner.server.worker.zygote" in " ".join(p.cmdline())
    ]
    for pid in (worker, *frontends, *zygotes):
        environ = _environ(pid)
        for secret in SECRETS:
            assert secret not in environ, f"/proc/{pid}/environ holds {secret!r}"


def test_the_tokens_still_guard_the_apis(server: MarinerServe) -> None:
    r = requests.post(f"{server.http}/predictions/envdump", data=b"{}", timeout=30)
    assert r.status_code == 401
    r = requests.get(f"{server.management}/models", timeout=30)
    assert r.status_code == 401
    r = requests.get(f"{server.management}/models", headers={"Authorization": f"Bearer {MGMT}"}, timeout=30)
    assert r.status_code == 200
