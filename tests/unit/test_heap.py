"""`freeze_heap`, in a fresh interpreter (it changes the collector of the process it runs in):
what is alive when it runs is frozen, the young generation is `YOUNG_OBJECTS` with the older
thresholds kept, and cyclic garbage made afterwards is still collected."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mariner.server.common.heap import YOUNG_OBJECTS

pytestmark = pytest.mark.unit

PROGRAM = """
import gc, json, weakref
from mariner.server.common.heap import freeze_heap
before = gc.get_threshold()
loaded = [[i] for i in range(5000)]  # the long-lived heap of a loaded process
freeze_heap()
frozen = gc.get_freeze_count()

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle only the collector frees
gone = weakref.ref(a)
del a, b
for _ in range(3 * YOUNG):
    [None]  # short-lived containers, freed by reference counting
gc.collect()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": frozen,
                  "cycle_freed": gone() is None, "loaded": len(loaded)}))
"""


def test_freeze_heap_freezes_what_is_loaded_and_widens_only_the_young_generation() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM.replace("YOUNG", str(YOUNG_OBJECTS))],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    facts = json.loads(out)
    assert facts["frozen"] >= facts["loaded"], "the loaded heap is frozen"
    assert facts["after"] == [YOUNG_OBJECTS, *facts["before"][1:]]
    assert facts["before"][0] < YOUNG_OBJECTS
    assert facts["cycle_freed"], "a cycle made after freezing is still collected"
