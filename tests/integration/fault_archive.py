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


def build_fault_archive(store: Path, *, name: str = "faulty", response_timeout_s: int = 2) -> Path:
    store.mkdir(parents=True, exist_ok=True)
    path = store / f"{name}.mar"
    manifest = {
        "createdOn": "tests",
        "runtime": "python",
        "model": {
            "modelName": name,
            "handler": "fault_handler.py",
            "modelVersion": "1.0",
            "configFile": "model-config.yaml",
        },
        "archiverVersion": "tests",
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr("fault_handler.py", HANDLER)
        zf.writestr("model-config.yaml", CONFIG.format(timeout=response_timeout_s))
    return path
