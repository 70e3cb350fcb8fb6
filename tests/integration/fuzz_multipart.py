"""Hostile multipart/form-data requests for /predictions/{model}, for test_fuzz.py.

A form body is where the server parses structure a client wrote byte by byte: the boundary, part
header blocks (Content-Disposition parameters, Content-Type, folding, encodings) and the parts'
framing. Header parsers have failed here before (a recursive RFC 5322 parser answered 500 for
5,000 nested parens and blocked the event loop for seconds on long parameter lists), so the
strategy leans on exactly that: long and nested-paren headers near the 8 KiB per-part cap,
comments, quotes and escapes, RFC 2231 and RFC 2047 syntax, non-UTF-8 bytes, bare CR or LF,
missing or wrong boundaries, too many parts and truncated bodies. Payloads are the model inputs
the other HTTP strategies use, so a well-formed form still reaches the handler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.integration.fuzzing import (
    CONTENT_TYPES,
    GOOD_PIXELS,
    MAX_REQUEST_BYTES,
    MODEL,
    model_inputs,
    mostly,
)

MAX_PART_HEADER_BYTES = 8 * 1024  # the server's cap, crossed on purpose now and then
GOOD_PART = json.dumps(GOOD_PIXELS).encode()


@dataclass(frozen=True)
class MultipartCase:
    """One fuzzed form request: its target, its Content-Type header and its body."""

    target: str
    content_type: bytes
    body: bytes


boundaries = mostly(
    st.one_of(st.just("b0undary"), st.from_regex(r"\A[A-Za-z0-9'()+_,-./:=?]{1,70}\Z")),
    st.sampled_from(["", " ", "a b", "--", "-", "é", "b;c", "x" * 200, "(", '"', "\\"]),
)


def repeat(unit: bytes, counts: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    return counts.map(lambda n: unit * n)


# Sizes around the part-header cap and far past it (the body limit stops the rest at 413).
small_counts = st.integers(0, 40)
big_counts = st.one_of(st.integers(100, 3000), st.sampled_from([5000, 8000, 10_000]))
hostile_fillers = st.one_of(
    *(repeat(unit, mostly(small_counts, big_counts)) for unit in (b"(", b"(a)", b"; a=b", b"\\", b'"', b")")),
    repeat(b"=?utf-8?q?a?= ", mostly(small_counts, st.integers(100, 600))),
    repeat(
        b"a",
        mostly(st.integers(0, 200), st.integers(MAX_PART_HEADER_BYTES - 200, MAX_PART_HEADER_BYTES + 200)),
    ),
)
odd_bytes = st.sampled_from(
    [b"\xe9", b"\xff\xfe", b"\xc3\xa9", b"\x00", b"\x7f", b"\x1b[0m", b"\xed\xa0\x80"]
)
names = st.one_of(
    st.sampled_from([b'"data"', b"data", b'"body"', b"DATA", b'""', b"", b"it's", b'"a;b"', b'"\\"q\\""',
                     b"\"unterminated", b'"tail\\\\"', b"<data>", b"=?utf-8?q?data?=",
                     b'"=?utf-8?b?ZGF0YQ==?="']),
    st.text(max_size=12).map(lambda s: b'"' + s.encode("utf-8", "surrogatepass") + b'"'),
    odd_bytes,
    st.tuples(hostile_fillers, st.sampled_from([b"", b'"'])).map(lambda t: t[1] + t[0] + t[1]),
)  # fmt: skip
name_keys = mostly(
    st.sampled_from([b"name", b"NAME", b" name "]),
    st.sampled_from([b"name*", b"name*0", b"na me", b"filename", b""]),
)


@st.composite
def dispositions(draw: st.DrawFn) -> bytes:
    """A Content-Disposition value: a type, a name (or not), and odd parameters around it."""
    params = [draw(st.sampled_from([b"form-data", b"FORM-DATA", b"attachment", b"", b"(c) form-data"]))]
    if draw(st.booleans()):
        params.append(b"filename=" + draw(names))
    if not all(draw(st.booleans()) for _ in range(3)):  # usually named
        params.insert(draw(st.integers(1, len(params))), draw(name_keys) + b"=" + draw(names))
    for _ in range(draw(st.integers(0, 2))):
        params.append(
            draw(st.sampled_from([b"x", b"x=", b"x*=utf-8''%41", b"x=" + b"(" * 3])) + draw(hostile_fillers)
        )
    return draw(st.sampled_from([b";", b"; ", b" ;\t", b";\r\n "])).join(params)


content_types = st.one_of(
    st.sampled_from(CONTENT_TYPES).map(str.encode),
    st.sampled_from([b"application/json", b"text/plain", b"text/plain; charset=utf-8"]).flatmap(
        lambda base: hostile_fillers.map(lambda tail: base + b"; a=" + tail)
    ),
    st.tuples(st.sampled_from([b"application/json (", b"text/plain ("]), hostile_fillers).map(b"".join),
    odd_bytes.map(lambda b: b"text/" + b),
)


@st.composite
def header_blocks(draw: st.DrawFn) -> bytes:
    """A part's header block: Content-Disposition and Content-Type in any order, case or folding,
    plus long, odd or broken lines."""
    lines = []
    disposition_name = draw(
        st.sampled_from([b"Content-Disposition", b"content-disposition", b"CONTENT-DISPOSITION"])
    )
    lines.append(disposition_name + b":" + draw(st.sampled_from([b" ", b"", b"\t"])) + draw(dispositions()))
    if draw(st.booleans()):
        lines.append(b"Content-Type: " + draw(content_types))
    for _ in range(draw(st.integers(0, 2))):
        start = draw(
            st.sampled_from([b"X-Long: ", b"X: ", b"no colon ", b" folded ", b": ", b"Content-Type: "])
        )
        lines.append(start + draw(st.one_of(hostile_fillers, odd_bytes)))
    order = draw(st.permutations(lines))
    return draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r", b"\r\n\t"])).join(order)


@st.composite
def parts(draw: st.DrawFn, boundary: bytes) -> bytes:
    payload = draw(
        st.one_of(st.just(GOOD_PART), model_inputs, st.just(b"--" + boundary), st.binary(max_size=64))
    )
    padding = draw(st.sampled_from([b"", b"", b" \t", b"junk"]))
    head = b"" if all(draw(st.booleans()) for _ in range(4)) else draw(header_blocks())
    return b"--" + boundary + padding + b"\r\n" + head + b"\r\n\r\n" + payload + b"\r\n"


@st.composite
def multipart_cases(draw: st.DrawFn) -> MultipartCase:
    """A form request: mostly well framed, its part headers hostile, now and then broken framing."""
    boundary = draw(boundaries)
    wire_boundary = boundary.encode()
    count = draw(mostly(st.integers(0, 4), st.integers(60, 70)))  # the server takes 64 parts at most
    if count > 8:  # many parts: the same one repeated, to stay cheap to draw and under the body limit
        body_parts = [draw(parts(wire_boundary))] * count
    else:
        body_parts = [draw(parts(wire_boundary)) for _ in range(count)]
    delimiter = b"--" + wire_boundary
    closings = [
        delimiter + b"--\r\n",
        delimiter + b"--\r\n",
        delimiter + b"--",
        delimiter,
        b"",
        delimiter + b"--\r\nx",
    ]
    closing = draw(st.sampled_from(closings))
    preamble = draw(st.sampled_from([b"", b"", b"preamble\r\n", b"\r\n"]))
    body = preamble + b"".join(body_parts) + closing
    if len(body) > MAX_REQUEST_BYTES + 4096:  # past the limit either way: keep what goes on the wire small
        body = body[: MAX_REQUEST_BYTES + 4096]
    if all(draw(st.booleans()) for _ in range(3)):  # truncated anywhere
        body = body[: draw(st.integers(0, len(body)))]
    header_boundary = draw(mostly(st.just(boundary), boundaries))  # now and then not the body's
    hb = header_boundary
    content_type = draw(
        st.sampled_from(
            [f"multipart/form-data; boundary={hb}", f'multipart/form-data; boundary="{hb}"',
             f"MULTIPART/FORM-DATA; BOUNDARY={hb}; charset=utf-8", "multipart/form-data",
             f"multipart/form-data; x=(a(b)); boundary={hb}", f"multipart/mixed; boundary={hb}"]
        )
    )  # fmt: skip
    target = draw(
        st.sampled_from([f"/predictions/{MODEL}", f"/predictions/{MODEL}", f"/predictions/{MODEL}/1.0"])
    )
    return MultipartCase(target, content_type.encode("utf-8"), body)
