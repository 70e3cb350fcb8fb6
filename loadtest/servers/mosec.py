"""mosec as a peer of the benchmark: the digits archive's handler behind mosec's HTTP server.

`MosecPeer` runs `mariner.loadtest.servers.mosec_service` (mosec's Rust server and one Python
worker process that loads the archive's own handler) on a free 127.0.0.1 port, with the
benchmark's batchSize, max wait and torch threads, in its own process group, in the vocabulary of
every server here (`ServerProcess`). mosec serves HTTP only: `POST /inference` with the same JSON
body as `POST /predictions/{model}`, answered with the same bytes. It has no management API, so
its device is what the worker was told (cpu), and no gRPC.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mariner.loadtest.servers.mariner import REPO
from mariner.loadtest.servers.process import LOCALHOST, ServerProcess, wait_http_ok

INFERENCE_PATH = "/inference"


def mosec_available() -> bool:
    """Whether mosec is installed (the `bench` extra)."""
    import importlib.util

    return importlib.util.find_spec("mosec") is not None


class MosecPeer(ServerProcess):
    """The archive's handler under mosec; ready when mosec's `/` answers 200."""

    title = "mosec"
    workdir_prefix = "mosec-peer-"
    inference_path = INFERENCE_PATH

    def __init__(
        self,
        archive: Path,
        *,
        batch_size: int = 32,
        max_wait_ms: int = 5,
        torch_threads: int = 1,
        python: str = sys.executable,
    ) -> None:
        super().__init__()
        self.archive = Path(archive).resolve()
        self.batch_size = batch_size
        self.max_wait_ms = max_wait_ms
        self.torch_threads = torch_threads
        self.python = python

    def command(self) -> list[str]:
        assert self.workdir is not None
        return [
            self.python, "-m", "mariner.loadtest.servers.mosec_service",
            "--archive", str(self.archive), "--batch-size", str(self.batch_size),
            "--max-wait-ms", str(self.max_wait_ms), "--torch-threads", str(self.torch_threads),
            "--address", LOCALHOST, "--port", str(self.ports.inference),
            "--path", str(self.workdir / "ipc"), "--log-level", "warning",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        threads = str(self.torch_threads)
        return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}

    def cwd(self) -> Path | None:
        return REPO

    @property
    def inference_url(self) -> str:
        return f"{self.http_url}{self.inference_path}"

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None
        # mosec answers `/` once its server is up; its worker may still be loading, so wait for
        # an inference answer too (a 503 until the worker is ready).
        wait_http_ok(f"{self.http_url}/", self.proc, max(0.0, deadline - time.monotonic()))
        self._wait_worker(deadline)

    def _wait_worker(self, deadline: float) -> None:
        import requests

        body = b"[" + b",".join([b"0"] * 64) + b"]"
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.fail(f"exited with code {self.proc.returncode} while starting")
            try:
                if requests.post(self.inference_url, data=body, timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise self.fail("did not answer an inference within the start-up timeout")
