"""Run the real `torch-model-archiver` CLI the way TorchServe's examples do.

The archiver copies its inputs into `<tempdir>/<model name>` before zipping, so two helpers
archiving the same model name at once would mix files: each run gets a private TMPDIR. It is
run from the staging directory with relative paths, as the examples' READMEs do, which is also
what makes `--handler mymod:my_fn` find `mymod.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")


class ArchiverFailed(AssertionError):
    """torch-model-archiver exited non-zero; the message carries its output."""


def archive(staging: Path, export_path: Path, *args: str) -> None:
    """`torch-model-archiver <args> --export-path <export_path> -f`, run inside `staging`."""
    export_path.mkdir(parents=True, exist_ok=True)
    cmd = [str(ARCHIVER), *args, "--export-path", str(export_path), "-f"]
    with tempfile.TemporaryDirectory(prefix="archiver-") as tmp:
        env = {**os.environ, "TMPDIR": tmp}
        done = subprocess.run(cmd, cwd=staging, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ArchiverFailed(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
