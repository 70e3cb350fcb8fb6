"""How a serving process keeps the garbage collector off its requests' path, once it is loaded.

Two settings, both about what a collection walks:
- `gc.freeze()` after loading: the long-lived heap (torch and the model in a worker; grpc,
  Starlette and the adapters in a frontend) moves to a generation no collection walks. Without
  it, full collections walked ~195k objects, 70-100 ms each, every few hundred ms under load.
- A young generation of `YOUNG_OBJECTS` instead of CPython's 700: a request allocates a few
  hundred container objects that almost all die by reference counting, so a young collection
  finds little garbage and mostly walks what is alive at that moment (the requests in flight),
  which at 700 happened every few requests. Measured in the frontend's fast path in-process,
  455 collections took ~0.1 s of 1.5 s of CPU, ~4.5 µs a prediction; at 20,000, 5 took 0.014 s
  (docs/benchmark.md has the live figures). Garbage in reference cycles waits longer for its
  collection: at most about that many objects.
"""

from __future__ import annotations

import gc

YOUNG_OBJECTS = 20_000


def freeze_heap() -> None:
    """Collect, freeze what is alive now and widen the young generation (module docstring)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)
