"""The machine and the software a benchmark ran on: the head of every report, so a figure is
never read without its circumstances.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil

from mariner.loadtest.bench_values import REPO


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu,
        "logical_cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "grpcio", "protobuf", "uvicorn", "starlette", "uvloop", "torchserve", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20, check=False)
        out["java"] = (java.stderr or java.stdout).splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        out["java"] = "not installed"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
        out["mariner"] = sha + (" (with uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        out["mariner"] = "unknown"
    return out
