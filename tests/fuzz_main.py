"""`make fuzz`: the fuzz tests with a large budget, then the answers they got, counted by status.

    python -m tests.fuzz_main [pytest args...]

MARINER_FUZZ_EXAMPLES is the number of examples shared by the tests (10,000 unless set; CI runs
the module under plain pytest with its small default). The counts come from
tests/integration/test_fuzz.py's STATUS_COUNTS, printed after pytest's own summary.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES_ENV = "MARINER_FUZZ_EXAMPLES"
DEFAULT_EXAMPLES = 10_000
FUZZ_MODULE = Path(__file__).resolve().parent / "integration" / "test_fuzz.py"


class StatusReport:
    """pytest plugin: after the run, print every collected module's STATUS_COUNTS."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleType] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            module = getattr(item, "module", None)
            if module is not None and hasattr(module, "STATUS_COUNTS"):
                self.modules[module.__name__] = module

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        counts: Counter[str] = Counter()
        for module in self.modules.values():
            counts.update(module.STATUS_COUNTS)
        write = terminalreporter.write_line
        terminalreporter.section(f"fuzz answers by status ({EXAMPLES_ENV}={os.environ[EXAMPLES_ENV]})")
        answers = 0
        for title, prefix in (
            ("gRPC calls", "grpc:"),
            ("HTTP requests", "http:"),
            ("ModelStreamInfer answers, in-stream", "grpc-stream:"),
            ("multipart/form-data requests (among the HTTP ones)", "multipart:"),
            ("known findings among them (each pinned by a strict xfail test)", "known finding: "),
        ):
            group = {k.removeprefix(prefix): n for k, n in sorted(counts.items()) if k.startswith(prefix)}
            write(f"{title}: {sum(group.values())}")
            for key, n in group.items():
                write(f"  {key:<64}{n:>8}")
            if prefix in ("grpc:", "http:"):
                answers += sum(group.values())
        write(f"answers (gRPC + HTTP): {answers}")


def main(argv: list[str]) -> int:
    os.environ.setdefault(EXAMPLES_ENV, str(DEFAULT_EXAMPLES))
    return int(pytest.main([str(FUZZ_MODULE), "-q", *argv], plugins=[StatusReport()]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
