"""A model worker process: `python -m mariner.server.worker.main [SPEC.json]` (spec on stdin
when no path is given).

It puts only its archive's directory on `sys.path`, loads the handler (a `ModelHost`), listens
on the spec's Unix socket, and writes one JSON line to its ready pipe (`--ready-fd N`; without
it, its stdout, which then points at stderr): `{"ready": true, "pid", "device",
"load_seconds"}`, or `{"ready": false, "error"}` followed by exit code 3 when loading failed.
Its stdout and stderr are the handler's, line-buffered, and its own log goes to stdout in
TorchServe's backend format (the bare message): the supervisor reads
both as TorchServe's frontend reads a backend's (`compat.torchserve.logs.worker_output`).

The serving itself (one thread, one queue of batches from every frontend, a coroutine handler's
concurrent calls, intermediate answers) is `batch_server.py`'s `Worker`; this module makes the
process around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from mariner.server.common.heap import freeze_heap
from mariner.server.common.scheduling import batch_class
from mariner.server.contracts.worker_api import (
    EXIT_LOAD_FAILED,
    WorkerSpec,
    spec_from_json,
)
from mariner.server.worker.batch_server import Worker

log = logging.getLogger("mariner.worker")


def isolate_sys_path(model_dir: str) -> None:
    """Make `model_dir` the only place model code imports from: drop the current directory and the
    script's directory (which `-m` and `-c` put first) and put the archive's directory first, then
    the requirements pip installed for it (install_py_dep_per_model), before site-packages."""
    from mariner.server.common.archive import requirements_dir

    cwd = os.getcwd()
    deps = str(requirements_dir(Path(model_dir)))
    kept = [p for p in sys.path if p not in ("", ".", cwd, model_dir, deps)]
    sys.path[:] = [model_dir, *([deps] if os.path.isdir(deps) else []), *kept]


def _ready_stream(ready_fd: int) -> IO[str]:
    """The ready line's stream: its own pipe (no child of the handler inherits it), or, given
    fd 1, the real stdout kept for that line alone while fd 1 then points at stderr, so whatever
    the handler prints lands in the log, not in the parent's ready-line reader. Either way the
    handler's stdout and stderr are line-buffered: a `print()` reaches the log when made."""
    if ready_fd == 1:
        ready = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    else:
        os.set_inheritable(ready_fd, False)
        ready = os.fdopen(ready_fd, "w")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    return ready


def _load(spec: WorkerSpec) -> tuple[Any, float]:
    from mariner.server.common.archive import ModelArchive
    from mariner.server.worker.device import Placement
    from mariner.server.worker.runner import ModelHost
    from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

    ensure_torchvision_importable()  # before the handler imports torchvision (ts's vision handlers do)
    archive = ModelArchive(
        name=spec.model,
        version=spec.version,
        path=Path(spec.archive_file),
        sha256=spec.sha256,
        model_dir=Path(spec.model_dir),
        manifest=spec.manifest,
        model_config=spec.model_config,
    )
    host = ModelHost(
        archive,
        id=spec.id,
        placement=Placement(
            gpu_id=spec.gpu_id, torch_threads=spec.torch_threads, require_gpu=spec.require_gpu
        ),
        batch_size=spec.batch_size,
    )
    return host, host.load()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from mariner.server.common import parent_death

    parent_death.arm_from_env()
    parser = argparse.ArgumentParser(prog="mariner.server.worker.main")
    parser.add_argument("spec", nargs="?", help="the WorkerSpec as JSON (default: stdin)")
    parser.add_argument("--ready-fd", type=int, default=1, help="where the ready line goes (default: stdout)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    spec = spec_from_json(Path(args.spec).read_text() if args.spec else sys.stdin.read())
    return run_worker(spec, args.ready_fd)


def _event_loop_runner() -> Any:
    """uvloop's `run` where it is installed (it ships with uvicorn[standard]): its socket reads
    and writes and its cross-thread wake-up cost less CPU per batch than asyncio's selector loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.run
    return uvloop.run


def run_worker(spec: WorkerSpec, ready_fd: int = 1) -> NoReturn:
    """Load and serve `spec`, then exit; the ready line goes to `ready_fd`. The entry both for a
    fresh interpreter (`main`) and for a child forked by the zygote (`zygote.py`), which has set
    up its fds first."""
    ready_out = _ready_stream(ready_fd)
    # TorchServe's backend logs the bare message to stdout; its frontend adds the time, the
    # worker's name and the level when it logs the line (here the supervisor does).
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s", force=True)
    isolate_sys_path(spec.model_dir)
    # SIGINT is not how a worker is stopped (the supervisor or its runner sends SIGTERM) and a
    # worker has its own session, so no terminal sends it one. Set it explicitly rather than
    # inherit it: a fresh interpreter started from a background job inherits SIG_IGN, one from
    # a terminal gets KeyboardInterrupt, and a zygote's fork would get whatever the zygote had.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        host, load_seconds = _load(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, then exit 3
        from mariner.server.contracts.errors import ServingError

        ours = exc if isinstance(exc, ServingError) else None  # one check: narrowed for mypy
        reason = ours.message if ours is not None else f"{type(exc).__name__}: {exc}"
        if ours is not None:
            log.error("worker %s: loading failed: %s", spec.id, reason)
        else:  # the traceback says what was raised; the supervisor's line points here
            log.error("worker %s: loading the handler failed", spec.id, exc_info=True)
        ready = {"ready": False, "error": reason[:2000], "traceback": ours is None}
        ready_out.write(json.dumps(ready) + "\n")
        ready_out.flush()
        _end(EXIT_LOAD_FAILED)
    worker = Worker(spec, host)
    from mariner.server.compat.torchserve.metrics import record_worker_load

    record_worker_load(spec.ts_name, load_seconds)  # TorchServe's WorkerLoadTime (prometheus mode)
    host.on_oom = worker.count_oom
    # torch and the model leave a large heap of long-lived objects; every batch allocates many
    # short-lived ones, so without freezing the former, each full collection walks them all
    # (tens of ms that every batch in flight waits for).
    freeze_heap()
    batch_class()  # the handler's thread: woken by batches, it lets the frontend run first
    code = _event_loop_runner()(worker.serve(ready_out, load_seconds))
    if not code:
        # A clean stop lets the handler and its model go first: what they hold is released with
        # them (an AOTInductor package's extracted files are removed only then).
        gc.unfreeze()
        host.unload()
        gc.collect()
    _end(code)


def _end(code: int) -> NoReturn:
    """Exit now, whether the worker served or failed to load: the ready line or the batch in hand
    is written and flushed, so nothing is left to do. Do not wait on threads the handler or torch
    started, nor run the interpreter's finalisation with them alive (the handler's own atexit
    work, a hung thread's join)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
