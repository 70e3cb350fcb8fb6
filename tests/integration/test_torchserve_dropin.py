"""Mariner as a drop-in for stock TorchServe 0.12: the same archives, config and calls, both servers.

The archives are built the way TorchServe's examples and docs build them (the real
`torch-model-archiver`, handlers importing `ts`, built-in handlers by name, module-level and
`module:function` entry points, model-config.yaml, extra files, no-archive and tgz formats,
service envelopes, ONNX), from tiny models made here (tests/integration/ts_examples/). Each pair
of servers reads one config.properties (tests/integration/ts_examples/servers.py) and every call
goes to both; each test asserts one call answered the same (status, and the body: structurally
when both are JSON), so a run lists exactly what differs. The table of every call is printed at
the end of the module and written to build/dropin/report.md. Differences are not marked xfail:
the deliberate ones (docs/torchserve.md) are checked against their documented shape
(ts_examples/deliberate.py), so any other difference, or a documented one that changes, fails.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.ts_examples.calls import Answer, not_serving
from tests.integration.ts_examples.catalogue import PAIRS, build_store
from tests.integration.ts_examples.compare import Verdict, compare
from tests.integration.ts_examples.deliberate import DELIBERATE, judge
from tests.integration.ts_examples.plan import ALL_CALLS, Call
from tests.integration.ts_examples.report import Row, render, render_plain, write
from tests.integration.ts_examples.servers import Endpoint, Pair

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "build" / "dropin" / "report.md"


class Suite:
    """The pair serving now (one at a time: each holds a JVM and a worker per model) and the rows."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: tuple[str, Pair] | None = None
        self.rows: list[Row] = []
        self.notes: list[str] = []

    def pair(self, name: str) -> Pair:
        if self.current is not None and self.current[0] == name:
            return self.current[1]
        self.close()
        t_build = time.monotonic()
        examples = build_store(name, self.root / name / "store", self.root / name / "staging")
        pair = Pair(self.root / name / "store", examples, None if name == "plain" else name)
        self.current = (name, pair)
        t0 = time.monotonic()
        pair.start()
        late = ", ".join(f"{e.name} (missing {', '.join(e.missing())})" for e in pair.late if e.missing())
        self.notes.append(
            f"- pair `{name}`: `service_envelope={pair.envelope or '(unset)'}`; Mariner started as "
            f"`{pair.mariner_command}`; loaded at start-up: {', '.join(e.name for e in pair.startup)}"
            + (f"; registered after start-up because a module does not import here: {late}" if late else "")
            + f"; {pair.timings}, store built in {t0 - t_build:.0f} s; config.properties keys besides the "
            f"listeners: {', '.join(pair.config_keys)}"
        )
        for side in (pair.torchserve, pair.mariner):
            if side.failure:
                self.notes.append(f"  - {side.title} {side.failure}")
        return pair

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None


def _ask(call: Call, server: Endpoint, pair: Pair) -> Answer:
    return not_serving(server.failure) if server.failure else call.run(server, pair)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Suite]:
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    s = Suite(tmp_path_factory.mktemp("dropin"))
    try:
        yield s
    finally:
        s.close()
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        preamble = [
            f"Mariner tree at `{head.stdout.strip() or '?'}`; python `{sys.version.split()[0]}`. Stock "
            "TorchServe's Python processes get Mariner's torchvision shim and nothing else "
            "(ts_examples/oracle_env.py).",
            *s.notes,
        ]
        write(REPORT, render(s.rows, preamble))
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_sep("=", "TorchServe vs Mariner, call by call")
            for line in render_plain(s.rows):
                reporter.write_line(line)
            reporter.write_line(f"table: {REPORT}")


@pytest.mark.parametrize("call", ALL_CALLS, ids=[c.id for c in ALL_CALLS])
def test_same_answer_as_stock_torchserve(suite: Suite, call: Call) -> None:
    pair = suite.pair(call.pair)
    ts = _ask(call, pair.torchserve, pair)
    mariner = _ask(call, pair.mariner, pair)
    passed, why = judge(call.label, ts, mariner, describe=call.describe)
    verdict = Verdict(passed, why)
    suite.rows.append(Row(call.id, call.pair, call.archive, call.label, ts, mariner, verdict))
    assert verdict.same, (
        f"{call.label} on {call.archive}: {verdict.why}\n"
        f"  TorchServe: {ts.status} {ts.text(400)}\n  Mariner:    {mariner.status} {mariner.text(400)}"
    )


def test_every_pair_has_calls() -> None:
    assert {c.pair for c in ALL_CALLS} == set(PAIRS)


def test_every_deliberate_difference_names_a_call_and_is_in_the_guide() -> None:
    labels = {c.label for c in ALL_CALLS}
    assert set(DELIBERATE) <= labels, set(DELIBERATE) - labels
    guide = (REPO / "docs" / "torchserve.md").read_text()
    for phrase in ("case-insensitive", "NOT_FOUND", "ListModels", "batch"):
        assert phrase in guide, phrase


# -- the comparison itself, without servers ------------------------------------------------------
def test_json_bodies_compare_by_structure_not_by_formatting() -> None:
    pretty = Answer("200", b'{\n  "a": [1, 2.0000001],\n  "b": "x"\n}')
    compact = Answer("200", b'{"b":"x","a":[1,2.0]}')
    assert compare(pretty, compact).same
    assert not compare(pretty, Answer("200", b'{"a":[1,2.1],"b":"x"}')).same
    assert not compare(pretty, Answer("503", compact.body)).same, "the status counts"
    assert not compare(Answer("200", b"8"), Answer("200", b"8.0")).same, "an int is not a float"
    assert not compare(Answer("200", b"abc"), Answer("200", b"abd")).same, "non-JSON compares as bytes"


def test_describe_lists_the_differing_keys_and_ignores_process_values() -> None:
    ts = Answer("200", b'[{"batchSize": 4, "workers": [{"id": "9000", "pid": 11, "status": "READY"}]}]')
    same_but_pids = Answer(
        "200", b'[{"batchSize": 4, "workers": [{"id": "w-1", "pid": 99, "status": "READY"}]}]'
    )
    assert compare(ts, same_but_pids, describe=True).same
    assert not compare(ts, same_but_pids).same, "outside describe, every value counts"
    other = Answer(
        "200", b'[{"batchSize": 1, "extra": {}, "workers": [{"id": "w", "pid": 1, "status": "READY"}]}]'
    )
    verdict = compare(ts, other, describe=True)
    assert not verdict.same
    assert "[0].batchSize: 4 vs 1" in verdict.why
    assert "[0].extra (Mariner only)" in verdict.why
