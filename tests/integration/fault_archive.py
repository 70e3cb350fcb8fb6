"""A fault-injection .mar built by the tests (never shipped): its handler misbehaves on command.

Each request is JSON `{"op": ..., "value": ...}`:
  ok            -> {"echo": value}
  sleep         -> sleeps `value` seconds, then answers (keeps the instance busy so others queue)
  block         -> `value` is a directory: creates `started` in it, then waits until the test
                   creates `release` there (keeps the instance busy for exactly as long as needed)
  bad_item      -> a per-item 400 via set_response_status (its batch-mates are answered)
  raise_batch   -> the handler raises for the whole batch
  wrong_count   -> the handler returns one result too few
  oom_batched   -> MemoryError whenever the batch holds more than one request (split-and-retry works)
  oom_always    -> MemoryError even alone
  hang          -> sleeps far past responseTimeout; with a path as `value`, waits until that path
                   exists instead (so the test can prove the answer came before the handler ended)
  exit          -> raises SystemExit: the instance ends and must be replaced
  cuda_fatal    -> raises RuntimeError("CUDA error: an illegal memory access was encountered"), a
                   sticky CUDA error: the worker answers, exits and is replaced
  segfault      -> reads address 0 through ctypes: the worker process dies of SIGSEGV
  abort         -> os.abort(): the worker dies of SIGABRT
  os_exit       -> os._exit(3): the worker exits at once, no cleanup
  spin          -> `while True: pass`, burning a core until the worker is killed; with a path as
                   `value`, writes its pid there first (the test then checks that pid is gone)
  memory_hog    -> caps its own address space (RLIMIT_AS) at `value` MiB above what it maps now,
                   then allocates far past it: MemoryError, answered like any out-of-memory
  pid           -> {"pid": the process running the handler}
  helper        -> {"helper": what the archive's own helper.py says} (sys.path isolation)
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

HANDLER = """
import json
import os
import time


def wait_for_path(path, cap_s=300.0):
    end = time.monotonic() + cap_s  # a cap only so a forgotten gate cannot hang the test run
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.005)


class FaultHandler:
    def initialize(self, context):
        self.initialized = True

    def handle(self, data, context):
        ops = []
        for row in data:
            body = row.get("body") if row.get("data") is None else row.get("data")
            if isinstance(body, (bytes, bytearray)):
                body = json.loads(body)
            ops.append((body.get("op", "ok"), body.get("value")))
        names = [op for op, _ in ops]
        if "raise_batch" in names:
            raise RuntimeError("injected: secret internal detail")
        if "oom_always" in names or ("oom_batched" in names and len(ops) > 1):
            raise MemoryError("injected out of memory")
        if "exit" in names:
            raise SystemExit(3)
        if "cuda_fatal" in names:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if "segfault" in names:
            import ctypes

            ctypes.string_at(0)
        if "abort" in names:
            os.abort()
        if "os_exit" in names:
            os._exit(3)
        spins = [value for op, value in ops if op == "spin"]
        if spins:
            if isinstance(spins[0], str):
                with open(spins[0] + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(spins[0] + ".tmp", spins[0])
            while True:
                pass
        hogs = [value for op, value in ops if op == "memory_hog"]
        if hogs:
            import resource

            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limit = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (mapped + int(hogs[0]) * 2**20, limit[1]))
            try:
                hog = bytearray(4 * 2**30)  # far past the cap
                del hog
            finally:
                resource.setrlimit(resource.RLIMIT_AS, limit)
        if "pid" in names:
            return [{"pid": os.getpid()} for _ in ops]
        if "helper" in names:
            import helper

            return [{"helper": helper.WHO} for _ in ops]
        hangs = [value for op, value in ops if op == "hang"]
        if hangs and isinstance(hangs[0], str):
            wait_for_path(hangs[0])
        elif hangs:
            time.sleep(8)
        out = []
        for i, (op, value) in enumerate(ops):
            if op == "sleep":
                time.sleep(float(value))
            if op == "block":
                open(os.path.join(value, "started"), "w").close()
                wait_for_path(os.path.join(value, "release"))
            if op == "bad_item":
                context.set_response_status(400, "injected bad item", idx=i)
                out.append({"error": "injected bad item"})
            else:
                out.append({"echo": value, "batch": len(ops)})
        if "wrong_count" in names:
            out.pop()
        return out
"""

CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 8
maxBatchDelay: 0
responseTimeout: {timeout}
"""


def write_handler_archive(path: Path, name: str, handler: str, files: dict[str, str]) -> Path:
    """A .mar named `name` whose manifest names `handler` and model-config.yaml (both among
    `files`, file name -> text), as torch-model-archiver lays one out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {
        "createdOn": "tests",
        "runtime": "python",
        "model": {
            "modelName": name,
            "handler": handler,
            "modelVersion": "1.0",
            "configFile": "model-config.yaml",
        },
        "archiverVersion": "tests",
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        for file_name, text in files.items():
            zf.writestr(file_name, text)
    return path


def build_fault_archive(
    store: Path, *, name: str = "faulty", response_timeout_s: int = 2, helper: str | None = None
) -> Path:
    """`helper`, when given, ships a helper.py beside the handler whose WHO is that string."""
    files = {"fault_handler.py": HANDLER, "model-config.yaml": CONFIG.format(timeout=response_timeout_s)}
    if helper is not None:
        files["helper.py"] = f"WHO = {helper!r}\n"
    return write_handler_archive(store / f"{name}.mar", name, "fault_handler.py", files)
