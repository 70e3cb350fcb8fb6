"""Text taken from an archive (a model-config YAML, a requirements file): at most so many bytes,
and UTF-8, checked the same way wherever it is read, with the same words in the refusal."""

from __future__ import annotations


class TextRefused(ValueError):
    """The bytes are too many or not UTF-8; the message says which ("is ...", for a name before it)."""


def capped_text(data: bytes, max_bytes: int, *, bom: bool = False) -> str:
    """`data` as text, if it is at most `max_bytes` of UTF-8 (`bom`: a leading byte-order mark is
    dropped, as editors on Windows write one)."""
    if len(data) > max_bytes:
        raise TextRefused(f"is {len(data)} bytes, more than the limit of {max_bytes}")
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as exc:
        raise TextRefused(f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
