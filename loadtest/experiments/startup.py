"""Start-up time of an archive that names a TorchServe built-in handler, Mariner against stock
TorchServe on the same machine: `python -m mariner.loadtest.experiments.startup [--rounds 3]`.

The archive is built the way TorchServe's docs build one (`torch-model-archiver --handler
base_handler --serialized-file model.pt`, a small TorchScript model made here), so both servers
import `ts.torch_handler.base_handler` and load the model through BaseHandler.initialize. Each
round starts TorchServe, then Mariner (interleaved, so a slow spell of a shared machine hits
both), each with one worker, from launch until every model has a ready worker (TorchServe: a
READY worker in describe and its gRPC ports open; Mariner: /readyz), then stops it. Prints every
round and the medians with their ratio; the figures are what the issue's start-up target reads.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mariner.loadtest.servers import MarinerProcess, StockTorchServe

ARCHIVE = "builtin_base"


def build_archive(store: Path, work: Path) -> Path:
    """A TorchScript MLP (64 -> 256 -> 10) archived with `--handler base_handler`."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).eval()
    scripted = torch.jit.script(model)
    serialized = work / "model.pt"
    torch.jit.save(scripted, str(serialized))
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "model_archiver.model_packaging",
            "--model-name",
            ARCHIVE,
            "--version",
            "1.0",
            "--serialized-file",
            str(serialized),
            "--handler",
            "base_handler",
            "--export-path",
            str(store),
            "--force",
        ],  # fmt: skip
        check=True,
    )
    return store / f"{ARCHIVE}.mar"


def one_round(store: Path) -> tuple[float, float]:
    """Seconds from launch to ready: (TorchServe, Mariner)."""
    with StockTorchServe(store, f"{ARCHIVE}.mar", workers=1) as ts:
        ts_s = ts.ready_seconds
    with MarinerProcess(
        store, f"{ARCHIVE}={ARCHIVE}.mar", extra_args=["--default-workers-per-model", "1"]
    ) as mariner:
        mariner_s = mariner.ready_seconds
    assert ts_s is not None
    assert mariner_s is not None
    return ts_s, mariner_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mariner-startup-") as tmp:
        store = Path(tmp) / "store"
        build_archive(store, Path(tmp))
        rows = []
        for i in range(args.rounds):
            ts_s, mariner_s = one_round(store)
            rows.append((ts_s, mariner_s))
            print(f"round {i + 1}: TorchServe {ts_s:.2f} s, Mariner {mariner_s:.2f} s", flush=True)
    ts_med = statistics.median(r[0] for r in rows)
    m_med = statistics.median(r[1] for r in rows)
    print(f"median of {len(rows)}: TorchServe {ts_med:.2f} s, Mariner {m_med:.2f} s, "
          f"Mariner / TorchServe = {m_med / ts_med:.2f} (target <= 1.5)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
