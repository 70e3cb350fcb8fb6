"""How often a child started from a process busy in gRPC dies before it runs, by how it is started.

    python -m mariner.loadtest.experiments.child_starts --children 300

The supervisor has gRPC threads at work while it starts frontends, the zygote, workers and pip.
Started with a `preexec_fn`, or with uvloop's `create_subprocess_exec`, a child runs Python's
after-fork work and gRPC's fork handlers before exec, and now and then dies there (SIGABRT,
SIGSEGV). `mariner.server.common.child_process.ChildProcess` starts it with plain `Popen` (vfork, nothing
run before exec). This tool starts `python -c pass` N times each way, one at a time, while a
grpc.aio server on 127.0.0.1 and three client threads keep gRPC busy, and prints how the children
ended. Each way runs in a fresh interpreter of its own, so one way's state cannot reach another.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

WAYS = ("preexec_fn", "uvloop", "child_process")


def _keep_grpc_busy(port: int) -> None:
    import grpc

    call = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary("/none.Service/Method")
    while True:
        with contextlib.suppress(grpc.RpcError):  # UNIMPLEMENTED: the point is the traffic
            call(b"x" * 1000, timeout=1)


async def _one_way(way: str, children: int) -> dict[str, int]:
    import grpc

    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for _ in range(3):
        threading.Thread(target=_keep_grpc_busy, args=(port,), daemon=True).start()
    argv = [sys.executable, "-c", "pass"]

    async def start_one() -> int:
        if way == "uvloop":
            proc = await asyncio.create_subprocess_exec(*argv)
            return await proc.wait()
        if way == "preexec_fn":
            popen = subprocess.Popen(argv, start_new_session=True, preexec_fn=lambda: None)
            return await asyncio.to_thread(popen.wait)
        from mariner.server.common.child_process import ChildProcess

        return await ChildProcess.start(argv, start_new_session=True).wait()

    ended: collections.Counter[str] = collections.Counter()
    for _ in range(children):
        code = await start_one()
        ended["exit 0" if code == 0 else f"exit {code}" if code > 0 else f"signal {-code}"] += 1
    await server.stop(0)
    return dict(ended)


def _run_in_this_process(way: str, children: int) -> None:
    import uvloop

    run: Callable[[Awaitable[dict[str, int]]], dict[str, int]] = uvloop.run
    print(json.dumps(run(_one_way(way, children))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.experiments.child_starts", description=__doc__
    )
    parser.add_argument("--children", type=int, default=300, help="children per way (300)")
    parser.add_argument("--way", choices=WAYS, help="one way only (default: each in turn)")
    args = parser.parse_args(argv)
    if args.way:
        _run_in_this_process(args.way, args.children)
        return 0
    for way in WAYS:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "mariner.loadtest.experiments.child_starts",
                "--way",
                way,
                "--children",
                str(args.children),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        print(f"{way:14} {lines[-1] if lines else 'no result: ' + done.stderr[-300:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
