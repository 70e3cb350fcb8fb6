"""The digits archive's handler served by mosec: the program `servers.mosec.MosecPeer` runs.

    python -m mariner.loadtest.servers.mosec_service --archive model_store/digits_torchscript.mar \
        --port 8000 --batch-size 32 --max-wait-ms 5 --torch-threads 1

A peer, not a port of the handler: the worker opens the archive and loads its handler exactly as
Mariner's workers and the raw ceiling do (`mariner.server.common.archive`, the runner's entry-point
loader, a TorchServe-shaped Context), so mosec does the same per-request work: the JSON body
decoded by the handler, one TorchScript forward per batch of up to batchSize requests, the same
top-k answer, encoded as TorchServe encodes a dict (JSON, indent 2). mosec's own part is what it
is compared on: its Rust HTTP server, its batcher (max batch, max wait) and the IPC to its Python
worker process. Bodies travel as raw bytes (`deserialize`/`serialize` pass them through), as they
do in Mariner, so no JSON is decoded twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mosec import Server, Worker

ARCHIVE_ENV = "MARINER_MOSEC_ARCHIVE"
BATCH_ENV = "MARINER_MOSEC_BATCH"
THREADS_ENV = "MARINER_MOSEC_THREADS"


def encode(answer: Any) -> bytes:
    """An answer as TorchServe's and Mariner's frontends send a dict: JSON with indent 2."""
    if isinstance(answer, bytes | bytearray):
        return bytes(answer)
    if isinstance(answer, str):
        return answer.encode()
    return json.dumps(answer, indent=2).encode()


class ArchiveHandler(Worker):
    """One mosec worker process running the archive's handler on each batch mosec hands it."""

    def __init__(self) -> None:
        super().__init__()
        import torch

        from mariner.server.common.archive import open_archive
        from mariner.server.worker.context import Context
        from mariner.server.worker.runner import load_entry_point

        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
        self._work = tempfile.TemporaryDirectory(prefix="mosec-archive-")
        archive = open_archive(Path(os.environ[ARCHIVE_ENV]), Path(self._work.name))
        batch = int(os.environ.get(BATCH_ENV, "1"))
        self.ctx = Context(
            archive.name,
            str(archive.model_dir),
            archive.manifest,
            batch_size=batch,
            gpu_id=None,
            model_yaml_config=archive.model_config,
        )
        self.handle, initialize = load_entry_point(archive)
        initialize(self.ctx)

    def deserialize(self, data: bytes) -> Any:
        return data  # the handler decodes the body itself, as on the servers

    def serialize(self, data: Any) -> bytes:
        return data if isinstance(data, bytes) else encode(data)

    def forward(self, data: Any) -> Any:
        rows = data if isinstance(data, list) else [data]
        n = len(rows)
        # The request ids and headers a handler may read, as a server sets them per batch.
        self.ctx.begin_batch([f"r{i}" for i in range(n)], [{} for _ in range(n)])
        answers = self.handle([{"body": body} for body in rows], self.ctx)
        out = [encode(a) for a in answers]
        return out if isinstance(data, list) else out[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archive", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=1)
    a, mosec_args = p.parse_known_args(argv)
    os.environ[ARCHIVE_ENV] = str(a.archive.resolve())
    os.environ[BATCH_ENV] = str(a.batch_size)
    os.environ[THREADS_ENV] = str(a.torch_threads)
    sys.argv = [sys.argv[0], *mosec_args]  # mosec reads its own flags (--port, --address, --path)
    server = Server()
    server.append_worker(
        ArchiveHandler,
        num=1,
        max_batch_size=a.batch_size,
        max_wait_time=a.max_wait_ms,
        env=[{"OMP_NUM_THREADS": str(a.torch_threads), "MKL_NUM_THREADS": str(a.torch_threads)}],
    )
    server.run()


if __name__ == "__main__":
    main()
