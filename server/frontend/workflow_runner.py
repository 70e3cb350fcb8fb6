"""One request through a workflow's graph, as TorchServe's `DagExecutor` runs it.

The request goes to the start node; each node runs once every node that feeds it has answered,
nodes whose inputs are ready run at the same time, and the outputs of the leaves are the answer.
What a node receives, as in TorchServe: the start node the request's own data and headers; a
node fed by one node `{"body": <its output bytes>}`; a node fed by several `{<node>: <its output
bytes>, ...}`; every node the request's headers. Each node is a call to the model it is served
as (`call`: the DataPlane, so it is admitted, queued and batched with any other request of that
model), nothing of it runs here.

A node's try fails on any serving error (its handler raised, its worker died, its `timeout-ms`
deadline passed, ...) and is tried again up to `retry-attempts` more times (TorchServe's
default: 1); the model being gone (NOT_FOUND) or the client (CANCELLED) ends it at once. A node
whose handler answers the request with an error status of its own (`set_response_status`) is
not a failure to retry: that answer is the workflow's (`NodeAnswered`). The first node to fail
for good cancels the others still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mariner.server.contracts.errors import (
    HANDLER_EXCEPTION,
    Code,
    ServingError,
    TorchServeAnswer,
    torchserve_answer,
)
from mariner.server.contracts.types import InferResult
from mariner.server.contracts.workflow_dag import WorkflowDag, WorkflowNode

__all__ = ["NodeAnswered", "NodeCall", "NodeFailed", "run_workflow"]

log = logging.getLogger("mariner.workflows")

# A node's call: (node, the data its handler receives for this request, the try's deadline as a
# time.monotonic() instant) -> the node's answer, or a ServingError.
NodeCall = Callable[[WorkflowNode, dict[str, Any], float], Awaitable[InferResult]]
# Failures that another try cannot mend.
_FINAL = frozenset({Code.NOT_FOUND, Code.CANCELLED})


class NodeAnswered(Exception):
    """A node's handler answered this request with an error status it set; the workflow answers it."""

    def __init__(self, node: str, result: InferResult) -> None:
        super().__init__(f"node {node} answered with status {result.status}")
        self.node = node
        self.result = result


class NodeFailed(Exception):
    """A node failed on its last try (`attempts` tries), or with a failure no try can mend."""

    def __init__(self, node: WorkflowNode, attempts: int, error: ServingError) -> None:
        super().__init__(f"node {node.name} failed after {attempts} tries: {error.message}")
        self.node = node
        self.attempts = attempts
        self.error = error

    def serving_error(self, workflow: str) -> ServingError:
        """The workflow's answer: TorchServe's 500 `Error executing <node>`, with the reason (the
        node's error as TorchServe's endpoints word it) and the tries after it; a client that
        went away stays CANCELLED."""
        if self.error.code is Code.CANCELLED:
            return self.error
        reason = torchserve_answer(self.error).message
        tries = "try" if self.attempts == 1 else "tries"
        message = f"Error executing {self.node.name} ({self.attempts} {tries}; the last: {reason})"
        return ServingError(
            Code.INTERNAL,
            f"workflow {workflow}: {message}",
            torchserve=TorchServeAnswer(500, HANDLER_EXCEPTION, message),
        )


async def _node(
    node: WorkflowNode, data: dict[str, Any], call: NodeCall, clock: Callable[[], float]
) -> InferResult:
    """The node's tries: each with its own `timeout-ms` deadline."""
    tries = node.retry_attempts + 1
    for attempt in range(1, tries + 1):
        try:
            return await call(node, data, clock() + node.timeout_ms / 1000.0)
        except ServingError as exc:
            if attempt == tries or exc.code in _FINAL:
                raise NodeFailed(node, attempt, exc) from None
            log.warning("workflow node %s (model %s) failed on try %d of %d: %s; trying again",
                        node.name, node.model, attempt, tries, exc.message)  # fmt: skip
    raise AssertionError("unreachable: the last try returns or raises")


def _feed(dag: WorkflowDag, inputs: dict[str, dict[str, Any]], src: str, output: bytes, child: str) -> None:
    """`src`'s output into `child`'s data: as `body` when `src` is its only parent, else under
    `src`'s name (TorchServe's input parameters)."""
    key = "body" if len(dag.parents(child)) == 1 else src
    inputs.setdefault(child, {})[key] = output


async def run_workflow(
    dag: WorkflowDag,
    request_data: Mapping[str, Any],
    call: NodeCall,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> list[tuple[str, InferResult]]:
    """Run `dag` for one request whose data is `request_data`; the leaves' answers, in the
    graph's order. Raises NodeFailed or NodeAnswered (the others still running are cancelled)."""
    inputs: dict[str, dict[str, Any]] = {dag.start.name: dict(request_data)}
    waiting = {n.name: len(dag.parents(n.name)) for n in dag.nodes}
    running: dict[asyncio.Task[InferResult], str] = {}
    answers: dict[str, InferResult] = {}

    def start(name: str) -> None:
        task = asyncio.create_task(_node(dag.node(name), inputs.pop(name), call, clock))
        running[task] = name

    start(dag.start.name)
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                name = running.pop(task)
                result = task.result()  # a failure ends the run; `finally` cancels the rest
                if 100 <= result.status < 400:
                    answers[name] = result
                else:
                    raise NodeAnswered(name, result)
                for child in dag.children(name):
                    _feed(dag, inputs, name, result.body, child)
                    waiting[child] -= 1
                    if waiting[child] == 0:
                        start(child)
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    return [(leaf, answers[leaf]) for leaf in dag.leaves()]
