"""The differences from stock TorchServe that are deliberate, each listed in docs/torchserve.md.

A call named here is not expected to answer the same: it is expected to differ in exactly the
documented way, and its check says what else would be a failure. Every other call must answer
the same (`compare`). So a new, undocumented difference still fails its test, and a documented
one that goes away (or changes shape) fails too, until the list and the guide are updated.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.integration.ts_examples.calls import Answer
from tests.integration.ts_examples.compare import compare

# describe: the one key Mariner adds (docs/torchserve.md, "describe").
MARINER_ONLY_DESCRIBE_KEYS = frozenset({"mariner"})


def without_mariner_keys(answer: Answer) -> Answer:
    """A describe answer with Mariner's documented extra keys taken out of every entry."""
    try:
        doc = json.loads(answer.body)
    except (ValueError, UnicodeDecodeError):
        return answer
    if isinstance(doc, list):
        doc = [{k: v for k, v in e.items() if k not in MARINER_ONLY_DESCRIBE_KEYS} for e in doc]
        return Answer(answer.status, json.dumps(doc).encode(), answer.content_type)
    return answer


def _body(answer: Answer) -> Any:
    return json.loads(answer.body)


def _headers_case_insensitive(ts: Answer, mariner: Answer) -> str | None:
    a, b = _body(ts), _body(mariner)
    if (a.get("header"), b.get("header"), a.get("header_as_sent"), b.get("header_as_sent")) != (
        None,
        "yes",
        "yes",
        "yes",
    ):
        return f"expected only the lower-case lookup to differ (None vs 'yes'), got {a} vs {b}"
    rest = {k: v for k, v in a.items() if k != "header"}, {k: v for k, v in b.items() if k != "header"}
    return None if rest[0] == rest[1] else f"other fields differ: {rest}"


def _batches_not_filled(ts: Answer, mariner: Answer) -> str | None:
    if ts.status != mariner.status:
        return f"statuses differ: {ts.status} vs {mariner.status}"
    a, b = _body(ts), _body(mariner)
    if any(x.get("rows") != 4 for x in a):
        return f"TorchServe did not fill the batch this time: {a}"
    if not all(1 <= x.get("rows", 0) <= 4 for x in b):
        return f"Mariner's batches are out of range: {b}"
    strip = lambda xs: [{k: v for k, v in x.items() if k != "rows"} for x in xs]  # noqa: E731
    return None if strip(a) == strip(b) else "the answers differ beyond the batch's row count"


def _grpc_unknown_model(expected_ts: str) -> Callable[[Answer, Answer], str | None]:
    def check(ts: Answer, mariner: Answer) -> str | None:
        if (ts.status, mariner.status) != (f"grpc {expected_ts}", "grpc NOT_FOUND"):
            return f"expected {expected_ts} vs NOT_FOUND, got {ts.status} vs {mariner.status}"
        text = mariner.body.decode("utf-8", errors="replace")
        return None if text.startswith("model 'nope' is not served here; served: ") else text

    return check


def _list_without_limit(ts: Answer, mariner: Answer) -> str | None:
    a, b = _body(ts), _body(mariner)
    if (ts.status, mariner.status) != ("grpc OK", "grpc OK") or a.get("models") != [] or not b.get("models"):
        return f"expected TorchServe's empty page and Mariner's models, got {a} vs {b}"
    return None


@dataclass(frozen=True)
class Deliberate:
    why: str  # the row of docs/torchserve.md's differences table
    check: Callable[[Answer, Answer], str | None]  # None: differs exactly as documented


DELIBERATE: dict[str, Deliberate] = {
    "POST /predictions/custom_fn (echo-header, text/plain)": Deliberate(
        "request headers are case-insensitive in the handler", _headers_case_insensitive
    ),
    "4 concurrent POST /predictions/with_config": Deliberate(
        "maxBatchDelay bounds the wait to fill a batch only while a worker is busy; an idle "
        "worker takes what is queued at once",
        _batches_not_filled,
    ),
    "gRPC Predictions (nope)": Deliberate(
        "unknown model over gRPC: NOT_FOUND naming what is served", _grpc_unknown_model("INTERNAL")
    ),
    "gRPC DescribeModel (nope)": Deliberate(
        "unknown model over gRPC: our message naming what is served", _grpc_unknown_model("NOT_FOUND")
    ),
    "gRPC ListModels": Deliberate(
        "gRPC ListModels without a limit lists the models (TorchServe's default limit 0 lists none)",
        _list_without_limit,
    ),
}


def judge(label: str, ts: Answer, mariner: Answer, *, describe: bool) -> tuple[bool, str]:
    """(passed, why): a deliberate difference checked against its documented shape, every other
    call compared (describe without Mariner's documented extra keys)."""
    deliberate = DELIBERATE.get(label)
    if deliberate is not None:
        problem = deliberate.check(ts, mariner)
        if problem is None:
            return True, f"deliberate: {deliberate.why}"
        return False, f"documented difference ({deliberate.why}) not as documented: {problem}"
    if describe:
        mariner = without_mariner_keys(mariner)
    verdict = compare(ts, mariner, describe=describe)
    return verdict.same, verdict.why
