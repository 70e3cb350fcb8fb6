"""One request through a workflow's graph (frontend.workflow_runner), driven by fake node calls:
what each node receives, which nodes run together, tries, deadlines and the answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mariner.server.contracts.errors import Code, ServingError, torchserve_answer
from mariner.server.contracts.types import InferResult
from mariner.server.contracts.workflow_dag import WorkflowDag, WorkflowNode, build_dag
from mariner.server.frontend.workflow_runner import NodeAnswered, NodeFailed, run_workflow

pytestmark = pytest.mark.unit


def dag(edges: dict[str, list[str]], *, retry: int = 1, timeout_ms: int = 1000) -> WorkflowDag:
    names: list[str] = []
    for src, dsts in edges.items():
        for n in (src, *dsts):
            if n not in names:
                names.append(n)
    nodes = [WorkflowNode(n, f"wf__{n}", True, retry, timeout_ms) for n in names]
    return build_dag("wf", nodes, edges)


class Calls:
    """Fake node calls: each answers its node's name and what it received, unless told otherwise."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any], float]] = []
        self.fail: dict[str, list[ServingError]] = {}  # node -> errors for its next tries
        self.gates: dict[str, asyncio.Event] = {}  # node -> released before it answers
        self.started: dict[str, asyncio.Event] = {}
        self.answers: dict[str, InferResult] = {}
        self.cancelled: list[str] = []

    def started_event(self, name: str) -> asyncio.Event:
        return self.started.setdefault(name, asyncio.Event())

    async def __call__(self, node: WorkflowNode, data: dict[str, Any], deadline: float) -> InferResult:
        self.seen.append((node.name, dict(data), deadline))
        self.started_event(node.name).set()
        if node.name in self.gates:
            try:
                await self.gates[node.name].wait()
            except asyncio.CancelledError:
                self.cancelled.append(node.name)
                raise
        if self.fail.get(node.name):
            raise self.fail[node.name].pop(0)
        if node.name in self.answers:
            return self.answers[node.name]
        return InferResult(f"{node.name}({','.join(sorted(data))})".encode())


def run(
    d: WorkflowDag, calls: Calls, data: dict[str, Any] | None = None, **kw: Any
) -> list[tuple[str, InferResult]]:
    return asyncio.run(run_workflow(d, data or {"data": b"input"}, calls, **kw))


def test_the_graph_is_ordered_with_every_node_after_its_parents() -> None:
    d = dag({"a": ["b", "c"], "b": ["d"], "c": ["d"]})
    assert [n.name for n in d.nodes] == ["a", "b", "c", "d"]
    assert d.parents("d") == ("b", "c")
    assert d.leaves() == ("d",)


def test_each_node_gets_the_request_then_its_parent_s_output_as_body() -> None:
    calls = Calls()
    leaves = run(dag({"pre": ["m1"], "m1": ["post"]}), calls, {"data": b"png"})
    received = {name: data for name, data, _ in calls.seen}
    assert received["pre"] == {"data": b"png"}  # the request's own data
    assert received["m1"] == {"body": b"pre(data)"}  # one parent: its output bytes as body
    assert received["post"] == {"body": b"m1(body)"}
    assert [(name, r.body) for name, r in leaves] == [("post", b"post(body)")]


def test_a_node_fed_by_several_gets_each_output_under_its_parent_s_name_and_siblings_run_together() -> None:
    calls = Calls()
    d = dag({"a": ["b", "c"], "b": ["d"], "c": ["d"]})

    async def scenario() -> list[tuple[str, InferResult]]:
        # b answers only once c has started: the run would hang unless both run at once.
        calls.gates["b"] = asyncio.Event()
        task = asyncio.create_task(run_workflow(d, {"body": b"x"}, calls))
        await calls.started_event("c").wait()
        calls.gates["b"].set()
        return await task

    leaves = asyncio.run(scenario())
    received = {name: data for name, data, _ in calls.seen}
    assert received["d"] == {"b": b"b(body)", "c": b"c(body)"}
    assert [name for name, _ in leaves] == ["d"]


def test_several_leaves_answer_in_the_graph_s_order() -> None:
    leaves = run(dag({"a": ["c", "b"]}), Calls())
    assert [name for name, _ in leaves] == ["c", "b"]


def test_a_failed_try_is_tried_again_with_a_fresh_deadline() -> None:
    calls = Calls()
    calls.fail["b"] = [ServingError(Code.UNAVAILABLE, "worker died")]
    now = iter([100.0, 200.0, 300.0])
    leaves = run(dag({"a": ["b"]}, retry=1, timeout_ms=500), calls, clock=lambda: next(now))
    tries = [(name, deadline) for name, _, deadline in calls.seen]
    assert tries == [("a", 100.5), ("b", 200.5), ("b", 300.5)]  # each try: now + timeout-ms
    assert leaves[0][1].body == b"b(body)"


def test_a_node_failing_on_its_last_try_fails_the_workflow_as_torchserve_answers() -> None:
    calls = Calls()
    calls.fail["b"] = [ServingError(Code.INTERNAL, "x")] * 3
    with pytest.raises(NodeFailed) as info:
        run(dag({"a": ["b"]}, retry=2), calls)
    assert [name for name, _, _ in calls.seen] == ["a", "b", "b", "b"]  # 1 try + 2 retry-attempts
    err = info.value.serving_error("wf")
    answer = torchserve_answer(err)
    assert (answer.status, answer.type) == (500, "InternalServerException")
    assert answer.message.startswith("Error executing b (3 tries; the last: x)")


def test_no_retry_when_the_model_is_gone_and_the_others_are_cancelled() -> None:
    calls = Calls()
    calls.gates["c"] = asyncio.Event()  # c never answers: it must be cancelled
    calls.fail["b"] = [ServingError(Code.NOT_FOUND, "model gone")]
    with pytest.raises(NodeFailed) as info:
        run(dag({"a": ["b", "c"]}, retry=3), calls)
    assert info.value.attempts == 1
    assert [name for name, _, _ in calls.seen].count("b") == 1
    assert calls.cancelled == ["c"]


def test_a_node_s_own_error_status_is_the_answer_and_is_not_retried() -> None:
    calls = Calls()
    calls.answers["b"] = InferResult(b'{"error": "bad input"}', status=400)
    with pytest.raises(NodeAnswered) as info:
        run(dag({"a": ["b"], "b": ["c"]}, retry=3), calls)
    assert info.value.result.status == 400
    assert [name for name, _, _ in calls.seen] == ["a", "b"]


def test_a_client_that_went_away_stays_cancelled() -> None:
    calls = Calls()
    calls.fail["a"] = [ServingError(Code.CANCELLED, "the client went away")]
    with pytest.raises(NodeFailed) as info:
        run(dag({"a": ["b"]}), calls)
    assert info.value.serving_error("wf").code is Code.CANCELLED
