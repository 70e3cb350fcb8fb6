"""Digits data: a stratified, seeded split of scikit-learn's bundled 8x8 digits.

The data ships inside scikit-learn (no download). Normalisation statistics come from the
training split only, so validation and test numbers are honest, and they are written next to
the model so every server applies exactly the transform the model was trained with.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset

PIXEL_MAX = 16.0  # load_digits intensities are integers in [0, 16]


@dataclass(frozen=True)
class NormStats:
    """Scalar mean/std of the raw 0..16 pixel intensities over the training split."""

    mean: float
    std: float

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: Path) -> NormStats:
        raw = json.loads(path.read_text())
        return cls(mean=float(raw["mean"]), std=float(raw["std"]))


@dataclass(frozen=True)
class Split:
    """Raw pixels (N, 64) float32 in 0..16 and int64 labels."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class DigitsSplits:
    train: Split
    val: Split
    test: Split
    norm: NormStats


def load_splits(seed: int = 0, val_frac: float = 0.15, test_frac: float = 0.15) -> DigitsSplits:
    """Stratified train/val/test split with a fixed seed; stats from train only."""
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(
        x, y, test_size=test_frac, stratify=y, random_state=seed
    )
    x_train, x_val, y_train, y_val = train_test_split(
        x_rest,
        y_rest,
        test_size=val_frac / (1.0 - test_frac),
        stratify=y_rest,
        random_state=seed,
    )
    norm = NormStats(mean=float(x_train.mean()), std=float(x_train.std()))
    return DigitsSplits(
        train=Split(x_train, y_train),
        val=Split(x_val, y_val),
        test=Split(x_test, y_test),
        norm=norm,
    )


def to_model_input(pixels: np.ndarray, norm: NormStats) -> torch.Tensor:
    """(N, 64) raw pixels -> normalised (N, 1, 8, 8) float32 tensor, as the handler does."""
    t = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8)
    return (t - norm.mean) / norm.std


class DigitsDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Normalised images and labels, held in memory (the whole set is 1,797 x 64 floats)."""

    def __init__(self, split: Split, norm: NormStats) -> None:
        self.x = to_model_input(split.x, norm)
        self.y = torch.as_tensor(split.y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def seed_worker(worker_id: int) -> None:
    """Seed numpy and random in each DataLoader worker from torch's per-worker seed."""
    del worker_id
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def make_loader(
    ds: DigitsDataset,
    batch_size: int,
    *,
    shuffle: bool,
    generator: torch.Generator,
    workers: int,
    pin_memory: bool = False,
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """A DataLoader whose shuffling is repeatable: seeded generator + worker_init_fn.

    `pin_memory` (for CUDA training) hands out page-locked batches, the only kind a
    `non_blocking=True` copy to the GPU can overlap with the host; from pageable memory such a
    copy is synchronous anyway.
    """
    return DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=workers,
        worker_init_fn=seed_worker,
        generator=generator,
        persistent_workers=workers > 0,
        pin_memory=pin_memory,
    )
