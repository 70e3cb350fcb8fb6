"""Reproducible training: seeding, bit-identical reruns, resume, checkpoint format, the model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

import mariner.training.train as train_mod
from mariner.training.data import load_splits
from mariner.training.model import NUM_CLASSES, DigitsCNN
from mariner.training.train import TrainConfig, load_checkpoint, set_seed, train

pytestmark = pytest.mark.unit

# Small network and few epochs: every property under test holds at any size, and this keeps
# each run well under a second.
CFG = TrainConfig(epochs=2, width=8, hidden=32, seed=0)
CFG3 = TrainConfig(epochs=3, width=8, hidden=32, seed=0)


class Interrupted(Exception):
    """Stands in for a kill in the middle of an epoch."""


@pytest.fixture(scope="module", autouse=True)
def _restore_global_torch_state() -> Iterator[None]:
    """train() flips process-wide switches (deterministic algorithms); undo them for others."""
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    rng = torch.get_rng_state()
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    if cublas is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
    torch.set_rng_state(rng)


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run_a")
    train(CFG, out, progress=False)
    return out


@pytest.fixture(scope="module")
def run_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run_b")
    train(CFG, out, progress=False)
    return out


@pytest.fixture(scope="module")
def run_full3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run_full3")
    train(CFG3, out, progress=False)
    return out


@pytest.fixture(scope="module")
def run_resumed3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-epoch run killed during its last epoch (after epoch 1's last.pt), then resumed."""
    out = tmp_path_factory.mktemp("run_resumed3")
    real_evaluate = train_mod.evaluate
    calls = {"n": 0}

    def evaluate_then_die(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # epoch 2 has trained its batches; die before it is checkpointed
            raise Interrupted
        return real_evaluate(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_mod, "evaluate", evaluate_then_die)
        with pytest.raises(Interrupted):
            train(CFG3, out, progress=False)
    assert load_checkpoint(out / "last.pt")["epoch"] == 1
    train(CFG3, out, resume=True, progress=False)
    return out


def _assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"tensor {k} differs"


def _assert_nested_equal(a: Any, b: Any, where: str = "") -> None:
    """Deep equality for checkpoint dicts (tensors compared exactly)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_nested_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_nested_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


# -- seeding ------------------------------------------------------------------------------


def test_set_seed_turns_deterministic_algorithms_on() -> None:
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = True
    set_seed(7)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.benchmark is False
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG")


def test_set_seed_makes_random_draws_repeatable() -> None:
    import random

    import numpy as np

    set_seed(11)
    first = (torch.rand(4), np.random.rand(3), random.random())
    set_seed(11)
    second = (torch.rand(4), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0])
    assert (first[1] == second[1]).all()
    assert first[2] == second[2]


# -- the model ----------------------------------------------------------------------------


def test_model_returns_raw_logits_of_shape_n_by_10() -> None:
    torch.manual_seed(0)
    model = DigitsCNN(width=8, hidden=32).eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.inference_mode():
        out = model(x)
    assert out.shape == (5, NUM_CLASSES)
    assert out.dtype == torch.float32
    # Logits, not probabilities: not all rows sum to one, and some values are negative.
    sums = out.sum(dim=1)
    assert not torch.allclose(sums, torch.ones(5), atol=1e-3)
    assert (out < 0).any()


def test_model_accepts_any_batch_size_and_defaults_match_training() -> None:
    model = DigitsCNN().eval()
    with torch.inference_mode():
        assert model(torch.zeros(1, 1, 8, 8)).shape == (1, 10)
        assert model(torch.zeros(33, 1, 8, 8)).shape == (33, 10)
    defaults = TrainConfig()
    assert model.head[-1].out_features == NUM_CLASSES
    assert model.features[0][0].out_channels == defaults.width
    assert model.head[-1].in_features == defaults.hidden


# -- reproducibility ----------------------------------------------------------------------


def test_two_runs_with_the_same_seed_give_bit_identical_weights(run_a: Path, run_b: Path) -> None:
    a, b = load_checkpoint(run_a / "best.pt"), load_checkpoint(run_b / "best.pt")
    assert a["epoch"] == b["epoch"]
    _assert_state_equal(a["model"], b["model"])
    _assert_nested_equal(load_checkpoint(run_a / "last.pt"), load_checkpoint(run_b / "last.pt"))


def test_training_changes_the_weights(run_a: Path) -> None:
    """Guards the test above against a train() that silently does nothing."""
    trained = load_checkpoint(run_a / "last.pt")["model"]
    set_seed(CFG.seed)
    fresh = DigitsCNN(width=CFG.width, hidden=CFG.hidden, dropout=CFG.dropout).state_dict()
    assert any(not torch.equal(trained[k], fresh[k]) for k in fresh if fresh[k].is_floating_point())


def test_resume_after_an_interruption_matches_an_uninterrupted_run(
    run_full3: Path, run_resumed3: Path
) -> None:
    full, resumed = load_checkpoint(run_full3 / "last.pt"), load_checkpoint(run_resumed3 / "last.pt")
    assert full["epoch"] == resumed["epoch"] == CFG3.epochs - 1
    _assert_state_equal(full["model"], resumed["model"])
    # Everything else a further resume would need is identical too.
    _assert_nested_equal(full, resumed)
    best_full, best_resumed = (
        load_checkpoint(run_full3 / "best.pt"),
        load_checkpoint(run_resumed3 / "best.pt"),
    )
    assert best_full["epoch"] == best_resumed["epoch"]
    _assert_state_equal(best_full["model"], best_resumed["model"])


def test_resume_with_a_changed_epoch_count_fails_without_touching_last_pt(
    run_a: Path, tmp_path: Path
) -> None:
    """A 2-epoch run's OneCycle schedule ends at epoch 2; it cannot be stretched to 3 epochs.

    The scheduler state restored from last.pt keeps total_steps = 2 * steps_per_epoch, so a
    resume with epochs=3 must not silently produce a model; what is on disk stays intact.
    Today the refusal is OneCycleLR's own "Tried to step 41 times" ValueError, raised after the
    first optimizer step of epoch 2; a clearer up-front config check would still pass this test.
    """
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt").write_bytes((run_a / "last.pt").read_bytes())
    (out / "best.pt").write_bytes((run_a / "best.pt").read_bytes())
    before = (out / "last.pt").read_bytes()
    with pytest.raises(ValueError, match="epochs"):
        train(CFG3, out, resume=True, progress=False)
    assert (out / "last.pt").read_bytes() == before


def test_resume_of_a_finished_run_is_a_no_op(run_a: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    for name in ("last.pt", "best.pt"):
        (out / name).write_bytes((run_a / name).read_bytes())
    before = {name: (out / name).read_bytes() for name in ("last.pt", "best.pt")}
    assert train(CFG, out, resume=True, progress=False) == out / "best.pt"
    assert {name: (out / name).read_bytes() for name in before} == before


# -- checkpoint format --------------------------------------------------------------------


def test_checkpoints_load_with_weights_only(run_a: Path) -> None:
    last = torch.load(run_a / "last.pt", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "scheduler", "epoch", "config"} <= last.keys()
    assert {"scaler", "rng", "best", "norm", "val"} <= last.keys()
    assert last["epoch"] == CFG.epochs - 1
    assert last["config"] == asdict(CFG)
    assert isinstance(last["optimizer"], dict)
    assert "state" in last["optimizer"]
    assert isinstance(last["scheduler"], dict)

    best = torch.load(run_a / "best.pt", map_location="cpu", weights_only=True)
    assert {"model", "epoch", "config", "norm", "val"} <= best.keys()
    assert best["config"] == asdict(CFG)
    assert 0 <= best["epoch"] < CFG.epochs
    assert 0.0 <= best["val"]["accuracy"] <= 1.0


def test_checkpoint_carries_the_training_split_norm_stats(run_a: Path) -> None:
    best = load_checkpoint(run_a / "best.pt")
    assert best["norm"] == asdict(load_splits(seed=CFG.seed).norm)


def test_best_checkpoint_rebuilds_the_model(run_a: Path) -> None:
    ck = load_checkpoint(run_a / "best.pt")
    cfg = ck["config"]
    model = DigitsCNN(width=cfg["width"], hidden=cfg["hidden"], dropout=cfg["dropout"])
    model.load_state_dict(ck["model"])  # strict: every key present, no extras
    splits = load_splits(seed=cfg["seed"])
    from mariner.training.data import to_model_input

    with torch.inference_mode():
        pred = model.eval()(to_model_input(splits.val.x, splits.norm)).argmax(1).numpy()
    acc = float((pred == splits.val.y).mean())
    assert acc == pytest.approx(ck["val"]["accuracy"])
    assert acc > 0.5  # two epochs of a tiny net already learn a lot more than chance (0.1)


# -- CUDA paths, on a CPU machine with fakes ------------------------------------------------


class FakeCudaRng:
    """torch.cuda's RNG API for `count` GPUs, states as ByteTensors like the real ones."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.states = [torch.full((16,), i, dtype=torch.uint8) for i in range(count)]
        self.restored: list[torch.Tensor] | None = None

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states])
        mp.setattr(torch.cuda, "set_rng_state_all", lambda states: setattr(self, "restored", list(states)))
        mp.setattr(torch.cuda, "device_count", lambda: self.count)


def test_cuda_rng_state_is_checkpointed_and_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA run's dropout draws come from the GPU generator: resume must restore it too."""
    fake = FakeCudaRng(2)
    fake.install(monkeypatch)
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    torch.save({"rng": train_mod.rng_state(gen, cuda)}, tmp_path / "ck.pt")
    saved = load_checkpoint(tmp_path / "ck.pt")["rng"]  # weights_only round trip
    assert [s.tolist() for s in saved["cuda"]] == [s.tolist() for s in fake.states]
    train_mod.restore_rng_state(saved, torch.Generator(), cuda)
    assert fake.restored is not None
    assert [s.tolist() for s in fake.restored] == [s.tolist() for s in fake.states]


def test_cpu_run_saves_no_cuda_state_and_a_cuda_resume_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaRng(1)
    fake.install(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    state = train_mod.rng_state(gen, torch.device("cpu"))
    assert "cuda" not in state
    with pytest.warns(UserWarning, match="without CUDA RNG state"):
        train_mod.restore_rng_state(state, gen, torch.device("cuda"))
    assert fake.restored is None


def test_resume_on_fewer_gpus_restores_the_ones_present(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudaRng(1)
    fake.install(monkeypatch)
    state = {"torch": torch.get_rng_state(), "loader": torch.Generator().get_state(),
             "cuda": [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]}  # fmt: skip
    with pytest.warns(UserWarning, match="2 GPUs, this machine has 1"):
        train_mod.restore_rng_state(state, torch.Generator(), torch.device("cuda"))
    assert fake.restored is not None
    assert [s.tolist() for s in fake.restored] == [[0] * 16]


def test_async_copies_only_from_pinned_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """non_blocking=True from pageable memory is a synchronous copy that only looks async:
    the training loader pins its batches exactly when the copies are non-blocking (CUDA)."""
    loaders: list[bool] = []
    real_make_loader = train_mod.make_loader

    def spy_loader(*args: Any, **kwargs: Any) -> Any:
        loader = real_make_loader(*args, **kwargs)
        loaders.append(loader.pin_memory)
        return loader

    copies: list[bool] = []
    real_to = torch.Tensor.to

    def spy_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if "non_blocking" in kwargs:
            copies.append(kwargs["non_blocking"])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(train_mod, "make_loader", spy_loader)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    train(TrainConfig(epochs=1, width=4, hidden=8, seed=0), tmp_path, progress=False)
    assert loaders[0] is False  # the training loader, on this CPU-only machine
    assert copies
    assert set(copies) == {False}


def test_make_loader_pins_when_asked() -> None:
    from mariner.training.data import DigitsDataset, make_loader

    splits = load_splits(seed=0)
    ds = DigitsDataset(splits.val, splits.norm)
    gen = torch.Generator().manual_seed(0)
    assert make_loader(ds, 8, shuffle=False, generator=gen, workers=0, pin_memory=True).pin_memory is True
    assert make_loader(ds, 8, shuffle=False, generator=gen, workers=0).pin_memory is False


def test_verification_compares_fp32_with_tf32_off_and_restores_it() -> None:
    from mariner.training.verify import fp32_math

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        with fp32_math():
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cuda.matmul.allow_tf32 is True
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
