"""Which GPUs the model workers may use, found without initialising CUDA in the supervisor
(a forked or later-spawned child of a process that touched CUDA cannot use it)."""

from __future__ import annotations

import os
import shutil
import subprocess


def visible_gpus() -> int:
    """GPUs the workers may use: `CUDA_VISIBLE_DEVICES` when it is set, else the devices
    `nvidia-smi -L` lists, else none."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [d for d in env.split(",") if d.strip()]
        return 0 if not ids or ids[0].strip() == "-1" else len(ids)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
