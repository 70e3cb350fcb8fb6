"""Shared fixtures: the built model store and the eager model every served variant is judged by.

Heavy imports (torch, the training package) happen inside the fixtures, so collecting unit tests
that need none of this stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_HINT = "run `make models` first"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(autouse=True)
def _no_snapshot_from_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: Any) -> None:
    """`load_config` without a config file restores the newest config snapshot under
    `$LOG_LOCATION/config`, else `./logs/config`, as TorchServe does. A `make serve` in the
    repository leaves snapshots there, and a test calling `load_config(argv, env={})` must not
    restore them: the working directory's default location reads as empty in tests, while an
    explicit LOG_LOCATION (the snapshot tests') is honoured."""
    import mariner.server.common.config_loading as config_module

    real = config_module.snapshot_dir
    empty = tmp_path_factory.mktemp("no-snapshots")
    monkeypatch.setattr(
        config_module,
        "snapshot_dir",
        lambda env, cwd=None: real(env, cwd) if env.get("LOG_LOCATION") else empty,
    )


@pytest.fixture(scope="session")
def model_store() -> Path:
    """model_store/ as `make models` leaves it; fails (not skips) when missing, saying how to build it."""
    store = REPO_ROOT / "model_store"
    if not (store / "index.json").is_file():
        pytest.fail(f"{store / 'index.json'} is missing: {BUILD_HINT}")
    return store


@dataclass(frozen=True)
class EagerReference:
    """The trained eager model and the held-out test split, i.e. the answers a server must give."""

    model: Any  # mariner.training.model.DigitsCNN in eval mode
    norm: Any  # mariner.training.data.NormStats the archives were packaged with
    test_pixels: np.ndarray  # (N, 64) raw intensities 0..16, float32
    test_labels: np.ndarray  # (N,) true digits

    def probabilities(self, pixels: np.ndarray) -> np.ndarray:
        """(N, 64) or (64,) raw pixels -> (N, 10) float32 softmax, computed as the handler does."""
        import torch

        from mariner.training.data import to_model_input

        with torch.inference_mode():
            logits = self.model(to_model_input(np.atleast_2d(pixels), self.norm))
        return torch.softmax(logits.float(), dim=1).numpy()


@pytest.fixture(scope="session")
def eager_reference(model_store: Path) -> EagerReference:
    checkpoint = REPO_ROOT / "build" / "train" / "best.pt"
    if not checkpoint.is_file():
        pytest.fail(f"{checkpoint} is missing: {BUILD_HINT}")
    from mariner.training.data import load_splits
    from mariner.training.export import load_eager

    model, _ = load_eager(checkpoint)
    splits = load_splits()
    return EagerReference(
        model=model,
        norm=splits.norm,
        test_pixels=np.asarray(splits.test.x, dtype=np.float32),
        test_labels=np.asarray(splits.test.y),
    )


@dataclass(frozen=True)
class FamilyStore:
    """One model family's archives from model_store/, hard-linked into a store of their own (so a
    server started on it loads just them), with their index.json entries and report table: the
    archives `make models` built and verified, not a second build."""

    store: Path
    entries: tuple[dict[str, Any], ...]
    report: str


def family_store(model_store: Path, prefix: str, family: str, dest: Path) -> FamilyStore:
    import json

    index = json.loads((model_store / "index.json").read_text())
    entries = tuple(e for e in index["archives"] if e["file"].startswith(prefix))
    if not entries:
        pytest.fail(f"model_store/index.json lists no {prefix}* archives: {BUILD_HINT}")
    import os
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        # A hard link of each archive (a copy across filesystems).
        try:
            os.link(model_store / entry["file"], dest / entry["file"])
        except OSError:
            shutil.copy2(model_store / entry["file"], dest / entry["file"])
    return FamilyStore(dest, entries, (model_store / "report" / f"{family}.md").read_text())
