"""What a TorchServe example archive is to the drop-in suite: where it lies and what to send it."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.integration.ts_examples import oracle_env

SRC = Path(__file__).resolve().parent / "src"
NEEDED = ("torchvision", "captum")


@cache
def unimportable() -> frozenset[str]:
    """The NEEDED modules that do not import in this venv, tried in a child process with the
    environment stock TorchServe's workers get (oracle_env).

    Being installed is not enough: the registry's torchvision is found but fails to import
    beside the CPU torch (its C ops do not register), and importing it here would leave a
    half-imported torchvision in the test process.
    """
    probe = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        print(name)\n"
    )
    env = {**os.environ, "PYTHONPATH": oracle_env.pythonpath(os.environ.get("PYTHONPATH"))}
    done = subprocess.run(
        [sys.executable, "-c", probe, *NEEDED], capture_output=True, text=True, timeout=300, env=env
    )
    return frozenset(done.stdout.split())


@dataclass(frozen=True)
class Req:
    """One inference call, sent alike to both servers (REST, and gRPC Predictions when `grpc`)."""

    label: str
    body: bytes
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    endpoint: str = "predictions"  # or "explanations"
    grpc: bool = False


@dataclass(frozen=True)
class Example:
    """An archive in a model store, registered as `name` from `url` (a file or directory name).

    `needs` names the modules its handler imports beyond `ts` and torch (torchvision, captum:
    not always importable here). Such an archive is registered through the management API
    after start-up, asynchronously while one of them does not import: stock TorchServe retries
    a worker that cannot load forever, so it would never become ready. `startup=False`
    archives (directories, tgz) are registered through the management API too.
    """

    name: str
    url: str
    build: Callable[[Path, Path], None]  # (store, staging root): runs torch-model-archiver
    requests: tuple[Req, ...]
    needs: tuple[str, ...] = ()
    startup: bool = True

    def missing(self) -> list[str]:
        return [m for m in self.needs if m in unimportable()]

    @property
    def at_startup(self) -> bool:
        """Static, so pytest can name the registration calls without importing anything."""
        return self.startup and not self.needs


def stage(work: Path, name: str, *sources: str) -> Path:
    """A fresh directory `work/name` holding copies of the named files from src/."""
    staging = work / name
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for source in sources:
        shutil.copy(SRC / source, staging / source)
    return staging


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def png(size: tuple[int, int], mode: str, seed: int = 0) -> bytes:
    """A deterministic PNG (a gradient), made with PIL."""
    from PIL import Image

    w, h = size
    image = Image.new(mode, size)
    bands = len(mode)
    image.putdata(
        [
            ((x * 7 + y * 3 + seed) % 256)
            if bands == 1
            else tuple((x * (c + 2) + y + seed) % 256 for c in range(bands))
            for y in range(h)
            for x in range(w)
        ]
    )
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
