"""handlers/accel.py: the model-config knobs for autocast and CUDA graphs, tested on the CPU.

bf16 autocast runs on the CPU for real; the CUDA-graph path is driven with a fake compile
function and a fake step marker, which is what can be checked here: every bucket recorded at
load, outputs copied out of the graph's memory, and no recording for a shape not warmed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _load_accel() -> Any:
    # As the handlers load it: by path, without the repo on sys.path and outside sys.modules.
    spec = importlib.util.spec_from_file_location("mariner_accel_under_test", REPO / "handlers" / "accel.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


accel = _load_accel()
CUDA = torch.device("cuda")  # a device object only; nothing runs on it in these tests
CPU = torch.device("cpu")


# -- settings ---------------------------------------------------------------------------------


def test_settings_read_the_handler_section() -> None:
    assert accel.settings({"autocast": "bf16", "cudaGraphs": True}) == accel.Accel("bf16", True)
    assert accel.settings({"autocast": "FP16"}) == accel.Accel("fp16", False)
    assert accel.settings({"format": "eager"}) == accel.Accel(None, False)
    assert accel.settings({"autocast": None, "cudaGraphs": False}) == accel.Accel(None, False)
    assert accel.settings(None) == accel.Accel(None, False)
    assert accel.Accel("bf16").dtype is torch.bfloat16
    assert accel.Accel().dtype is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"autocast": "bfloat16"}, "handler.autocast must be one of bf16, fp16 or null, got 'bfloat16'"),
        ({"autocast": 16}, "handler.autocast must be one of bf16, fp16 or null, got '16'"),
        ({"autocast": True}, "handler.autocast must be one of bf16, fp16 or null, got 'True'"),
        ({"cudaGraphs": "yes"}, "handler.cudaGraphs must be true or false, got 'yes'"),
        ({"cudaGraphs": 1}, "handler.cudaGraphs must be true or false, got '1'"),
    ],
)
def test_bad_settings_are_refused_with_what_is_allowed(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        accel.settings(section)


def test_a_handler_section_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ValueError, match="'handler' section must be a mapping, got list"):
        accel.settings(["autocast", "bf16"])


def test_settings_are_a_frozen_value() -> None:
    s = accel.settings({"autocast": "bf16"})
    with pytest.raises(AttributeError):
        s.autocast = None


# -- autocast ---------------------------------------------------------------------------------


def test_bf16_autocast_on_the_cpu_changes_a_linear_output_inside_the_context_only() -> None:
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    on = accel.settings({"autocast": "bf16"})
    with accel.autocast(on, CPU):
        inside = layer(x)
    outside = layer(x)
    assert inside.dtype is torch.bfloat16
    assert outside.dtype is torch.float32
    # the same numbers to bf16's precision: autocast changes the arithmetic, not the model
    torch.testing.assert_close(inside.float(), outside, atol=0.05, rtol=0.02)


def test_no_autocast_is_a_context_that_changes_nothing() -> None:
    layer = torch.nn.Linear(8, 4)
    with accel.autocast(accel.Accel(), CPU):
        assert layer(torch.randn(2, 8)).dtype is torch.float32
        assert not torch.is_autocast_enabled("cpu")


# -- graphed ----------------------------------------------------------------------------------


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_graphed_is_the_function_itself_on_the_cpu_or_when_not_asked() -> None:
    def never(fn: Any) -> Any:
        raise AssertionError("compiled although graphs are off")

    example = lambda b: (torch.zeros(b, 2),)  # noqa: E731
    on = accel.Accel(cuda_graphs=True)
    assert accel.graphed(_double, on, CPU, [1, 2], example, compile_fn=never) is _double
    assert accel.graphed(_double, accel.Accel(), CUDA, [1, 2], example, compile_fn=never) is _double
    assert accel.graphed(_double, accel.Accel("bf16"), CUDA, [1, 2], example, compile_fn=never) is _double


class FakeCompiled:
    """Stands for torch.compile(mode="reduce-overhead"): counts calls per batch size and, like a
    CUDA graph replay, writes every result into one reused output buffer."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.calls: dict[int, int] = {}
        self.modes: list[tuple[bool, bool]] = []
        self.buffer: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[len(x)] = self.calls.get(len(x), 0) + 1
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda")))
        out = self.fn(x)
        if self.buffer is None or self.buffer.shape != out.shape:
            self.buffer = torch.empty_like(out)
        self.buffer.copy_(out)
        return self.buffer


def _graphed(buckets: list[int]) -> tuple[Any, FakeCompiled, list[int]]:
    made: list[FakeCompiled] = []
    steps: list[int] = []

    def compile_fn(fn: Any) -> FakeCompiled:
        made.append(FakeCompiled(fn))
        return made[-1]

    g = accel.graphed(
        _double,
        accel.Accel(cuda_graphs=True),
        CUDA,
        buckets,
        lambda b: (torch.zeros(b, 3),),
        compile_fn=compile_fn,
        mark_step=lambda: steps.append(1),
    )
    assert len(made) == 1, "compiled once, not per bucket"
    return g, made[0], steps


def test_graphed_on_cuda_records_every_bucket_at_load_and_nothing_after() -> None:
    g, compiled, steps = _graphed([4, 1, 2, 4])
    warm = accel.WARM_CALLS
    assert warm >= 3  # warm-up run, recording, first replay
    assert compiled.calls == {1: warm, 2: warm, 4: warm}
    assert len(steps) == 3 * warm  # each warm call is its own step
    # every warm-up call ran under inference mode, as serving calls do
    assert all(inference for inference, _ in compiled.modes)

    out = g(torch.ones(2, 3))
    torch.testing.assert_close(out, torch.full((2, 3), 2.0))
    assert compiled.calls == {1: warm, 2: warm + 1, 4: warm}
    assert len(steps) == 3 * warm + 1  # one step marked per served call
    assert g.fallbacks == 0


def test_graphed_outputs_survive_the_next_replay() -> None:
    g, compiled, _ = _graphed([2])
    first = g(torch.ones(2, 3))
    second = g(torch.full((2, 3), 5.0))
    # the fake writes both replays into one buffer, as a CUDA graph does; the caller's copies differ
    torch.testing.assert_close(first, torch.full((2, 3), 2.0))
    torch.testing.assert_close(second, torch.full((2, 3), 10.0))
    assert first.data_ptr() != compiled.buffer.data_ptr()


def test_a_shape_not_warmed_runs_the_plain_function_and_is_counted() -> None:
    g, compiled, _ = _graphed([1, 4])
    before = dict(compiled.calls)
    out = g(torch.ones(3, 3))  # a handler that forgot to pad to a bucket
    torch.testing.assert_close(out, torch.full((3, 3), 2.0))
    assert compiled.calls == before  # nothing recorded during live traffic
    assert g.fallbacks == 1
    g(torch.ones(4, 3, dtype=torch.float64))  # a warmed batch size but another dtype: not warmed either
    assert g.fallbacks == 2
    assert compiled.calls == before


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_graphed_with_autocast_warms_and_serves_under_the_same_autocast() -> None:
    made: list[FakeCompiled] = []

    def compile_fn(fn: Any) -> FakeCompiled:
        made.append(FakeCompiled(fn))
        return made[-1]

    g = accel.graphed(
        _double,
        accel.Accel("bf16", cuda_graphs=True),
        CUDA,
        [2],
        lambda b: (torch.zeros(b, 3),),
        compile_fn=compile_fn,
        mark_step=lambda: None,
    )
    g(torch.ones(2, 3))
    modes = set(made[0].modes)
    # without CUDA, torch turns cuda autocast off (with a warning); what matters here is that
    # warm-up and serving entered the same modes, so dynamo's guards cannot differ between them
    assert len(modes) == 1
    assert next(iter(modes))[0] is True


def test_with_real_dynamo_no_call_after_warm_up_compiles_a_graph() -> None:
    """torch.compile itself (the eager backend: dynamo's tracing and guards, no code generation)
    in place of mode="reduce-overhead": whatever tensors a handler passes at a warmed bucket,
    inference tensors or not, fresh or views into a larger buffer, no new graph is made."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    layer = torch.nn.Linear(3, 2).eval()
    g = accel.graphed(
        layer,
        accel.Accel(cuda_graphs=True),
        CUDA,
        [2, 4],
        lambda b: (torch.zeros(b, 3),),
        compile_fn=lambda fn: torch.compile(fn, backend="eager", dynamic=False),
        mark_step=lambda: None,
    )
    warmed = counters["stats"]["unique_graphs"]
    assert warmed >= 2  # one graph per bucket, made at load
    with torch.inference_mode():
        inference = [g(torch.ones(2, 3)), g(torch.ones(4, 3))]
    normal = [g(torch.ones(2, 3)), g(torch.ones(4, 3))]
    view = g(torch.ones(8, 3)[4:6])
    assert counters["stats"]["unique_graphs"] == warmed
    assert g.fallbacks == 0
    expected = layer(torch.ones(2, 3)).detach()
    for out in (inference[0], normal[0], view):
        torch.testing.assert_close(out, expected)


def test_graphed_needs_a_bucket() -> None:
    with pytest.raises(ValueError, match="at least one batch bucket"):
        accel.graphed(
            _double,
            accel.Accel(cuda_graphs=True),
            CUDA,
            [],
            lambda b: (torch.zeros(b),),
            compile_fn=FakeCompiled,
        )


def test_graphed_raises_dynamos_graph_limit_to_hold_every_bucket() -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    try:
        setattr(cfg, name, 2)
        _graphed([1, 2, 4, 8, 16, 32])
        assert getattr(cfg, name) >= 6
    finally:
        setattr(cfg, name, old)
