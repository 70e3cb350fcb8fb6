"""The raw in-process ceiling of any archive: its handler called directly, no server in the way.

The benchmark holds each server to this figure ("Mariner at 64 clients reaches N% of the raw
batched handler"), so it must be what a server could at best do with the same archive: the
archive is checked and unpacked by the server's own `open_archive`, its handler imported by the
server's own `load_entry_point` and initialised with the server's `Context`, in a spawned process
of its own with the same torch thread setting the servers get. Then `handle()` is timed on one
request (batch-1 latency) and on full batches of `batch_size` requests (requests/s): the batches
the server's batcher forms when 64 closed-loop clients keep it busy. The payloads are the
benchmark's own (`mariner.loadtest.workloads`), in turn, so the batches mix lengths and sizes
the way live traffic does; the first full batch's answers are checked like the clients' answers.

For MiniLM it also times full batches of texts sorted by length (`sorted_batched_rps`): what a
server that groups requests by length (a token budget) could reach, against arrival-order
batches padded to their longest text.

    python -m mariner.loadtest.bench ceiling --model minilm_onnx      # any archive in the store
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mariner.loadtest.closedloop import Percentiles
from mariner.loadtest.workloads import check_answer

WARMUP_CALLS = 20  # per call shape, or fewer when a call is slow (see _warm)
WARMUP_CAP_S = 10.0
SLOW_CALL_MS = 20.0  # slower calls need fewer samples for a stable median


@dataclass(frozen=True)
class CeilingSpec:
    """What to measure: the archive, the batch it is driven with, and for how long."""

    archive: Path
    family: str
    batch_size: int
    torch_threads: int
    seconds: float  # split between the batch-1 and the full-batch loops (and the model-only pair)


@dataclass(frozen=True)
class RawResult:
    """The handler called in-process: the ceiling no server can beat."""

    batch1: Percentiles  # handle() on one request
    batched_rps: float  # requests/s through handle() at the max batch size
    model_batch1: Percentiles  # digits only: predict_topk() on one decoded digit (else empty)
    model_batched_rps: float  # digits only: requests/s through predict_topk() (else NaN)
    batch_size: int
    torch_threads: int
    device: str
    batch_ms: float = math.nan  # median milliseconds of one full-batch handle() call
    sorted_batched_rps: float = math.nan  # MiniLM: full batches of length-sorted texts (see module doc)


def _timed_loop(fn: Callable[[], Any], seconds: float, *, min_iters: int = 50) -> list[float]:
    out: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(out) < min_iters:
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _warm(fn: Callable[[], Any]) -> int:
    """Call `fn` until warm (first calls fault in kernels and allocator pools): WARMUP_CALLS
    times, or at least twice and no longer than WARMUP_CAP_S. The iterations the timed loop needs
    for a stable median: 50 for a fast call, 3 for a slow one."""
    t0 = time.perf_counter()
    calls, last_ms = 0, 0.0
    while calls < WARMUP_CALLS and (calls < 2 or time.perf_counter() - t0 < WARMUP_CAP_S):
        t = time.perf_counter()
        fn()
        last_ms = (time.perf_counter() - t) * 1e3
        calls += 1
    return 50 if last_ms < SLOW_CALL_MS else 3


def measure_in_process(spec: CeilingSpec, bodies: Sequence[bytes]) -> RawResult:
    """Load the archive's handler as the server does and time it (in this process)."""
    import torch

    from mariner.server.common.archive import open_archive
    from mariner.server.worker.context import Context
    from mariner.server.worker.runner import load_entry_point
    from mariner.server.worker.torchvision_ops import ensure_torchvision_importable

    torch.set_num_threads(spec.torch_threads)  # the servers get the same setting
    gpu_id = 0 if torch.cuda.is_available() else None
    with tempfile.TemporaryDirectory(prefix="bench-raw-") as work:
        archive = open_archive(spec.archive, Path(work))
        ctx = Context(
            archive.name,
            str(archive.model_dir),
            archive.manifest,
            batch_size=spec.batch_size,
            gpu_id=gpu_id,
            model_yaml_config=archive.model_config,
        )
        ensure_torchvision_importable()  # as a worker does before it imports the handler
        handle, initialize = load_entry_point(archive)
        initialize(ctx)
        handler = getattr(handle, "__self__", None)
        device = str(getattr(handler, "device", "cpu"))
        b = max(spec.batch_size, 1)
        # TorchServe's gRPC shape ({"data": bytes}): every handler decodes raw bytes.
        rows = [{"data": body} for body in bodies]
        ids = [f"r{i}" for i in range(b)]
        heads: list[dict[str, str]] = [{} for _ in range(b)]
        state = {"one": 0, "full": 0}
        part = spec.seconds / (4 if spec.family == "digits" else 2)

        def one() -> None:  # each call the next request, so lengths and sizes vary as in traffic
            state["one"] += 1
            ctx.begin_batch(ids[:1], heads[:1])
            handle([rows[state["one"] % len(rows)]], ctx)

        def full() -> list[Any]:  # each call the next `b` requests in turn
            start = state["full"] * b
            state["full"] += 1
            batch = [rows[(start + i) % len(rows)] for i in range(b)]
            ctx.begin_batch(ids, heads)
            return list(handle(batch, ctx))

        answers = full()
        if len(answers) != b:
            raise RuntimeError(f"handle() answered {len(answers)} results for a batch of {b}")
        for answer in answers:
            check_answer(spec.family, _encoded(answer))
        iters_one = _warm(one)
        iters_full = _warm(full)
        batch1 = Percentiles.of(_timed_loop(one, part, min_iters=iters_one))
        batch_ms = statistics.median(_timed_loop(full, part, min_iters=iters_full))
        sorted_rps = _sorted_batches_rps(handle, ctx, rows, b, part) if spec.family == "minilm" else math.nan
        model_batch1, model_batched_rps = Percentiles.of([]), math.nan
        predict = getattr(handler, "predict_topk", None)
        if spec.family == "digits" and predict is not None:
            model_batch1, model_batched_rps = _digits_model_only(predict, rows[:b], part)
    return RawResult(
        batch1=batch1,
        batched_rps=b / (batch_ms / 1e3),
        model_batch1=model_batch1,
        model_batched_rps=model_batched_rps,
        batch_size=b,
        torch_threads=spec.torch_threads,
        device=device,
        batch_ms=batch_ms,
        sorted_batched_rps=sorted_rps,
    )


def spread_order(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix spreads over the whole range (0, n/2, n/4, 3n/4, ...),
    so a loop cut short by its time budget still samples short and long batches alike."""
    order: list[int] = []
    step = 1 << max(0, (n - 1).bit_length())
    while step >= 1:
        order += [i for i in range(0, n, step) if i not in order]
        step //= 2
    return order


def _sorted_batches_rps(handle: Any, ctx: Any, rows: list[dict[str, Any]], b: int, seconds: float) -> float:
    """Requests/s over full batches cut from the requests sorted by length (bytes stand in for word
    pieces), batches taken in `spread_order`, at least three: rows / total time, not a median,
    since short and long batches differ in cost by design."""
    ordered = sorted(rows, key=lambda r: len(r["data"]))
    chunks = [ordered[i : i + b] for i in range(0, len(ordered) - b + 1, b)] or [ordered]
    ids, heads = [f"r{i}" for i in range(b)], [{} for _ in range(b)]
    done, spent = 0, 0.0
    for k, idx in enumerate(spread_order(len(chunks))):
        if k >= 3 and spent >= seconds:
            break
        batch = chunks[idx]
        ctx.begin_batch(ids[: len(batch)], heads[: len(batch)])
        t0 = time.perf_counter()
        handle(batch, ctx)
        spent += time.perf_counter() - t0
        done += len(batch)
    return done / spent if spent > 0 else math.nan


def _encoded(answer: Any) -> bytes:
    """An answer as the server encodes it (str as UTF-8, other values as JSON)."""
    if isinstance(answer, bytes | bytearray):
        return bytes(answer)
    if isinstance(answer, str):
        return answer.encode()
    return json.dumps(answer).encode()


def _digits_model_only(predict: Any, rows: list[dict[str, Any]], seconds: float) -> tuple[Percentiles, float]:
    """The digits model alone (decoded pixels in, top-k out): what the handler's decoding costs."""
    import numpy as np

    from mariner.handlers.digits_handler import decode_item

    pixels = np.stack([decode_item(r) for r in rows])
    for _ in range(WARMUP_CALLS):
        predict(pixels[:1])
        predict(pixels)
    model_batch1 = Percentiles.of(_timed_loop(lambda: predict(pixels[:1]), seconds))
    model_ms = statistics.median(_timed_loop(lambda: predict(pixels), seconds))
    return model_batch1, len(rows) / (model_ms / 1e3)


def _child(spec: CeilingSpec, bodies: tuple[bytes, ...], conn: Any) -> None:
    """Entry point of the raw process: measure, send the result (or the error) back."""
    try:
        conn.send(("ok", measure_in_process(spec, bodies)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def measure_raw(spec: CeilingSpec, bodies: tuple[bytes, ...]) -> RawResult:
    """The ceiling, measured in a fresh spawned process (no server, no clients, nothing imported
    by this process in its way)."""
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(spec, bodies, child_end), daemon=True)
    p.start()
    child_end.close()
    try:
        status, payload = parent_end.recv()
    finally:
        p.join(30)
    if status != "ok":
        raise RuntimeError(f"raw measurement failed: {payload}")
    result: RawResult = payload
    return result


def median_raw(runs: Sequence[RawResult]) -> RawResult | None:
    """The run with the median batched throughput (the lower middle one of an even count)."""
    if not runs:
        return None
    ordered = sorted(runs, key=lambda r: r.batched_rps)
    return ordered[(len(ordered) - 1) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    from mariner.loadtest.workloads import family_of, workload
    from mariner.server.common.archive import open_archive

    repo = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(prog="python -m mariner.loadtest.bench ceiling", description=__doc__)
    p.add_argument("--store", type=Path, default=repo / "model_store")
    p.add_argument("--model", required=True, help="archive stem in the store, e.g. resnet18_onnx")
    p.add_argument("--batch-size", type=int, default=None, help="default: the archive's batchSize")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seconds", type=float, default=4.0)
    a = p.parse_args(argv)
    path = a.store / f"{a.model.removesuffix('.mar')}.mar"
    batch = a.batch_size
    if batch is None:
        with tempfile.TemporaryDirectory() as tmp:
            batch = int(open_archive(path, Path(tmp)).model_config.get("batchSize", 1))
    family = family_of(a.model.removesuffix(".mar"))
    spec = CeilingSpec(path, family, batch, a.torch_threads, a.seconds)
    r = measure_raw(spec, workload(family).bodies)
    print(
        f"{path.name} on {r.device}, {r.torch_threads} thread(s): "
        f"handle() batch 1 p50 {r.batch1.p50_ms:.2f} ms; "
        f"batch {r.batch_size}: {r.batch_ms:.1f} ms, {r.batched_rps:,.1f} req/s"
    )
    return 0
