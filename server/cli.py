"""`mariner` console script. `mariner serve ...` starts the server; flags = MARINER_* env = config keys."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence


def _serve(argv: Sequence[str]) -> int:
    from server.app import run
    from server.config import load_config
    from server.logs import setup_logging

    cfg = load_config(argv)
    setup_logging(cfg.log_level)
    try:
        import uvloop

        return uvloop.run(run(cfg))
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(run(cfg))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: mariner serve [options]   (mariner serve --help for the options)")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return _serve(rest)
    print(f"mariner: unknown command {command!r}; available: serve", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
