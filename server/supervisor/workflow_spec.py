"""A workflow's specification file (the YAML a `.war` names as `specFile`), read and checked.

TorchServe's format (docs/workflows.md of TorchServe 0.12):

```yaml
models:
  min-workers: 1        # global values, for every model node
  max-workers: 1
  batch-size: 8
  max-batch-delay: 50   # ms
  retry-attempts: 1     # tries after the first, per node and request
  timeout-ms: 10000     # each try's deadline
  m1:                   # a model node: an archive of the model store, its own values over the globals
    url: mnist.mar
    batch-size: 4
dag:
  preprocessing: [m1]   # node -> the nodes its output feeds
  m1: [postprocessing]
```

Every name in `dag` is a node: a model of `models:`, else a function of the archive's handler.
TorchServe casts each value and fails a bad one with a 500 and a Java exception; here every value
is checked and a bad one refused (400 `InvalidWorkflowException`) naming the key, what it holds
and what is allowed. What TorchServe silently ignores (an unknown key of a model, a model the dag
never names) is ignored here too, with one warning.
"""

from __future__ import annotations

import keyword
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.names import model_name_problem
from mariner.server.contracts.workflow_dag import MAX_NODES, WorkflowDag, node_model_name

__all__ = [
    "NodeSettings",
    "NodeSpec",
    "WorkflowInfo",
    "WorkflowSpec",
    "java_text",
    "parse_spec",
    "workflow_refused",
]

log = logging.getLogger("mariner.workflows")

# TorchServe's exception for a workflow archive it cannot use.
INVALID_WORKFLOW = "InvalidWorkflowException"
# Targets one node may list (every edge of the dag costs a check; MAX_NODES bounds the useful ones).
MAX_TARGETS = MAX_NODES


def workflow_refused(message: str) -> ServingError:
    """A workflow archive refused: 400 with TorchServe's exception type and our reason."""
    return ServingError(
        Code.INVALID_ARGUMENT, message, torchserve=TorchServeAnswer(400, INVALID_WORKFLOW, message)
    )


@dataclass(frozen=True)
class NodeSettings:
    """A node's values, TorchServe's defaults (WorkFlow.java) where the specification says none."""

    min_workers: int = 1
    max_workers: int = 1
    batch_size: int = 1
    max_batch_delay_ms: int = 50
    retry_attempts: int = 1
    timeout_ms: int = 10_000


# Specification key -> (NodeSettings field, lowest allowed, highest allowed or None). Worker
# counts and batch sizes are bounded again by the worker budget and the model settings.
_SETTINGS: dict[str, tuple[str, int, int | None]] = {
    "min-workers": ("min_workers", 0, None),
    "max-workers": ("max_workers", 1, None),
    "batch-size": ("batch_size", 1, None),
    "max-batch-delay": ("max_batch_delay_ms", 0, None),
    "retry-attempts": ("retry_attempts", 0, 10),
    "timeout-ms": ("timeout_ms", 1, 3_600_000),
}
assert {f for f, _, _ in _SETTINGS.values()} == {f.name for f in fields(NodeSettings)}


@dataclass(frozen=True)
class NodeSpec:
    """One node of the dag: `url` names its model's archive in the model store; None makes it a
    function of the workflow's handler (TorchServe serves it as a model of batch size 1, one
    worker, no batch delay)."""

    name: str
    url: str | None
    settings: NodeSettings

    @property
    def function(self) -> bool:
        return self.url is None


@dataclass(frozen=True)
class WorkflowSpec:
    """A checked specification: the global values, the nodes in the order the dag first names
    them, the edges, and the dag as TorchServe's describe shows it (`java_text`)."""

    defaults: NodeSettings
    nodes: tuple[NodeSpec, ...]
    edges: Mapping[str, tuple[str, ...]]
    dag_text: str


@dataclass(frozen=True)
class WorkflowInfo:
    """A served workflow as management lists and describes it: the url it was registered from,
    the specification's global values, its graph and the dag as TorchServe shows it."""

    name: str
    url: str
    defaults: NodeSettings
    dag: WorkflowDag
    dag_text: str

    @property
    def models(self) -> tuple[str, ...]:
        """The models its nodes are served as."""
        return tuple(n.model for n in self.dag.nodes)


def java_text(value: Any) -> str:
    """`value` as Java's toString writes the map SnakeYAML read (TorchServe's describe shows the
    dag so: `{preprocessing=[m1], m1=[postprocessing]}`)."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{java_text(k)}={java_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(java_text(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _settings(where: str, values: Mapping[str, Any], base: NodeSettings) -> NodeSettings:
    given: dict[str, int] = {}
    for key, (name, lowest, highest) in _SETTINGS.items():
        if key not in values:
            continue
        value = values[key]
        bounds = f"at least {lowest}" + (f" and at most {highest}" if highest is not None else "")
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < lowest
            or (highest is not None and value > highest)
        ):
            raise workflow_refused(f"{where}: {key} is {value!r}; it must be a whole number, {bounds}")
        given[name] = value
    return replace(base, **given)


def _node_name(where: str, workflow: str, name: Any) -> str:
    """A node name: a string a model name can be made of (`<workflow>__<node>`, the archiver's rule)."""
    if not isinstance(name, str) or model_name_problem(name) is not None:
        raise workflow_refused(
            f"{where}: node name {name!r} is not allowed; use letters, digits, '_', '-' and '.', "
            "starting with a letter or digit"
        )
    if model_name_problem(node_model_name(workflow, name)) is not None:
        raise workflow_refused(
            f"{where}: node {name} makes the model name {node_model_name(workflow, name)!r}, which is "
            "too long (at most 128 characters)"
        )
    return name


def _models(
    where: str, workflow: str, section: Any
) -> tuple[NodeSettings, dict[str, tuple[str, NodeSettings]]]:
    """The global values and each model entry's (url, values) of the `models:` section."""
    if section is None:
        return NodeSettings(), {}
    if not isinstance(section, Mapping):
        raise workflow_refused(f"{where}: models must be a mapping, got {type(section).__name__}")
    defaults = _settings(f"{where}: models", section, NodeSettings())
    models: dict[str, tuple[str, NodeSettings]] = {}
    for key, entry in section.items():
        if key in _SETTINGS:
            continue
        name = _node_name(f"{where}: models", workflow, key)
        if not isinstance(entry, Mapping):
            raise workflow_refused(
                f"{where}: models.{name} must be a model (a mapping with a url) or one of the global "
                f"keys {', '.join(_SETTINGS)}; got {entry!r:.80}"
            )
        url = entry.get("url")
        if not isinstance(url, str) or not url:
            raise workflow_refused(
                f"{where}: model {name} has no url; it must name a model archive of the model store"
            )
        unknown = sorted(str(k) for k in entry if k != "url" and k not in _SETTINGS)
        if unknown:  # TorchServe ignores them silently
            log.warning(
                "%s: model %s: keys %s are not TorchServe's and are ignored", where, name, unknown[:8]
            )
        models[name] = (url, _settings(f"{where}: model {name}", entry, defaults))
    return defaults, models


def _edges(where: str, workflow: str, dag: Any) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """The nodes in the order the dag first names them, and each node's targets.

    The dag is untrusted archive input, so the node cap (`MAX_NODES`) is enforced while it is read,
    not after: a specification naming tens of thousands of nodes is refused after at most
    MAX_NODES + 1 + MAX_TARGETS names, and `order` is a dict (insertion-ordered) so that each
    membership test is O(1) rather than a scan of the nodes seen so far."""
    if not isinstance(dag, Mapping) or not dag:
        raise workflow_refused(
            f"{where}: dag must be a non-empty mapping of node -> the nodes it feeds, e.g. "
            "'preprocessing: [m1]'"
        )
    order: dict[str, None] = {}
    edges: dict[str, tuple[str, ...]] = {}
    for key, targets in dag.items():
        src = _node_name(f"{where}: dag", workflow, key)
        if targets is None:
            targets = []
        if not isinstance(targets, list) or len(targets) > MAX_TARGETS:
            raise workflow_refused(
                f"{where}: dag.{src} must be a list of at most {MAX_TARGETS} node names, got {targets!r:.80}"
            )
        # TorchServe skips empty and blank entries.
        named = [
            _node_name(f"{where}: dag.{src}", workflow, t)
            for t in targets
            if t is not None and str(t).strip()
        ]
        for name in (src, *named):
            order.setdefault(name, None)
        if len(order) > MAX_NODES:
            raise workflow_refused(
                f"{where}: the dag has {len(order)} nodes; at most {MAX_NODES} are allowed"
            )
        # A mapping's keys are unique and a node name is the key itself, so `src` is new here.
        edges[src] = tuple(named)
    return list(order), edges


def _function_name(where: str, name: str) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise workflow_refused(
            f"{where}: node {name} is not a model of models: and cannot be a function of the handler "
            "(a function node's name is a Python function name)"
        )
    return name


def parse_spec(doc: Any, where: str, workflow: str) -> WorkflowSpec:
    """The specification `doc` (as the safe YAML loader read it) of `workflow`, checked; `where`
    names the archive and the file in refusals."""
    if not isinstance(doc, Mapping):
        raise workflow_refused(f"{where}: the specification must be a mapping with models: and dag:")
    defaults, models = _models(where, workflow, doc.get("models"))
    order, edges = _edges(where, workflow, doc.get("dag"))  # refuses more than MAX_NODES nodes
    unused = sorted(set(models) - set(order))
    if unused:  # TorchServe registers only the nodes of the dag
        log.warning("%s: models %s are not in the dag and are not registered", where, unused[:8])
    function_settings = NodeSettings(1, 1, 1, 0, defaults.retry_attempts, defaults.timeout_ms)
    nodes = tuple(
        NodeSpec(name, *models[name]) if name in models
        else NodeSpec(_function_name(where, name), None, function_settings)
        for name in order
    )  # fmt: skip
    return WorkflowSpec(defaults, nodes, edges, java_text(doc.get("dag")))
