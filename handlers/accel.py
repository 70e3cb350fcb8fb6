"""Mixed precision and CUDA graphs for the MiniLM and ResNet handlers, read from model-config.

The archive ships this file beside its handler (as it ships `handler_support.py`) and the handler
loads it by path, so it runs the same under TorchServe, Mariner and in the repo: it imports
only torch and the standard library.

The handler section of model-config.yaml may say

    autocast: bf16 | fp16 | null    # run the forward under torch.autocast at that dtype
    cudaGraphs: true | false        # on CUDA, replay one recorded graph per batch bucket

Why here and not in each handler: both knobs have traps that are easy to get wrong twice.
Autocast must be entered the same way at warm-up and at serving time, or torch.compile guards
fail and recompile under live traffic. CUDA graphs (torch.compile mode "reduce-overhead")
record once per input shape, so every shape a batch can have must be recorded at load (the
handler pads batches to a bucket), a replay overwrites the previous replay's outputs (they are
cloned before the caller sees them), and a shape never recorded must not record mid-traffic
(it runs the plain function instead, and is counted). bf16 autocast also works on the CPU, so
the mixed-precision path is tested without a GPU; CUDA graphs are a CUDA feature and are off
elsewhere.
"""

# No `from __future__ import annotations`: dataclasses resolve string annotations through
# sys.modules, so real ones keep this file loadable by any loader, including one that does not
# register it there (handler_support.load_module_from does).
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
# cudagraph trees: the 1st call at a shape runs the compiled code eagerly, the 2nd records the
# graph, the 3rd is the first replay. Three calls per bucket leave nothing to do at serving time.
WARM_CALLS = 3


@dataclass(frozen=True)
class Accel:
    """What the handler section asked for: autocast dtype name (or None) and CUDA graphs."""

    autocast: str | None = None
    cuda_graphs: bool = False

    @property
    def dtype(self) -> torch.dtype | None:
        return AUTOCAST_DTYPES[self.autocast] if self.autocast else None


def settings(section: dict[str, Any] | None) -> Accel:
    """Read `autocast` and `cudaGraphs` from a handler section; a bad value is a ValueError.

    A typo must fail the load with a message, not quietly serve fp32 without graphs: the person
    who wrote `autocast: bfloat16` is measuring something and would measure the wrong thing.
    """
    if section is None:
        return Accel()
    if not isinstance(section, dict):
        raise ValueError(f"model-config 'handler' section must be a mapping, got {type(section).__name__}")
    raw = section.get("autocast")
    if raw is None or raw is False or (isinstance(raw, str) and raw.strip().lower() in ("", "null", "none")):
        cast = None
    elif isinstance(raw, str) and raw.strip().lower() in AUTOCAST_DTYPES:
        cast = raw.strip().lower()
    else:
        raise ValueError(f"handler.autocast must be one of bf16, fp16 or null, got {str(raw)[:40]!r}")
    graphs = section.get("cudaGraphs", False)
    if graphs is None:
        graphs = False
    if not isinstance(graphs, bool):
        raise ValueError(f"handler.cudaGraphs must be true or false, got {str(graphs)[:40]!r}")
    return Accel(autocast=cast, cuda_graphs=graphs)


def autocast(accel: Accel, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """torch.autocast on the device's type at the asked dtype; a no-op context when not asked."""
    dtype = accel.dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _clone_outputs(out: Any) -> Any:
    """Copies of every tensor in out: the next replay writes into the graph's own output memory."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a named tuple
        return type(out)(*(_clone_outputs(o) for o in out))
    if isinstance(out, (tuple, list)):
        return type(out)(_clone_outputs(o) for o in out)
    if isinstance(out, dict):
        return {k: _clone_outputs(v) for k, v in out.items()}
    return out


def _as_warmed(arg: Any) -> Any:
    """A tensor argument as warm-up made them: an inference tensor at storage offset 0.

    Dynamo guards on both: a tensor made outside inference mode (or a view into a larger
    buffer) would compile and record a second graph for a shape already recorded, under live
    traffic. Such an argument is copied once, in inference mode; the usual one passes as is.
    """
    if isinstance(arg, torch.Tensor) and (not arg.is_inference() or arg.storage_offset() != 0):
        return arg.clone(memory_format=torch.contiguous_format)
    return arg


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a replay is keyed on here: shape and dtype of each tensor argument."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a) for a in args)


def _raise_recompile_limit(buckets: int) -> None:
    """Dynamo keeps 8 graphs per function by default; every bucket needs one (plus slack)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(int(getattr(cfg, name)), buckets + 2))


@dataclass
class Graphed:
    """A compiled function that only ever replays the shapes it recorded at load.

    Calls whose tensor shapes were not warmed run the plain function (eager, same autocast)
    and are counted in `fallbacks`, so a handler that forgot to pad is slow, never recording.
    """

    fn: Callable[..., Any]
    compiled: Callable[..., Any]
    accel: Accel
    device: torch.device
    mark_step: Callable[[], None]
    warmed: set[tuple[Any, ...]] = field(default_factory=set)
    fallbacks: int = 0

    @contextlib.contextmanager
    def _mode(self) -> Iterator[None]:
        # The same grad mode and autocast at warm-up and at serving time: dynamo guards on both.
        with torch.inference_mode(), autocast(self.accel, self.device):
            yield

    def warm(self, args: tuple[Any, ...], calls: int = WARM_CALLS) -> None:
        with self._mode():
            for _ in range(calls):
                self.mark_step()
                self.compiled(*args)
        self.warmed.add(_signature(args))

    def __call__(self, *args: Any) -> Any:
        if _signature(args) not in self.warmed:
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning(
                    "graphed function called with shapes %s that were not recorded at load; running it "
                    "without CUDA graphs (pad batches to one of the warmed buckets)",
                    _signature(args),
                )
            with self._mode():
                return self.fn(*args)
        with self._mode():
            args = tuple(_as_warmed(a) for a in args)
            self.mark_step()  # a new step: the previous replay's outputs may be overwritten now
            return _clone_outputs(self.compiled(*args))


def _torch_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    return torch.compile(fn, mode="reduce-overhead", dynamic=False)


def graphed(
    fn: Callable[..., Any],
    accel: Accel,
    device: torch.device,
    buckets: list[int],
    example: Callable[[int], tuple[Any, ...]],
    *,
    compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] = _torch_compile,
    mark_step: Callable[[], None] | None = None,
) -> Callable[..., Any]:
    """fn compiled for CUDA graphs and recorded at every bucket, when asked and on CUDA; else fn.

    `example(b)` gives the arguments of a batch of b rows as the handler will pass them (on the
    device, padded the same way). `compile_fn` and `mark_step` are injectable so the warm-up and
    replay logic is tested without a GPU.
    """
    if not accel.cuda_graphs or device.type != "cuda":
        return fn
    if not buckets:
        raise ValueError("graphed() needs at least one batch bucket to record")
    _raise_recompile_limit(len(buckets))
    step = mark_step or torch.compiler.cudagraph_mark_step_begin
    g = Graphed(fn=fn, compiled=compile_fn(fn), accel=accel, device=device, mark_step=step)
    for b in sorted(set(buckets)):
        with torch.inference_mode():
            args = example(b)
        g.warm(args)
    return g
