"""Are two answers the same? Status first, then the body: structurally when both are JSON.

Floats compare with a relative tolerance of 1e-6 (two worker processes may use different
thread counts for the same kernel); everything else compares exactly, type included. Describe answers are
compared key by key and the differing keys are listed; values that name a process or a time
(`VOLATILE`) only have to be present on both sides.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tests.integration.ts_examples.calls import Answer

VOLATILE = frozenset({"startTime", "pid", "id", "memoryUsage", "gpuUsage", "gpu"})
_MISSING = object()


@dataclass(frozen=True)
class Verdict:
    same: bool
    why: str = ""


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _MISSING


def _differences(a: Any, b: Any, path: str, volatile: frozenset[str]) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in a:
                out.append(f"{where} (Mariner only)")
            elif key not in b:
                out.append(f"{where} (TorchServe only)")
            elif key not in volatile:
                out += _differences(a[key], b[key], where, volatile)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path or '[]'} (length {len(a)} vs {len(b)})"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in _differences(x, y, f"{path}[{i}]", volatile)
        ]
    if isinstance(a, float) and isinstance(b, float):
        if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
            return []
    elif a == b and type(a) is type(b):  # 8 is not 8.0, True is not 1
        return []
    return [f"{path or 'body'}: {json.dumps(a)[:80]} vs {json.dumps(b)[:80]}"]


def compare(ts: Answer, mariner: Answer, *, describe: bool = False) -> Verdict:
    """TorchServe's answer against Mariner's."""
    problems = []
    if ts.status != mariner.status:
        problems.append(f"status {ts.status} vs {mariner.status}")
    a, b = _json(ts.body), _json(mariner.body)
    if a is not _MISSING and b is not _MISSING:
        problems += _differences(a, b, "", VOLATILE if describe else frozenset())
    elif ts.body != mariner.body:
        problems.append("body bytes differ")
    return Verdict(
        not problems,
        "; ".join(problems[:12]) + (f"; … {len(problems) - 12} more" if len(problems) > 12 else ""),
    )
