"""`mariner` console script. `mariner serve ...` starts the server; flags = MARINER_* env = config keys."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence


def _serve(argv: Sequence[str]) -> int:
    from mariner.server.app import run
    from mariner.server.config import load_config
    from mariner.server.core.errors import ServingError
    from mariner.server.logs import setup_logging

    try:
        cfg = load_config(argv)
    except (ValueError, OSError) as exc:
        print(f"mariner serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        runner = asyncio.run
    try:
        rc = runner(run(cfg))
    except (ServingError, OSError) as exc:
        # Start-up failures (missing archive, port in use) are the user's to fix: say what, no traceback.
        logging.getLogger("mariner").error("cannot start: %s", getattr(exc, "message", exc))
        return 2
    deadline = time.monotonic() + 1.0  # idle runner threads exit at once; give them a moment
    for t in threading.enumerate():
        if t.name.startswith("runner-"):
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t.name.startswith("runner-") and t.is_alive()]
    if stuck:
        # A hung handler's thread cannot be killed, and the interpreter would wait for it at exit.
        logging.getLogger("mariner").warning("exiting with hung handler threads: %s", ", ".join(stuck))
        logging.shutdown()
        os._exit(rc)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: mariner serve [options]   (mariner serve --help for the options)")
        print("       mariner predict|infer MODEL FILE [--url URL | --grpc HOST:PORT]   (client)")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return _serve(rest)
    if command in ("predict", "infer"):
        from mariner.client.cli import run

        return run(command, rest)
    print(f"mariner: unknown command {command!r}; available: serve, predict, infer", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
