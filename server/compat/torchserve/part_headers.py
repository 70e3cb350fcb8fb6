"""The header block of one multipart/form-data part, read in one linear pass.

A part's headers used to go through the stdlib email package (`BytesHeaderParser` with the HTTP
policy, then `get_param`). Its RFC 5322 value parser is recursive and far from linear on
hostile input: 5,000 nested `(` in a Content-Disposition parameter raised RecursionError (a
500), and 200 KB of `; a=b` parameters or `(a)` comments took seconds to minutes on the event
loop. Form parts need two things only: the `name` (and `filename`) parameter of
Content-Disposition and the Content-Type value. This module reads them the way `get_param` did
for every well-formed header (same quote and backslash rules, same first-match wins), without
interpreting comments, encoded words or RFC 2231 continuations, so no input can recurse and the
cost is one pass over a block the caller has already capped in size. Where the two differ, the
email package was wrong for a form: it dropped a parameter whose token holds `'` (so the part
had "no name") and miscounted a quote after an escaped backslash.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Line ends the email parser split header blocks on; lines starting with SP or HT continue the
# previous header (obsolete folding), joined without the line end as the email package did.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_FOLD = (b" ", b"\t")
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


@dataclass(frozen=True)
class PartHeaders:
    """What a form part's headers say about it; None where a header or parameter is absent."""

    name: str | None
    filename: str | None
    content_type: str | None


def parse_part_headers(head: bytes) -> PartHeaders:
    """Content-Disposition's name and filename, and Content-Type, of one part's header block.

    Header names are case-insensitive and the first occurrence of a header wins; bytes are
    UTF-8 with invalid sequences replaced, as the email package's HTTP policy decoded them.
    A line that is not `name: value` ends the headers.
    """
    headers = _header_fields(head)
    disposition = headers.get("content-disposition")
    params = disposition_params(disposition) if disposition is not None else {}
    return PartHeaders(params.get("name"), params.get("filename"), headers.get("content-type"))


def _header_fields(head: bytes) -> dict[str, str]:
    """Unfolded header fields by lower-cased name, the first of each name only."""
    folded: list[list[bytes]] = []  # joined once below: `+=` per fold would copy quadratically
    for line in _LINE_END.split(head):
        if line.startswith(_FOLD) and folded:
            folded[-1].append(line)
        else:
            folded.append([line])
    fields: dict[str, str] = {}
    for pieces in folded:
        line = b"".join(pieces)
        name, colon, value = line.partition(b":")
        if not colon or b" " in name or b"\t" in name:
            break  # not a header: the email parser ended the block here too
        key = name.decode("latin-1").lower()
        if key not in fields:
            fields[key] = value.decode("utf-8", errors="replace").strip(" \t")
    return fields


def disposition_params(value: str) -> dict[str, str]:
    """Parameters of a Content-Disposition value, keys lower-cased, values unquoted; first wins.

    Splits on `;` outside double quotes, where a backslash escapes the next character (RFC 7230's
    quoted-pair; email.message's `_parseparam` miscounted a quote after an escaped backslash),
    in one pass instead of rescanning from the start for every `;`. Keys with a `*` (RFC 2231
    charset or continuation) are not read: form names are plain parameters.
    """
    params: dict[str, str] = {}
    start, quoted, escaped = 0, False, False
    for i, ch in enumerate(value):
        if escaped:
            escaped = False
        elif ch == "\\" and quoted:
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == ";" and not quoted:
            _add_param(params, value[start:i])
            start = i + 1
    _add_param(params, value[start:])
    return params


def _add_param(params: dict[str, str], segment: str) -> None:
    key, eq, raw = segment.partition("=")
    if not eq:
        return
    key = key.strip().lower()
    if key and "*" not in key and key not in params:
        params[key] = _unquote(raw.strip())


def _unquote(value: str) -> str:
    """As email.utils.unquote: one pair of double quotes (and their quoted-pairs) or of <> off."""
    if len(value) > 1:
        if value.startswith('"') and value.endswith('"'):
            return _QUOTED_PAIR.sub(r"\1", value[1:-1])
        if value.startswith("<") and value.endswith(">"):
            return value[1:-1]
    return value
