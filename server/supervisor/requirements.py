"""An archive's own Python requirements, installed for that model alone (TorchServe's
`install_py_dep_per_model=true`).

`torch-model-archiver --requirements-file r.txt` records the file in the manifest
(`model.requirementsFile`). With the setting on, the supervisor reads that file as package
requirements and nothing else (`requirement_lines`: no pip options, paths or URLs, refused with
the line's number) and runs, before the model's first worker starts,
`python -m pip install --target <model_dir>/.mariner-requirements --only-binary=:all: <requirements>`
with the server's own interpreter and the index the server's pip is configured with (pip.conf,
`PIP_*` of the server's environment: the operator's, never the archive's). The target is inside
the version's private unpacked directory, never the server's environment, so two models may pin
different versions of one package and removing the model removes its packages. The worker puts
that directory right after the archive's directory on its `sys.path`
(`worker.main.isolate_sys_path`), before the server's site-packages, as TorchServe's PYTHONPATH
does for its `pip install -t <model dir>`.

pip is bounded: binary wheels only unless the operator allows builds
(`install_py_dep_allow_builds`: a source build runs the package's setup code), a time limit
(`install_py_dep_timeout_s`) and a disk cap on what it downloads and installs
(`install_py_dep_max_mb`, its target and its own TMPDIR measured while it runs). It runs in an
empty directory of its own (nothing of the archive resolves against it), in its own session so a
stop kills it and whatever it started, with the server's environment less Mariner's tokens. A
failure is one ServingError naming the archive, the requirements file, what was asked and why pip
was stopped or its exit code, so that model alone is FAILED (at start-up) or its register refused.
The answer never quotes pip's output (it may echo whatever it read); pip's last lines go to the
server's log for the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mariner.server.common.archive import ModelArchive, requirements_dir
from mariner.server.common.archive_fields import inside
from mariner.server.common.child_process import ChildProcess, stream_reader
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.requirement_lines import RequirementsRefused, read_requirements

log = logging.getLogger("mariner.supervisor")

PIP_TIMEOUT_S = 600.0  # a cold download of a few large wheels; TorchServe waits without limit
PIP_MAX_MB = 4096  # torch's CPU wheel unpacked is ~1 GB; a CUDA build several
OUTPUT_TAIL_BYTES = 64 * 1024
REASON_LINES = 8  # of pip's output, in the log line: pip's reason is at its end
DISK_POLL_S = 0.5  # how often pip's bytes on disk are measured while it runs
SHOWN_REQUIREMENTS = 10  # of the requirements, named in an error


@dataclass(frozen=True)
class PipLimits:
    """The operator's bounds on one install (module docstring)."""

    timeout_s: float = PIP_TIMEOUT_S
    max_bytes: int = PIP_MAX_MB << 20
    allow_builds: bool = False


@dataclass(frozen=True)
class PipRun:
    """What running pip gave: its exit code (None when it was stopped), why it was stopped, the ends
    of its stdout (progress) and stderr (warnings and the reason it failed)."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    stopped: str | None = None

    @property
    def reason(self) -> str:
        """pip's own words for a failure (for the log): its stderr's last lines, else its stdout's."""
        return last_lines(self.stderr) or last_lines(self.stdout) or "(pip wrote nothing)"


def pip_command(
    python: str, target: Path, requirements: Sequence[str], *, allow_builds: bool = False
) -> list[str]:
    """The pip call for one archive's checked requirements. No index option: the server's pip
    configuration decides; no `-r`: pip never reads a file of the archive."""
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
        *(() if allow_builds else ("--only-binary=:all:",)),
        *requirements,
    ]


def pip_environment(environ: Mapping[str, str], scratch: Path | None = None) -> dict[str, str]:
    """The server's environment for pip (its PIP_* settings included), less Mariner's tokens:
    a package's build step is code from the index and has no business seeing them. With `scratch`,
    pip's temporary files go there, where the disk cap counts them."""
    env = {k: v for k, v in environ.items() if not (k.startswith("MARINER_") and "TOKEN" in k)}
    env["PYTHONUNBUFFERED"] = "1"  # its lines reach the log in the order pip wrote them
    if scratch is not None:
        env["TMPDIR"] = str(scratch)
    return env


def last_lines(text: str, n: int = REASON_LINES) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def tree_bytes(paths: Sequence[Path]) -> int:
    """Bytes on disk under `paths` (symlinks not followed; a file gone mid-walk is skipped)."""
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


async def run_pip(
    command: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    *,
    max_bytes: int | None = None,
    measured: Sequence[Path] = (),
) -> PipRun:
    """Run pip to its end, to the timeout or, with `max_bytes`, until what it wrote under
    `measured` passes that, keeping the end of each of its two streams."""
    t0 = time.monotonic()
    proc = ChildProcess.start(
        command,
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a stop ends pip and any build it started
    )
    assert proc.popen.stdout is not None
    assert proc.popen.stderr is not None
    tails = (bytearray(), bytearray())
    readers = [
        asyncio.ensure_future(_keep_tail(await stream_reader(proc.popen.stdout), tails[0])),
        asyncio.ensure_future(_keep_tail(await stream_reader(proc.popen.stderr), tails[1])),
    ]
    exited = asyncio.ensure_future(proc.wait())
    code: int | None = None
    stopped: str | None = None
    try:
        while True:
            left = t0 + timeout_s - time.monotonic()
            if left <= 0:
                stopped = f"pip was stopped after {timeout_s:g} s (install_py_dep_timeout_s)"
                break
            try:
                code = await asyncio.wait_for(asyncio.shield(exited), min(left, DISK_POLL_S))
                break
            except TimeoutError:
                if max_bytes is not None and await asyncio.to_thread(tree_bytes, measured) > max_bytes:
                    stopped = (
                        f"pip was stopped when its files passed {max_bytes >> 20} MiB (install_py_dep_max_mb)"
                    )
                    break
        if stopped is not None:
            _kill_group(proc.pid)
            await exited
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
    return PipRun(code, out, err, time.monotonic() - t0, stopped)


async def _keep_tail(stream: asyncio.StreamReader, tail: bytearray) -> None:
    while chunk := await stream.read(1 << 16):
        tail.extend(chunk)
        del tail[:-OUTPUT_TAIL_BYTES]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _named(requirements: Sequence[str]) -> str:
    shown = ", ".join(requirements[:SHOWN_REQUIREMENTS])
    more = len(requirements) - SHOWN_REQUIREMENTS
    return shown + (f" and {more} more" if more > 0 else "")


async def install_requirements(
    archive: ModelArchive,
    *,
    python: str = sys.executable,
    limits: PipLimits = PipLimits(),
    environ: Mapping[str, str] | None = None,
) -> Path | None:
    """Install the archive's requirements into its own directory; None when it names none.

    Raises ServingError(INVALID_ARGUMENT), TorchServe's 400 for a register whose requirements are
    refused or whose pip install failed, in our own words (module docstring)."""
    wanted = archive.manifest.get("model", {}).get("requirementsFile")
    if not wanted:
        return None
    where = f"archive {archive.path.name}: model {archive.name} version {archive.version}"
    path = inside(archive.model_dir, str(wanted))
    if path is None or not path.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"{where}: requirementsFile {wanted!r} is not a file inside the archive",
        )
    try:
        # Off the supervisor's loop: up to 64 KiB and 500 requirements parsed.
        requirements = await asyncio.to_thread(read_requirements, path, shown_as=f"requirementsFile {wanted}")
    except RequirementsRefused as exc:
        raise ServingError(Code.INVALID_ARGUMENT, f"{where}: {exc}") from None
    if not requirements:
        log.info("model %s version %s: %s names no requirement", archive.name, archive.version, wanted)
        return None
    target = requirements_dir(archive.model_dir)
    scratch = Path(tempfile.mkdtemp(prefix=".pip-", dir=archive.model_dir.parent))
    command = pip_command(python, target, requirements, allow_builds=limits.allow_builds)
    log.info(
        "model %s version %s: installing %s with pip into %s",
        archive.name,
        archive.version,
        _named(requirements),
        target,
    )
    try:
        run = await run_pip(
            command,
            scratch,  # empty: nothing of the archive resolves against pip's working directory
            pip_environment(os.environ if environ is None else environ, scratch),
            limits.timeout_s,
            max_bytes=limits.max_bytes,
            measured=(target, scratch),
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, scratch, True)
    if run.returncode == 0:
        log.info(
            "model %s version %s: requirements installed in %.1f s",
            archive.name,
            archive.version,
            run.seconds,
        )
        return target
    why = run.stopped or f"pip exited {run.returncode}"
    log.error("%s: installing the requirements failed (%s); pip's last lines:\n%s", where, why, run.reason)
    await asyncio.to_thread(shutil.rmtree, target, True)
    raise ServingError(
        Code.INVALID_ARGUMENT,
        f"{where}: installing its requirements ({_named(requirements)}) with pip failed ({why}; "
        "install_py_dep_per_model=true); pip's output is in the server's log",
    )


async def requirements_step(archive: ModelArchive, *, install: bool, limits: PipLimits = PipLimits()) -> None:
    """What the registry does with an opened archive's requirements file: install it when
    `install_py_dep_per_model` is on, else say once that it is not installed (as TorchServe,
    which then serves the model with the server's environment alone)."""
    wanted = archive.manifest.get("model", {}).get("requirementsFile")
    if not wanted:
        return
    if install:
        await install_requirements(archive, limits=limits)
        return
    log.info(
        "model %s version %s: its requirements file %s is not installed (install_py_dep_per_model is off)",
        archive.name,
        archive.version,
        wanted,
    )
