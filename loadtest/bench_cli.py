"""The benchmark's command line: flags, the defaults that depend on the model family, and the
archive's own batching settings when none are given. `python -m mariner.loadtest.bench --help`.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mariner.loadtest.bench_report import DEFAULT_MODEL
from mariner.loadtest.bench_values import (
    PADDING_MAX,
    PROTOCOLS,
    REPO,
    SERVERS,
    STREAMS,
    Settings,
    default_servers,
)
from mariner.loadtest.workloads import FAMILIES, family_of

# ==================================================================================================
# CLI
# ==================================================================================================
DEFAULT_DURATION_S = 6.0


@dataclass(frozen=True)
class FamilyDefaults:
    """Defaults that depend on the model: a MiniLM or ResNet batch takes about a second on one
    core, the digits CNN's a millisecond, so the cheap-model defaults (500 warm-up requests,
    three client set-ups, a minute of TorchServe JIT warm-up) would make a run last an hour."""

    protocols: tuple[str, ...]
    warmup: int  # requests per measurement (the clients send at least warmup_per_client each anyway)
    warmup_per_client: int
    duration_s: float
    raw_seconds: float
    torchserve_warmup_cap_s: float
    startup: bool  # time Mariner's start-up to ready (whole store and the archive)


FAMILY_DEFAULTS = {
    "digits": FamilyDefaults(PROTOCOLS, 500, 4, DEFAULT_DURATION_S, 4.0, 60.0, True),
    "minilm": FamilyDefaults(("http",), 0, 1, 12.0, 8.0, 20.0, False),
    "resnet18": FamilyDefaults(("http",), 0, 1, 12.0, 8.0, 20.0, False),
}


def _csv(text: str, allowed: Sequence[str] | None = None) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(
        prog="python -m mariner.loadtest.bench",
        description=bench_doc(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", type=Path, default=REPO / "model_store")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"archive stem in the store; its name says its family ({', '.join(FAMILIES)}_*)",
    )
    p.add_argument(
        "--servers",
        type=lambda t: _csv(t, SERVERS),
        default=None,
        help="raw,mariner,torchserve,mosec (default: all four, mosec only when it is installed)",
    )
    p.add_argument(
        "--protocols",
        type=lambda t: _csv(t, PROTOCOLS),
        default=None,
        help="grpc (--grpc-channels channels), grpc-1ch (one channel), http, grpc-stream "
        "(StreamPredictions2) and oip-stream (ModelStreamInfer), one stream per client over "
        "--grpc-channels channels, run at the lowest and highest level only (default: all five for "
        "digits, http for MiniLM and ResNet, whose batches take about a second)",
    )
    p.add_argument(
        "--levels",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 8, 64),
        help="concurrency levels (closed-loop clients), comma-separated",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"seconds per measurement (default {DEFAULT_DURATION_S:g}, 12 for MiniLM and ResNet, "
        "unless --requests is given)",
    )
    p.add_argument("--requests", type=int, default=None, help="timed requests per measurement instead")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up requests per measurement, not timed (default 500 for digits; at least 4 per "
        "client, 1 for MiniLM and ResNet)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="measurements of each cell at the highest level (median)"
    )
    p.add_argument(
        "--grpc-channels", type=int, default=16, help="gRPC channels (connections) in all for 'grpc'"
    )
    p.add_argument(
        "--mariner-args",
        default="",
        help='extra `mariner serve` arguments, one string, e.g. "--frontends 2"',
    )
    p.add_argument(
        "--torchserve-warmup-cap",
        type=float,
        default=None,
        help="most seconds spent warming TorchServe until its throughput stops rising (default 60 "
        "for digits, 20 for the others)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="Mariner alone at the highest level: frontends x workers (default 1/2 x 1/2; writes scaling.md)",
    )
    p.add_argument(
        "--scaling-frontends",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 2),
        help="with --scaling: frontend counts, e.g. 1,2,4,8 on a 16-core machine",
    )
    p.add_argument(
        "--scaling-workers",
        type=lambda t: tuple(int(x) for x in _csv(t)),
        default=(1, 2),
        help="with --scaling: workers per model (minWorkers), e.g. 1,2",
    )
    p.add_argument(
        "--startup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time Mariner's start-up to ready (default: on for digits)",
    )
    p.add_argument(
        "--padding-compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"MiniLM: also run {PADDING_MAX}, the archive padded to max_length without the token "
        "budget, at the highest level (default: on for minilm_*)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="batchSize for both servers (default: the archive's)"
    )
    p.add_argument(
        "--max-batch-delay-ms",
        type=int,
        default=None,
        help="maxBatchDelay for both servers (default: the archive's)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for raw and both servers (1: clients need the other core here)",
    )
    p.add_argument(
        "--client-procs", type=int, default=2, help="client processes per level (fewer when conc. is lower)"
    )
    p.add_argument(
        "--raw-seconds",
        type=float,
        default=None,
        help="seconds spent timing the raw handler (default 4, 8 for MiniLM and ResNet)",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench", help="where results.md and the plots go")
    a = p.parse_args(argv)
    model = a.model.removesuffix(".mar")
    try:
        family = family_of(model)
    except ValueError as exc:
        p.error(str(exc))
    d = FAMILY_DEFAULTS[family]
    warmup = d.warmup if a.warmup is None else a.warmup
    if a.requests is not None and a.requests < 1:
        p.error("--requests must be positive")
    if a.duration is not None and a.duration <= 0:
        p.error("--duration must be positive")
    if warmup < 0 or min(a.levels) < 1 or a.client_procs < 1 or a.torch_threads < 1:
        p.error("--levels, --client-procs and --torch-threads must be positive")
    if a.repeats < 1 or a.grpc_channels < 1:
        p.error("--repeats and --grpc-channels must be positive")
    protocols = d.protocols if a.protocols is None else a.protocols
    if a.scaling and a.protocols is None:  # the unary set-ups: the table's columns, ~7 minutes
        protocols = tuple(x for x in protocols if x not in STREAMS)
    # mosec runs the digits handler's work only (`mariner.loadtest.servers.mosec`)
    servers = (default_servers() if family == "digits" else SERVERS[:3]) if a.servers is None else a.servers
    if "mosec" in servers and family != "digits":
        p.error("--servers mosec serves the digits archives only")
    duration = a.duration if a.duration is not None or a.requests is not None else d.duration_s
    return Settings(
        store=a.store.resolve(),
        model=model,
        servers=servers,
        protocols=protocols,
        levels=tuple(sorted(set(a.levels))),
        requests=a.requests or 10000,
        warmup=warmup,
        duration_s=duration,
        batch_size=a.batch_size or 0,  # 0: the archive's (archive_settings)
        max_batch_delay_ms=-1 if a.max_batch_delay_ms is None else a.max_batch_delay_ms,  # -1: the archive's
        torch_threads=a.torch_threads,
        client_procs=a.client_procs,
        raw_seconds=d.raw_seconds if a.raw_seconds is None else a.raw_seconds,
        out=a.out,
        repeats=a.repeats,
        grpc_channels=a.grpc_channels,
        mariner_args=tuple(shlex.split(a.mariner_args)),
        torchserve_warmup_cap_s=(
            d.torchserve_warmup_cap_s if a.torchserve_warmup_cap is None else a.torchserve_warmup_cap
        ),
        scaling=a.scaling,
        startup=d.startup if a.startup is None else a.startup,
        scaling_frontends=a.scaling_frontends,
        scaling_workers=a.scaling_workers,
        warmup_per_client=d.warmup_per_client,
        padding_compare=(family == "minilm") if a.padding_compare is None else a.padding_compare,
    )


def archive_settings(settings: Settings) -> Settings:
    """Fill in batchSize and maxBatchDelay from the archive's model-config where not given, so
    both servers run the archive as built (TorchServe's own defaults, 1 and 100 ms, otherwise)."""
    if settings.batch_size > 0 and settings.max_batch_delay_ms >= 0:
        return settings
    from mariner.server.common.archive import open_archive

    with tempfile.TemporaryDirectory(prefix="bench-config-") as tmp:
        config = open_archive(settings.store / f"{settings.model}.mar", Path(tmp)).model_config
    return replace(
        settings,
        batch_size=settings.batch_size or int(config.get("batchSize", 1)),
        max_batch_delay_ms=(
            settings.max_batch_delay_ms
            if settings.max_batch_delay_ms >= 0
            else int(config.get("maxBatchDelay", 100))
        ),
    )


def bench_doc() -> str:
    from mariner.loadtest import bench

    return bench.__doc__ or ""
