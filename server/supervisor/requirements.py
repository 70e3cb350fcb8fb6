"""An archive's own Python requirements, installed for that model alone (TorchServe's
`install_py_dep_per_model=true`).

`torch-model-archiver --requirements-file r.txt` records the file in the manifest
(`model.requirementsFile`). With the setting on, the supervisor runs, before the model's first
worker starts, `python -m pip install --target <model_dir>/.mariner-requirements -r r.txt` with
the server's own interpreter and whatever index pip is configured with (pip.conf, `PIP_*`; no
index is named here). The target is inside the version's private unpacked directory, never the
server's environment, so two models may pin different versions of one package and removing the
model removes its packages. The worker puts that directory right after the archive's directory
on its `sys.path` (`workers.main.isolate_sys_path`), before the server's site-packages, as
TorchServe's PYTHONPATH does for its `pip install -t <model dir>`.

pip runs in the model directory (relative paths in the file resolve as on TorchServe), in its
own session so a timeout kills it and whatever it started, with the server's environment less
Mariner's token variables. A failure (pip's exit code, or the timeout) is one ServingError
naming the archive, the requirements file and the last lines of pip's stderr (its reason), so
that model alone is FAILED (at start-up) or its register refused, with pip's reason in the log
and the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mariner.server.child_process import ChildProcess, stream_reader
from mariner.server.core.archive import ModelArchive, requirements_dir
from mariner.server.core.archive_fields import inside
from mariner.server.core.errors import Code, ServingError

log = logging.getLogger("mariner.supervisor")

PIP_TIMEOUT_S = 600.0  # a cold download of a few large wheels; TorchServe waits without limit
OUTPUT_TAIL_BYTES = 64 * 1024
REASON_LINES = 8  # of pip's output, in the log line and the error: pip's reason is at its end


@dataclass(frozen=True)
class PipRun:
    """What running pip gave: its exit code (None when it was killed at the timeout), the ends of
    its stdout (progress) and stderr (warnings and the reason it failed)."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def reason(self) -> str:
        """pip's own words for a failure: its stderr's last lines, else its stdout's."""
        return last_lines(self.stderr) or last_lines(self.stdout) or "(pip wrote nothing)"


def pip_command(python: str, target: Path, requirements: Path) -> list[str]:
    """The pip call for one archive; no index option: pip's own configuration decides."""
    return [
        python,
        "-m",
        "pip",
        "install",
        "--no-input",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--target",
        str(target),
        "-r",
        str(requirements),
    ]


def pip_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment for pip (its PIP_* settings included), less Mariner's tokens:
    a package's build step is code from the index and has no business seeing them."""
    env = {k: v for k, v in environ.items() if not (k.startswith("MARINER_") and "TOKEN" in k)}
    env["PYTHONUNBUFFERED"] = "1"  # its lines reach the log in the order pip wrote them
    return env


def last_lines(text: str, n: int = REASON_LINES) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


async def run_pip(command: Sequence[str], cwd: Path, env: Mapping[str, str], timeout_s: float) -> PipRun:
    """Run pip to its end or to the timeout, keeping the end of each of its two streams."""
    t0 = time.monotonic()
    proc = ChildProcess.start(
        command,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a timeout ends pip and any build it started
    )
    assert proc.popen.stdout is not None
    assert proc.popen.stderr is not None
    tails = (bytearray(), bytearray())
    readers = [
        asyncio.ensure_future(_keep_tail(await stream_reader(proc.popen.stdout), tails[0])),
        asyncio.ensure_future(_keep_tail(await stream_reader(proc.popen.stderr), tails[1])),
    ]
    try:
        try:
            code: int | None = await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            code = None
        # EOF follows the exit, unless something pip started still holds a pipe.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*readers)), 5.0)
    except asyncio.CancelledError:  # a register given up (the server stops): pip goes with it
        _kill_group(proc.pid)
        raise
    finally:
        for reader in readers:
            reader.cancel()
    out, err = (t.decode(errors="replace") for t in tails)
    return PipRun(code, out, err, time.monotonic() - t0)


async def _keep_tail(stream: asyncio.StreamReader, tail: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        tail.extend(chunk)
        del tail[:-OUTPUT_TAIL_BYTES]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def install_requirements(
    archive: ModelArchive,
    *,
    python: str = sys.executable,
    timeout_s: float = PIP_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> Path | None:
    """Install the archive's requirements file into its own directory; None when it has none.

    Raises ServingError(INVALID_ARGUMENT), TorchServe's 400 for a register whose pip install
    failed, with pip's last lines."""
    wanted = archive.manifest.get("model", {}).get("requirementsFile")
    if not wanted:
        return None
    where = f"archive {archive.path.name}: model {archive.name} version {archive.version}"
    requirements = inside(archive.model_dir, str(wanted))
    if requirements is None or not requirements.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"{where}: requirementsFile {wanted!r} is not a file inside the archive",
        )
    target = requirements_dir(archive.model_dir)
    command = pip_command(python, target, requirements)
    log.info(
        "model %s version %s: installing %s with pip into %s", archive.name, archive.version, wanted, target
    )
    run = await run_pip(
        command, archive.model_dir, pip_environment(os.environ if environ is None else environ), timeout_s
    )
    if run.returncode == 0:
        log.info(
            "model %s version %s: requirements installed in %.1f s",
            archive.name,
            archive.version,
            run.seconds,
        )
        return target
    why = (
        f"pip was stopped after {timeout_s:g} s" if run.returncode is None else f"pip exited {run.returncode}"
    )
    reason = run.reason
    log.error("%s: installing the requirements failed (%s):\n%s", where, why, reason)
    raise ServingError(
        Code.INVALID_ARGUMENT,
        f"{where}: installing its requirements file {wanted} with pip failed ({why}; "
        f"install_py_dep_per_model=true): {reason}",
    )


async def requirements_step(archive: ModelArchive, *, install: bool) -> None:
    """What the registry does with an opened archive's requirements file: install it when
    `install_py_dep_per_model` is on, else say once that it is not installed (as TorchServe,
    which then serves the model with the server's environment alone)."""
    wanted = archive.manifest.get("model", {}).get("requirementsFile")
    if not wanted:
        return
    if install:
        await install_requirements(archive)
        return
    log.info(
        "model %s version %s: its requirements file %s is not installed (install_py_dep_per_model is off)",
        archive.name,
        archive.version,
        wanted,
    )
