"""The supervisor's handle on one model worker process: start it, kill it, stop it, wait for it.

A CPU worker is forked by the zygote (`zygote.py`: a fresh interpreter that imported torch once
and never touches CUDA; a fork of the supervisor would not do, a forked CUDA context is unusable),
or, with `MARINER_WORKER_START=spawn` or when no zygote can fork it, a fresh interpreter (`python -m
mariner.server.worker.main`). A worker placed on a GPU (or required to have one) is always a
fresh interpreter: it initialises CUDA itself, with nothing inherited from a fork. Either way
it runs in a session of its own (a signal to the parent's process group does not reach it; we
stop it ourselves, and SIGKILL its whole group), one pipe of its own carries exactly one line,
the ready line, and its stdout and stderr are pipes the supervisor reads (`output`: TorchServe's
`MODEL_LOG`, see `compat.torchserve.logs.worker_output`), or, without an output, the parent's stderr. Its
environment is the supervisor's less every secret (`child_env`), and it is SIGKILLed by the
kernel when its parent dies (`parent_death`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from mariner.server.common import parent_death
from mariner.server.common.archive import ModelArchive
from mariner.server.common.child_env import child_env
from mariner.server.common.child_process import kill_worker, start_child, wait_exit
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.worker_api import EXIT_LOAD_FAILED, WorkerEndpoint, WorkerSpec, spec_to_json
from mariner.server.supervisor import zygote_client as zygote
from mariner.server.supervisor.private_dir import check_private, make_private_subdir

log = logging.getLogger("mariner.worker_process")

# Unix socket paths must fit sun_path (108 bytes with the terminating NUL).
MAX_SOCKET_PATH = 100
# How workers start: "zygote" (forked from the fork server, the default) or "spawn" (a fresh
# interpreter each). Read from the worker's environment.
START_ENV = "MARINER_WORKER_START"


class WorkerLoadFailed(ServingError):
    """The worker refused or failed to load its model; `traceback`: it printed the handler's
    traceback to its output (the supervisor's log line then points there instead of repeating it)."""

    def __init__(self, code: Code, message: str, *, traceback: bool = False) -> None:
        super().__init__(code, message)
        self.traceback = traceback


class WorkerStartTimeout(ServingError):
    """The worker was not ready within its startupTimeout and was killed."""


class WorkerOutputs(Protocol):
    """Who reads a worker's stdout and stderr (the supervisor's `ts_logging.WorkerOutput`)."""

    def attach(self, worker: str, stdout_fd: int, stderr_fd: int) -> None: ...


class WorkerProcess:
    """Starts, watches and stops one worker process."""

    def __init__(
        self, spec: WorkerSpec, *, env: Mapping[str, str] | None = None, output: WorkerOutputs | None = None
    ) -> None:
        self._spec = spec
        self._output = output
        # Handler code reads its environment: no token may be in it.
        self._env = child_env(os.environ if env is None else env)
        self._proc: subprocess.Popen[bytes] | None = None  # spawned
        self._forked: zygote.ZygoteChild | None = None  # forked by the zygote
        self._endpoint: WorkerEndpoint | None = None
        self._exited: asyncio.Event | None = None
        self._output_ends: tuple[int, int] | None = None  # read ends of its stdout, stderr

    @property
    def spec(self) -> WorkerSpec:
        return self._spec

    @property
    def pid(self) -> int | None:
        if self._forked is not None:
            return self._forked.pid
        return None if self._proc is None else self._proc.pid

    @property
    def forked(self) -> bool:
        """Whether the zygote forked it (False: a fresh interpreter, or not started)."""
        return self._forked is not None

    @property
    def endpoint(self) -> WorkerEndpoint | None:
        return self._endpoint

    @property
    def returncode(self) -> int | None:
        if self._forked is not None:
            return self._forked.returncode
        return None if self._proc is None else self._proc.poll()

    async def start(self, timeout: float) -> WorkerEndpoint:
        """Start the worker and wait for its ready line. Raises ServingError with the worker's
        reason if it exits (or `timeout` passes) first; the process is gone then."""
        if len(self._spec.socket_path.encode()) > MAX_SOCKET_PATH:
            raise ServingError(Code.INTERNAL, f"worker socket path too long: {self._spec.socket_path}")
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        deadline = loop.time() + timeout  # one clock for the fork and the load (startupTimeout)
        ready_fd: int | None = None
        if start_method(self._spec, self._env) == "zygote":
            try:
                async with asyncio.timeout_at(deadline):
                    ready_fd = await self._fork()
            except zygote.ZygoteUnavailable as exc:
                log.warning("worker %s: %s; starting a fresh interpreter instead", self._spec.id, exc)
            except TimeoutError:
                # The fork and the load share one deadline, and it has passed: a fresh interpreter
                # started now would be killed at once, so no worker can be ready in time. `_fork`
                # has closed its pipes; the zygote kills a child it forks for the cancelled request.
                raise self._start_timeout(timeout) from None
        if ready_fd is None:
            ready_fd = self._spawn()
        self._attach_output()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(ready_fd, "rb")
        )
        try:
            async with asyncio.timeout_at(deadline):
                line = await reader.readline()
                ready = _parse_ready(line)
                if ready is None or not ready.get("ready"):
                    code = await self.wait()
                    exited = f"exited with {_describe_exit(code)} before it was ready"
                    reason = (ready or {}).get("error") or exited
                    raise WorkerLoadFailed(
                        Code.INVALID_ARGUMENT if code == EXIT_LOAD_FAILED else Code.INTERNAL,
                        f"model {self._spec.model} version {self._spec.version} failed to load: {reason}",
                        traceback=bool((ready or {}).get("traceback")),
                    )
        except TimeoutError:
            self.kill()
            await self.wait()
            raise self._start_timeout(timeout) from None
        except BaseException:
            self.kill()
            raise
        finally:
            transport.close()
        pid = self.pid
        assert pid is not None
        self._endpoint = WorkerEndpoint(
            id=self._spec.id,
            instance=self._spec.instance,
            generation=self._spec.generation,
            socket_path=self._spec.socket_path,
            pid=pid,
            device=str(ready.get("device", self._spec.device)),
            status="READY",
            start_time=time.time(),
            load_seconds=float(ready.get("load_seconds") or (time.monotonic() - t0)),
            ts_name=self._spec.ts_name,
        )
        return self._endpoint

    def _start_timeout(self, timeout: float) -> WorkerStartTimeout:
        """The error for a start past its startupTimeout: one message whether the fork or the
        load ran out of time, so the caller need not know which."""
        return WorkerStartTimeout(
            Code.INTERNAL,
            f"model {self._spec.model} version {self._spec.version}: its worker was not ready "
            f"within its startupTimeout ({timeout:g} s) and was killed",
        )

    def _output_pipes(self) -> tuple[int, int]:
        """The write ends the worker gets as its stdout and stderr: pipes for `output` to read
        (their read ends kept until the process exists), or the parent's stderr (duplicated)."""
        if self._output is None:
            return os.dup(2), os.dup(2)
        (out_r, out_w), (err_r, err_w) = os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)
        self._output_ends = (out_r, err_r)
        return out_w, err_w

    def _attach_output(self) -> None:
        """The worker exists: hand the read ends of its stdout and stderr to `output`."""
        ends, self._output_ends = self._output_ends, None
        if ends is not None and self._output is not None:
            self._output.attach(self._spec.ts_name, *ends)

    def _drop_output(self) -> None:
        ends, self._output_ends = self._output_ends, None
        for fd in ends or ():
            os.close(fd)

    async def _fork(self) -> int:
        """Have the zygote fork the worker; returns the read end of its ready-line pipe."""
        client = zygote.client_for(self._env)
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        out_w, err_w = self._output_pipes()
        try:
            self._forked = await client.fork(
                spec_to_json(self._spec), (write_fd, out_w, err_w), env=self._env, cwd=os.getcwd()
            )
        except BaseException:
            os.close(read_fd)
            self._drop_output()
            zygote.note_result(client, ok=False)
            raise
        finally:
            for fd in (write_fd, out_w, err_w):
                os.close(fd)  # the worker holds the only write ends now: EOF when it dies
        zygote.note_result(client, ok=True)
        return read_fd

    def _spawn(self) -> int:
        """A fresh interpreter; returns the read end of its ready-line pipe."""
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
        out_w, err_w = self._output_pipes()
        try:
            # Popen on the loop's own thread: the child must not be tied to a thread that ends.
            self._proc = start_child(
                [sys.executable, "-m", "mariner.server.worker.main", "--ready-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(write_fd,),
                env=parent_death.env_for_this_parent(self._env),
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(read_fd)
            self._drop_output()
            raise
        finally:
            for fd in (write_fd, out_w, err_w):
                os.close(fd)
        proc = self._proc
        assert proc.stdin is not None
        try:
            proc.stdin.write(spec_to_json(self._spec).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the ready line says nothing and wait() tells why
        return read_fd

    def kill(self) -> None:
        """SIGKILL the worker and its process group now."""
        if self._forked is not None:
            # The zygote reaps it at once: once its exit is known its pid may be reused, so only
            # its group (which outlives it while anything it started still runs) is killed then.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._forked.pid, signal.SIGKILL)
            if self._forked.returncode is None:
                kill_worker(self._forked.pid)
        elif self._proc is not None:
            kill_worker(self._proc.pid)

    async def stop(self, grace: float) -> None:
        """SIGTERM (the worker finishes the batch in hand), then SIGKILL after `grace` seconds."""
        pid = self.pid
        if pid is None:
            return
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), grace)
            except TimeoutError:
                log.warning("worker %s (pid %d) did not stop within %g s; killing it", self._spec.id,
                            pid, grace)  # fmt: skip
        self.kill()  # also whatever it left in its group
        await self.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._spec.socket_path)

    async def wait(self) -> int:
        """The exit code once the worker has exited (negative: killed by that signal)."""
        if self._forked is not None:
            return await self._forked.wait()  # the zygote reaps it and reports the status
        assert self._proc is not None, "not started"
        return await wait_exit(self._proc)


def start_method(spec: WorkerSpec, env: Mapping[str, str]) -> str:
    """How `spec`'s worker starts: "spawn" (a fresh interpreter) for a GPU worker, whatever the
    environment says, since CUDA in a forked child is only safe if nothing before the fork touched
    it; else "zygote" (fork) unless `MARINER_WORKER_START=spawn`."""
    if spec.gpu_id is not None or spec.require_gpu:
        return "spawn"
    return "spawn" if env.get(START_ENV, "zygote") == "spawn" else "zygote"


def _parse_ready(line: bytes) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def socket_dir_for(work_dir: Path) -> tuple[Path, bool]:
    """Where worker sockets go: under the (private) work dir when the path stays short, else a
    private dir under /tmp (Unix socket paths must be < 108 bytes). Either is made 0700 and
    checked (ours, no group/other access). Returns (dir, whether it is a temp dir)."""
    candidate = work_dir / "sockets"
    if len(str(candidate)) + 40 <= MAX_SOCKET_PATH:
        return make_private_subdir(work_dir, "sockets", what="worker socket dir"), False
    made = Path(tempfile.mkdtemp(prefix="mrnr-"))  # created 0700 atomically, a fresh name
    return check_private(made, what="worker socket dir"), True


def socket_path_for(socket_dir: Path, model: str, version: str, instance: int, generation: int) -> str:
    tag = hashlib.sha256(f"{model}\0{version}".encode()).hexdigest()[:10]
    return str(socket_dir / f"{tag}-{instance}.{generation}.sock")


def worker_spec(
    archive: ModelArchive,
    *,
    instance: int,
    generation: int,
    batch_size: int,
    gpu_id: int | None,
    torch_threads: int | None,
    socket_dir: Path,
    require_gpu: bool = False,
    ts_port: int = 0,
) -> WorkerSpec:
    """What a worker needs to load one instance of an opened, checked archive: the one place a
    WorkerSpec is built (the supervisor's worker pool; tests that start a worker alone)."""
    return WorkerSpec(
        model=archive.name,
        version=archive.version,
        instance=instance,
        generation=generation,
        model_dir=str(archive.model_dir),
        archive_file=str(archive.path),
        sha256=archive.sha256,
        manifest=archive.manifest,
        model_config=archive.model_config,
        batch_size=batch_size,
        gpu_id=gpu_id,
        torch_threads=torch_threads,
        socket_path=socket_path_for(socket_dir, archive.name, archive.version, instance, generation),
        require_gpu=require_gpu,
        ts_port=ts_port,
    )
