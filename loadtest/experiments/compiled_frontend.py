"""The frontend's hot modules compiled with mypyc, against the same code interpreted: what a
compiled (not rewritten) frontend buys, in-process and live.

    python -m mariner.loadtest.experiments.compiled_frontend               # 8 rounds of 3 s, 64 clients
    python -m mariner.loadtest.experiments.compiled_frontend --rounds 4 --clients 8

Why: under load the frontend's CPU is the interpreter's (perf, 64 HTTP clients: 78% of its
samples in libpython, 10% in the kernel, the rest uvloop, pickle, httptools, orjson), spread
over many pieces of a few µs; no one piece is worth cutting (docs/benchmark.md). mypyc compiles
type-annotated modules to C extensions without changing their source, which takes from every
piece at once.

The compiled build is this checkout's HEAD in a temporary worktree (`ab_live.checkout`), with
`HOT_MODULES` compiled in place by mypyc (`python -m mypyc`, gcc) and two classes marked
`allow_interpreted_subclasses` (the listener builds its protocol class at run time by
subclassing them; mypyc refuses that of a native class otherwise). It then measures:
- in-process: `percall`'s protocol piece (the fast path and the ASGI app through the listener's
  real protocol, no sockets, no worker) under each build, in turn;
- live: both builds served side by side and driven in turn by the benchmark's client, CPU per
  request by process role (`ab_live.measure`), base = interpreted, new = compiled.

Nothing is compiled in this checkout, and the worktree goes away afterwards. Needs mypy (the dev
extra) and a C compiler.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from mariner.loadtest.experiments.ab_live import (
    check_live,
    checkout,
    compare,
    imported_from,
    live_parser,
    path_first,
)

# What a prediction over HTTP runs in the frontend (module paths under the package root). Left
# out: `frontend/protocols/call.py` (mypyc cannot compile its generic frozen dataclass `Ok`) and
# `compat/torchserve/logs/access.py` (a nested class and an async generator).
HOT_MODULES = (
    "server/frontend/protocols/prediction_path.py",
    "server/frontend/protocols/prediction_protocol.py",
    "server/frontend/protocols/prediction_routes.py",
    "server/frontend/protocols/whole_answer.py",
    "server/frontend/protocols/torchserve/http.py",
    "server/frontend/batcher.py",
    "server/frontend/batch_queue.py",
    "server/frontend/dataplane.py",
    "server/frontend/endpoint.py",
    "server/common/http_limits.py",
    "server/common/deferred_metrics.py",
    "server/common/json_body.py",
    "server/common/http_common.py",
    "server/common/raw_headers.py",
    "server/common/oip_stats.py",
    "server/compat/torchserve/forms.py",
    "server/compat/torchserve/frontend_metrics.py",
    "server/compat/torchserve/logs/records.py",
)
# Classes the listener subclasses at run time (`limited_protocol`, `prediction_protocol`).
SUBCLASSED = {
    "server/common/http_limits.py": "LimitedHttpToolsProtocol",
    "server/frontend/protocols/prediction_protocol.py": "PredictionProtocol",
}
_FUTURE = "from __future__ import annotations\n"


def open_to_subclasses(tree: Path, rel: str, name: str) -> None:
    """Mark class `name` of `tree/rel` so interpreted code may subclass it once compiled."""
    path = tree / rel
    text = path.read_text()
    mark = f"@mypyc_attr(allow_interpreted_subclasses=True)\nclass {name}("
    marked, found = re.subn(rf"^class {name}\(", mark, text, count=1, flags=re.M)
    if not found or _FUTURE not in marked:
        raise RuntimeError(f"{rel}: no class {name} to mark (the module changed: update SUBCLASSED)")
    path.write_text(marked.replace(_FUTURE, _FUTURE + "\nfrom mypy_extensions import mypyc_attr\n", 1))


def compile_in_place(path: Path, modules: Sequence[str]) -> None:
    """mypyc over `modules` of the tree at `path/mariner`, extensions written beside the sources."""
    tree = path / "mariner"
    for rel, name in SUBCLASSED.items():
        if rel in modules:
            open_to_subclasses(tree, rel, name)
    files = [f"mariner/{m}" for m in modules]
    cmd = [sys.executable, "-m", "mypyc", "--explicit-package-bases", "--ignore-missing-imports", *files]
    proc = subprocess.run(cmd, cwd=path, env={**os.environ, "MYPYPATH": str(path)},
                          capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"mypyc failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@contextlib.contextmanager
def compiled(modules: Sequence[str] = HOT_MODULES) -> Iterator[Path]:
    """A PYTHONPATH entry importing `mariner` from a worktree of HEAD with `modules` compiled."""
    with checkout("HEAD") as path:
        compile_in_place(path, modules)
        first = "mariner." + modules[0].removesuffix(".py").replace("/", ".")
        origin = imported_from(path, first)
        if not origin.endswith(".so"):
            raise RuntimeError(f"{first} would be imported from {origin}, not its compiled extension")
        yield path


def percall(path: Path | None) -> str:
    """`percall`'s protocol-piece table under the build at `path` (None: this checkout)."""
    env = dict(os.environ) if path is None else path_first(path)
    code = (
        "from mariner.loadtest.experiments.percall import protocol_pieces, table\n"
        "print(table(protocol_pieces(12800, 3)))"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = live_parser(__doc__, rounds=8, seconds=3.0)
    p.add_argument("--in-process-rounds", type=int, default=2, help="percall runs per build, in turn")
    a = p.parse_args(argv)
    check_live(p, a)
    if a.in_process_rounds < 0:
        p.error("--in-process-rounds must not be negative")
    with compiled() as path:
        print(f"compiled with mypyc: {len(HOT_MODULES)} modules of HEAD", flush=True)
        for r in range(a.in_process_rounds):
            for name, where in (("interpreted", None), ("compiled", path)):
                print(f"in-process, round {r + 1}, {name}:\n{percall(where)}", flush=True)
        compare(a, base_env=None, new_env=path_first(path), names=("interpreted", "compiled"))


if __name__ == "__main__":
    main()
