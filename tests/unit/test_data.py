"""The digits split, its normalisation statistics and the seeded DataLoader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from mariner.training.data import (
    DigitsDataset,
    DigitsSplits,
    NormStats,
    load_splits,
    make_loader,
    to_model_input,
)

pytestmark = pytest.mark.unit

N_DIGITS = 1797  # size of scikit-learn's bundled digits set
SPLIT_NAMES = ("train", "val", "test")


@pytest.fixture(scope="module")
def splits() -> DigitsSplits:
    return load_splits(seed=0)


@pytest.fixture(scope="module")
def full() -> tuple[np.ndarray, np.ndarray]:
    d = load_digits()
    return d.data.astype(np.float32), d.target.astype(np.int64)


def _rows(x: np.ndarray, y: np.ndarray) -> set[bytes]:
    """Each sample as one hashable key (pixels + label)."""
    return {row.tobytes() + bytes([label]) for row, label in zip(x, y, strict=True)}


def test_split_sizes_add_up_to_the_whole_set(splits: DigitsSplits) -> None:
    sizes = [len(getattr(splits, name).y) for name in SPLIT_NAMES]
    assert sum(sizes) == N_DIGITS
    # 70 / 15 / 15 by default
    assert sizes == [1257, 270, 270]
    for name in SPLIT_NAMES:
        s = getattr(splits, name)
        assert s.x.shape == (len(s.y), 64)
        assert s.x.dtype == np.float32
        assert s.y.dtype == np.int64


def test_splits_are_a_disjoint_partition_of_the_data(
    splits: DigitsSplits, full: tuple[np.ndarray, np.ndarray]
) -> None:
    # load_digits has no duplicate rows, so row identity is sample identity.
    all_rows = _rows(*full)
    assert len(all_rows) == N_DIGITS
    parts = {name: _rows(getattr(splits, name).x, getattr(splits, name).y) for name in SPLIT_NAMES}
    assert parts["train"].isdisjoint(parts["val"])
    assert parts["train"].isdisjoint(parts["test"])
    assert parts["val"].isdisjoint(parts["test"])
    assert parts["train"] | parts["val"] | parts["test"] == all_rows


def test_splits_are_stratified(splits: DigitsSplits, full: tuple[np.ndarray, np.ndarray]) -> None:
    overall = np.bincount(full[1], minlength=10) / N_DIGITS
    for name in SPLIT_NAMES:
        y = getattr(splits, name).y
        share = np.bincount(y, minlength=10) / len(y)
        assert np.abs(share - overall).max() <= 0.02, (name, share, overall)


def test_same_seed_gives_the_same_split(splits: DigitsSplits) -> None:
    again = load_splits(seed=0)
    for name in SPLIT_NAMES:
        np.testing.assert_array_equal(getattr(again, name).x, getattr(splits, name).x)
        np.testing.assert_array_equal(getattr(again, name).y, getattr(splits, name).y)
    assert again.norm == splits.norm


def test_different_seed_gives_a_different_split(splits: DigitsSplits) -> None:
    other = load_splits(seed=1)
    assert len(other.train.y) == len(splits.train.y)
    assert _rows(other.test.x, other.test.y) != _rows(splits.test.x, splits.test.y)
    assert not np.array_equal(other.train.x, splits.train.x)


def test_norm_stats_come_from_the_training_split_only(
    splits: DigitsSplits, full: tuple[np.ndarray, np.ndarray]
) -> None:
    train_x = splits.train.x.astype(np.float64)
    assert splits.norm.mean == pytest.approx(train_x.mean(), rel=1e-6)
    assert splits.norm.std == pytest.approx(train_x.std(), rel=1e-6)
    # The whole set's statistics differ by far more than the tolerance above, so stats
    # computed over all the data (a leak of val/test into training) would fail here.
    all_x = full[0].astype(np.float64)
    assert abs(all_x.mean() - train_x.mean()) > 1e-3
    assert splits.norm.mean != pytest.approx(all_x.mean(), rel=1e-6)
    assert splits.norm.std != pytest.approx(all_x.std(), rel=1e-6)


def test_norm_stats_round_trip_through_json(tmp_path: Path, splits: DigitsSplits) -> None:
    path = tmp_path / "norm.json"
    splits.norm.to_json(path)
    assert NormStats.from_json(path) == splits.norm


def test_to_model_input_normalises_into_image_shape(splits: DigitsSplits) -> None:
    x = splits.test.x[:5]
    t = to_model_input(x, splits.norm)
    assert t.shape == (5, 1, 8, 8)
    assert t.dtype == torch.float32
    expected = (torch.from_numpy(x).reshape(5, 1, 8, 8) - splits.norm.mean) / splits.norm.std
    torch.testing.assert_close(t, expected)
    # pixel (r, c) of the image is pixel r*8+c of the flat row
    assert float(t[2, 0, 3, 5]) == pytest.approx((x[2, 3 * 8 + 5] - splits.norm.mean) / splits.norm.std)


def test_dataset_items_are_normalised_images_with_labels(splits: DigitsSplits) -> None:
    ds = DigitsDataset(splits.val, splits.norm)
    assert len(ds) == len(splits.val.y)
    x, y = ds[7]
    assert x.shape == (1, 8, 8)
    assert int(y) == int(splits.val.y[7])
    # Standardised with train stats: the whole train set has mean ~0, std ~1.
    train = DigitsDataset(splits.train, splits.norm)
    assert float(train.x.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(train.x.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


def _epoch_labels(loader: torch.utils.data.DataLoader) -> list[torch.Tensor]:
    return [y.clone() for _, y in loader]


def _orders(seed: int, epochs: int, ds: DigitsDataset, *, shuffle: bool = True) -> list[torch.Tensor]:
    loader = make_loader(ds, 64, shuffle=shuffle, generator=torch.Generator().manual_seed(seed), workers=0)
    return [torch.cat(_epoch_labels(loader)) for _ in range(epochs)]


def test_loader_shuffles_identically_for_the_same_generator_seed(splits: DigitsSplits) -> None:
    ds = DigitsDataset(splits.train, splits.norm)
    a, b = _orders(5, 2, ds), _orders(5, 2, ds)
    for ea, eb in zip(a, b, strict=True):
        assert torch.equal(ea, eb)
    # It does shuffle: each epoch is a permutation of the dataset, unlike the stored order,
    # and the two epochs differ from each other.
    stored = torch.as_tensor(splits.train.y)
    assert torch.equal(a[0].sort().values, stored.sort().values)
    assert not torch.equal(a[0], stored)
    assert not torch.equal(a[0], a[1])


def test_loader_order_depends_on_the_generator_seed(splits: DigitsSplits) -> None:
    ds = DigitsDataset(splits.train, splits.norm)
    assert not torch.equal(_orders(5, 1, ds)[0], _orders(6, 1, ds)[0])


def test_loader_without_shuffle_keeps_the_stored_order(splits: DigitsSplits) -> None:
    ds = DigitsDataset(splits.val, splits.norm)
    (order,) = _orders(5, 1, ds, shuffle=False)
    assert torch.equal(order, torch.as_tensor(splits.val.y))


def test_loader_order_is_independent_of_the_global_rng(splits: DigitsSplits) -> None:
    ds = DigitsDataset(splits.train, splits.norm)
    torch.manual_seed(123)
    a = _orders(5, 1, ds)[0]
    torch.manual_seed(456)
    b = _orders(5, 1, ds)[0]
    assert torch.equal(a, b)
