"""The sentence-encoder's text data: real sentences, disjoint deterministic splits, and
mixed-length texts whose word-piece counts really spread over the asked range."""

from __future__ import annotations

import pytest

from mariner.training import text_data

pytestmark = pytest.mark.unit


def test_splits_are_disjoint_deterministic_real_sentences() -> None:
    calibration = text_data.sentences("calibration")
    heldout = text_data.sentences("heldout")
    assert len(heldout) >= 30
    assert len(calibration) >= 50
    assert not set(calibration) & set(heldout)
    assert text_data.sentences("heldout") == heldout
    for s in heldout:
        assert s[0].isupper()
        assert s[-1] in ".!?"
        assert len(s.split()) >= 5
        assert "===" not in s  # no table rows
        assert not s.startswith((":", ".."))  # no field lists or directives


def test_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        text_data.sentences("train")


def test_word_pieces_are_counted_without_the_checkpoints_128_cap() -> None:
    long_text = " ".join(text_data.sentences("calibration"))
    assert text_data.word_pieces(long_text) > 1000


def test_mixed_length_spreads_over_the_range_and_cuts_at_words() -> None:
    texts = text_data.mixed_length(60, seed=11, lo=5, hi=200)
    counts = [text_data.word_pieces(t) for t in texts]
    assert len(texts) == 60
    assert all(5 <= c <= 200 for c in counts)
    assert min(counts) < 50  # both ends of the range are present, not one typical length
    assert max(counts) > 150
    words = {
        w for s in text_data.sentences("calibration") + text_data.sentences("heldout") for w in s.split()
    }
    assert all(t.split()[-1] in words for t in texts)  # the last word is whole
    assert text_data.mixed_length(60, seed=11, lo=5, hi=200) == texts
    assert text_data.mixed_length(60, seed=12, lo=5, hi=200) != texts


def test_mixed_length_narrow_range_and_bad_range() -> None:
    counts = [text_data.word_pieces(t) for t in text_data.mixed_length(10, seed=2, lo=300, hi=320)]
    assert all(300 <= c <= 320 for c in counts)
    with pytest.raises(ValueError, match="lo <= hi"):
        text_data.mixed_length(1, seed=0, lo=10, hi=5)
