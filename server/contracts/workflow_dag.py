"""A workflow's graph: its nodes, the edges between them, and the order they may run in.

A TorchServe workflow (`.war`) names a DAG in its specification (`dag: {a: [b, c], b: [d]}`):
each node is a model of the specification's `models:` section or a function of the archive's
handler, and each edge feeds one node's output to another. TorchServe serves each node as a
model named `<workflow>__<node>`; so does Mariner, and a frontend runs the graph per request
(`frontend.workflow_runner`) from the `WorkflowDag` the supervisor sends it with every model table.

`build_dag` checks the graph as TorchServe's `Dag.validate` does, with the reason said: at most
`MAX_NODES` nodes, no cycle (a self-loop included), and exactly one start node (a node nothing
feeds), which is the one the request goes to. Every other node is then reachable from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer

__all__ = [
    "MAX_NODES",
    "WorkflowDag",
    "WorkflowNode",
    "WorkflowTable",
    "build_dag",
    "dag_refused",
    "node_model_name",
    "workflow_not_found",
]

# Nodes of one workflow: each is a served model with its own worker processes.
MAX_NODES = 64
# TorchServe's exception for a graph it refuses (400, "Invalid workflow specification").
INVALID_DAG = "InvalidDAGException"


def node_model_name(workflow: str, node: str) -> str:
    """The model a node is served as, TorchServe's name for it: `<workflow>__<node>`."""
    return f"{workflow}__{node}"


def dag_refused(message: str) -> ServingError:
    """A graph refused: 400, with TorchServe's exception type and our reason."""
    return ServingError(
        Code.INVALID_ARGUMENT, message, torchserve=TorchServeAnswer(400, INVALID_DAG, message)
    )


@dataclass(frozen=True)
class WorkflowNode:
    """One node as a frontend runs it: the model it is served as, and TorchServe's per-node
    `retry-attempts` (tries after the first) and `timeout-ms` (each try's deadline)."""

    name: str
    model: str
    function: bool
    retry_attempts: int
    timeout_ms: int


@dataclass(frozen=True)
class WorkflowDag:
    """A checked workflow graph (`build_dag`): `nodes` in an order where every node comes after
    the nodes that feed it (the first is the start node), `edges` as (from, to) pairs."""

    name: str
    nodes: tuple[WorkflowNode, ...]
    edges: tuple[tuple[str, str], ...]

    @cached_property
    def _links(self) -> dict[str, tuple[list[str], list[str]]]:
        """Each node's (parents, children), in the order of the edges."""
        links: dict[str, tuple[list[str], list[str]]] = {n.name: ([], []) for n in self.nodes}
        for src, dst in self.edges:
            links[dst][0].append(src)
            links[src][1].append(dst)
        return links

    @property
    def start(self) -> WorkflowNode:
        return self.nodes[0]

    def node(self, name: str) -> WorkflowNode:
        return next(n for n in self.nodes if n.name == name)

    def parents(self, name: str) -> tuple[str, ...]:
        return tuple(self._links[name][0])

    def children(self, name: str) -> tuple[str, ...]:
        return tuple(self._links[name][1])

    def leaves(self) -> tuple[str, ...]:
        """The nodes nothing follows: their outputs are the workflow's answer."""
        return tuple(n.name for n in self.nodes if not self._links[n.name][1])


def build_dag(
    workflow: str, nodes: Sequence[WorkflowNode], edges: Mapping[str, Sequence[str]]
) -> WorkflowDag:
    """The graph of `nodes` (in the specification's order) and `edges` (node -> the nodes it
    feeds), checked and put in running order; `dag_refused` names what is wrong."""
    if len(nodes) > MAX_NODES:
        raise dag_refused(
            f"workflow {workflow}: the dag has {len(nodes)} nodes; at most {MAX_NODES} are allowed"
        )
    names = [n.name for n in nodes]
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for src, targets in edges.items():
        for dst in targets:
            if src not in names or dst not in names:
                unknown = src if src not in names else dst
                raise dag_refused(
                    f"workflow {workflow}: the dag names {unknown}, which is not one of its nodes"
                )
            if src == dst:
                raise dag_refused(f"workflow {workflow}: node {src} feeds itself; the dag must have no cycle")
            if (src, dst) not in seen:
                seen.add((src, dst))
                pairs.append((src, dst))
    indegree = dict.fromkeys(names, 0)
    for _, dst in pairs:
        indegree[dst] += 1
    starts = [n for n in names if indegree[n] == 0]
    order: list[str] = []
    ready = list(starts)
    while ready:  # Kahn's algorithm, in the specification's order
        name = ready.pop(0)
        order.append(name)
        for src, dst in pairs:
            if src == name:
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    ready.append(dst)
    if len(order) < len(names):
        cycle = ", ".join(n for n in names if n not in order)
        raise dag_refused(f"workflow {workflow}: the dag has a cycle through {cycle}; it must be acyclic")
    if len(starts) != 1:
        raise dag_refused(
            f"workflow {workflow}: the dag must have exactly one start node (one that no other node "
            f"feeds: the request goes to it); it has {len(starts)}: {', '.join(starts)}"
        )
    by_name = {n.name: n for n in nodes}
    return WorkflowDag(workflow, tuple(by_name[n] for n in order), tuple(pairs))


def workflow_not_found(name: str) -> ServingError:
    """TorchServe's answer for a workflow it does not serve: 404 WorkflowNotFoundException."""
    message = f"Workflow not found: {name[:200]}"
    return ServingError(
        Code.NOT_FOUND, message, torchserve=TorchServeAnswer(404, "WorkflowNotFoundException", message)
    )


class WorkflowTable:
    """The workflows a frontend serves, as the supervisor's latest model table lists them."""

    def __init__(self) -> None:
        self._dags: dict[str, WorkflowDag] = {}

    def replace(self, dags: Sequence[WorkflowDag]) -> None:
        self._dags = {d.name: d for d in dags}

    def get(self, name: str) -> WorkflowDag:
        found = self._dags.get(name)
        if found is None:
            raise workflow_not_found(name)
        return found

    def names(self) -> list[str]:
        return sorted(self._dags)
