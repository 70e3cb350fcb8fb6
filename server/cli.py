"""`mariner` console script. `mariner serve ...` starts the server; flags = MARINER_* env = config keys.

`mariner serve` also takes the `torchserve` command line users already type (`--ts-config`,
`--model-store`, `--models a=a.mar b.mar`, `--start`, `--foreground`, `--ncs`, ...; see
server/compat/torchserve/flags.py and docs/torchserve-config.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path


def _private_metrics_dir(argv: Sequence[str]) -> Path:
    """A private, empty dir for prometheus_client's multiprocess mode, set in the environment
    before prometheus_client is imported here or in any child (they inherit it).

    Under the work dir when one is set (flag > MARINER_WORK_DIR > config file, as for every
    setting), else in the system temp dir; removed at exit. A PROMETHEUS_MULTIPROC_DIR set
    by the caller is not used: stale files there would be counted as ours.
    """
    work_dir = _flag(argv, "--work-dir") or os.environ.get("MARINER_WORK_DIR")
    config_file = _flag(argv, "--config-file") or os.environ.get("MARINER_CONFIG_FILE")
    if not work_dir and config_file and not config_file.endswith(".properties"):
        # Read before the config module is imported: it imports prometheus_client, which must
        # see PROMETHEUS_MULTIPROC_DIR first. A bad file is reported by load_config later.
        import yaml

        with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
            work_dir = (yaml.safe_load(Path(config_file).read_text()) or {}).get("work_dir")
    from mariner.server.supervisor.private_dir import check_private, ensure_private_dir

    parent = None
    if work_dir:
        parent = ensure_private_dir(Path(work_dir))  # ours alone, or start-up is refused
    path = Path(tempfile.mkdtemp(prefix="mariner-metrics-", dir=parent))  # made 0700 atomically
    check_private(path, what="metrics dir")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return path


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of `name` on the command line (`--name V` or `--name=V`, the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


def _serve(argv: Sequence[str]) -> int:
    """`mariner serve`: the supervisor, which starts the frontends and the model workers."""
    if "-h" in argv or "--help" in argv:
        from mariner.server.common.config_flags import build_parser

        build_parser().parse_args(["--help"])
    from mariner.server.contracts.errors import ServingError

    try:
        metrics_dir = _private_metrics_dir(argv)
    except ServingError as exc:
        print(f"mariner serve: {exc.message}", file=sys.stderr)
        return 2
    try:
        return _supervise(argv)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _supervise(argv: Sequence[str]) -> int:
    from mariner.server.common.config import frontend_count
    from mariner.server.common.config_loading import load_config
    from mariner.server.common.logs import setup_logging
    from mariner.server.contracts.errors import ServingError

    try:
        cfg = load_config(argv)
        frontend_count(cfg)
        from mariner.server.compat.torchserve.metrics import use_metrics_config, use_metrics_mode

        use_metrics_config(cfg.metrics_config)  # checked now; children inherit it
        use_metrics_mode(cfg.metrics_mode, cfg.model_metrics_auto_detect, cfg.disable_system_metrics)
    except (ValueError, OSError) as exc:
        print(f"mariner serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.log_level)
    from mariner.server.common import event_loop
    from mariner.server.supervisor.main import run

    try:
        return event_loop.run(run(cfg))
    except (ServingError, OSError, RuntimeError) as exc:
        # Start-up failures (missing archive, port in use) are the user's to fix: say what, no traceback.
        logging.getLogger("mariner").error("cannot start: %s", getattr(exc, "message", exc))
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: mariner serve [options]   (mariner serve --help for the options)")
        print("       mariner torchserve [--start|--stop] [--foreground] [torchserve's flags]")
        print("       mariner predict|infer MODEL FILE [--url URL | --grpc HOST:PORT]   (client)")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve" and rest[:1] == ["torchserve"]:
        # The images' entrypoint is `mariner serve`; a KServe TorchServe ServingRuntime passes
        # `torchserve --start ...` as its args (server/compat/torchserve/command.py).
        from mariner.server.compat.torchserve.command import main as torchserve

        return torchserve(rest[1:], kserve=True)
    if command == "serve":
        return _serve(rest)
    if command == "torchserve":
        from mariner.server.compat.torchserve.command import main as torchserve

        return torchserve(rest)
    if command in ("predict", "infer"):
        from mariner.client.cli import run

        return run(command, rest)
    print(
        f"mariner: unknown command {command!r}; available: serve, torchserve, predict, infer", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
