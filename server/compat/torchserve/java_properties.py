"""Java's `.properties` syntax, read as java.util.Properties.load reads it (TorchServe's
`config.properties` and the config snapshots Mariner writes in it), and Java's
Boolean.parseBoolean for its values.

Apart from `properties`, which says what the keys mean for Mariner: this is the file format
alone, with no key of its own.
"""

from __future__ import annotations

import re


def read_properties(text: str) -> dict[str, str]:
    """Java .properties as java.util.Properties.load reads them: `key=value`, `key: value` or
    `key value` lines, '#'/'!' comments, a line ending in an odd number of backslashes continued
    on the next, and escapes (`\\:`, `\\=`, `\\n`, `\\uXXXX`, any other `\\x` is `x`): what
    TorchServe reads, and how its config snapshots are written. A value's trailing spaces are
    dropped (Java keeps them; a path ending in a space is never what was meant)."""
    out: dict[str, str] = {}
    logical, buf, continued = [], "", False
    for raw in text.splitlines():
        line = raw.lstrip(" \t\f")
        if not continued and (not line or line.startswith(("#", "!"))):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        continued = trailing % 2 == 1
        if continued:
            buf += line[:-1]
            continue
        logical.append(buf + line)
        buf = ""
    if buf:
        logical.append(buf)
    for line in logical:
        key, value = _split_property(line)
        if key:
            out[key] = value.rstrip()
    return out


def _split_property(line: str) -> tuple[str, str]:
    """A logical line's key (up to the first unescaped '=', ':' or blank) and value, unescaped."""
    i = 0
    while i < len(line) and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    key, rest = line[:i], line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return _unescape(key), _unescape(rest)


_ESCAPED = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_UNICODE = re.compile(r"[0-9a-fA-F]{4}")


def _unescape(text: str) -> str:
    out, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch != "\\" or i + 1 == len(text):
            out.append(ch)
            i += 1
        elif text[i + 1] == "u" and _UNICODE.fullmatch(text[i + 2 : i + 6]):
            out.append(chr(int(text[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(_ESCAPED.get(text[i + 1], text[i + 1]))
            i += 2
    return "".join(out)


def parse_boolean(value: str) -> bool:
    return value.strip().lower() == "true"  # Java's Boolean.parseBoolean
