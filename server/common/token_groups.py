"""Which waiting requests make one batch when the model pads a batch to its longest member.

Kept apart from the batcher (which owns queueing, waiting and dispatch) because the choice is a
pure function of the requests' costs, tested alone, and the rule a worker's merge of batches
from several frontends keeps too (`padded_tokens` within the same budget).

Rule: the first request (the oldest) is always chosen, so no request starves and batches leave
in arrival order of their oldest member; then the others join closest in length first (ties:
the older first) while the batch's padded tokens (total rows x longest row) stay within
`max_tokens` and its items within `max_items`. A candidate that does not fit is skipped, not a
stop: a shorter one after it may still fit. A single request over the budget goes alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from mariner.server.contracts.types import TokenCost


def padded_tokens(costs: Sequence[TokenCost]) -> int:
    """What a batch of these requests costs padded to its longest row: total rows x longest."""
    if not costs:
        return 0
    return sum(c.rows for c in costs) * max(c.longest for c in costs)


def group_by_length(
    costs: Sequence[TokenCost], items: Sequence[int], *, max_items: int, max_tokens: int | None
) -> list[int]:
    """Indices, ascending, of the requests that make the next batch (see the module docstring).

    `costs[i]` and `items[i]` (batch slots) describe the i-th oldest waiting request; index 0 is
    always in the answer. `max_tokens` None: no token budget, only grouping by length.
    """
    if not costs:
        return []
    first = costs[0]
    rows, longest, taken = first.rows, first.longest, items[0]
    chosen = [0]
    by_distance = sorted(range(1, len(costs)), key=lambda i: (abs(costs[i].longest - first.longest), i))
    for i in by_distance:
        if taken >= max_items:
            break
        c = costs[i]
        widest = max(longest, c.longest)
        if taken + items[i] > max_items or (max_tokens is not None and (rows + c.rows) * widest > max_tokens):
            continue
        chosen.append(i)
        rows, longest, taken = rows + c.rows, widest, taken + items[i]
    return sorted(chosen)
