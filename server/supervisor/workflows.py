"""TorchServe workflows in the supervisor: register, unregister, list and describe them.

A workflow (`.war` from the workflow store: `--workflow-store`, `workflow_store`, else the model
store, as TorchServe) is a graph of models and functions. Registering one opens and checks the
archive off the event loop (`supervisor.workflow_archive`), then registers each node through the
`ModelRegistry`, the one owner of the model lifecycle, as TorchServe does: a model node is the
archive its `url` names in the model store, served as `<workflow>__<node>` with the
specification's batch size, batch delay and `max-workers` workers (TorchServe starts that many);
a function node is a model of its own whose handler is `<handler>.py:<function>` (batch size 1,
one worker, no delay), so its code runs only in a worker process, never here or in a frontend.
All or nothing: when any node fails, the nodes already registered are unregistered and the
answer is TorchServe's 500 naming each failure. Only then is the workflow added to the model
table, so every frontend can run it (`/wfpredict`) before the caller hears "registered".

Unregistering takes the workflow out of the frontends' tables first, then unregisters its nodes
(one already unregistered by hand is simply gone). Like model registration, both need model
management (`--enable-model-api`); TorchServe registers workflows without it, which loads code
a model API turned off should refuse. Workflows are not in config snapshots (TorchServe leaves
them out too), nor are their nodes.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

from mariner.server.common.archive import resolve_in_store, with_envelope
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.common.models import ModelSpec, require_management
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer, torchserve_answer
from mariner.server.contracts.workflow_dag import WorkflowDag, node_model_name, workflow_not_found
from mariner.server.supervisor.registry import ModelRegistry
from mariner.server.supervisor.workflow_archive import WorkflowArchive, function_node_archive, open_workflow
from mariner.server.supervisor.workflow_spec import NodeSpec, WorkflowInfo

log = logging.getLogger("mariner.workflows")
T = TypeVar("T")

WORKFLOW_EXCEPTION = "WorkflowException"  # TorchServe's type for a workflow that failed to register


def _not_in_store(exc: ServingError) -> ServingError:
    """The model store's refusal of a `url`, worded for the workflow store (TorchServe's
    WorkflowNotFoundException, 404)."""
    ours = exc.message.replace("model store", "workflow store").replace("an archive", "a workflow archive")
    theirs = exc.torchserve.message if exc.torchserve is not None else exc.message
    theirs = theirs.replace("Model not found at:", "Workflow not found in workflow store:")
    return ServingError(
        Code.NOT_FOUND, ours, torchserve=TorchServeAnswer(404, "WorkflowNotFoundException", theirs)
    )


def _failed(name: str, failures: list[str]) -> ServingError:
    message = f"Workflow {name} has failed to register. Failures: [{', '.join(failures)}]"
    return ServingError(Code.INTERNAL, message, torchserve=TorchServeAnswer(500, WORKFLOW_EXCEPTION, message))


def _why(model: str, outcome: BaseException) -> str:
    if isinstance(outcome, ServingError):
        return f"Workflow Node {model} failed to register. Details: {torchserve_answer(outcome).message}"
    log.error("workflow node %s failed to register: %r", model, outcome)
    return f"Workflow Node {model} failed to register. Details: Check error logs."


class WorkflowRegistry:
    """Every workflow served, over the model registry that serves their nodes.

    `on_change` publishes the model table with `table()` to every frontend (bounded wait)."""

    def __init__(
        self,
        models: ModelRegistry,
        *,
        store: Path,
        model_store: Path,
        work_dir: Path,
        on_change: Callable[[], Awaitable[None]],
        service_envelope: str | None = None,
    ) -> None:
        self._models = models
        self._store = store
        self._model_store = model_store
        self._work_dir = work_dir
        self._on_change = on_change
        self._envelope = service_envelope
        self._workflows: dict[str, WorkflowInfo] = {}
        self._pending: dict[str, tuple[str, ...]] = {}  # being registered: name -> its node models
        if not store.is_dir():  # TorchServe starts anyway; every register then answers 404
            log.warning("the workflow store %s is not a directory: no workflow can be registered", store)

    @property
    def management_enabled(self) -> bool:
        return self._models.management_enabled

    # -- views -----------------------------------------------------------------------------------
    def table(self) -> tuple[WorkflowDag, ...]:
        """The graphs frontends run, in name order."""
        return tuple(self._workflows[n].dag for n in sorted(self._workflows))

    def workflows(self) -> list[WorkflowInfo]:
        return [self._workflows[n] for n in sorted(self._workflows)]

    def describe(self, name: str) -> WorkflowInfo:
        found = self._workflows.get(name)
        if found is None:
            raise workflow_not_found(name)
        return found

    def without_nodes(self, snapshot: Mapping[str, T]) -> dict[str, T]:
        """A config snapshot's models less the workflows' nodes (a snapshot restores models from
        the model store; a workflow is registered again from its archive)."""
        nodes = {m for w in self._workflows.values() for m in w.models}
        nodes |= {m for models in self._pending.values() for m in models}
        return {name: versions for name, versions in snapshot.items() if name not in nodes}

    # -- register ----------------------------------------------------------------------------
    async def register(
        self, url: str, *, name: str | None = None, timeouts: SettingsOverrides | None = None
    ) -> str:
        """Register the workflow archive `url` of the workflow store (as `name` when given);
        TorchServe's status sentence when every node is registered and its workers started.
        `timeouts` is the register call's response and startup timeouts, for every node."""
        require_management(self.management_enabled, "workflow registration")
        try:
            path = resolve_in_store(self._store, url)
        except ServingError as exc:
            raise (_not_in_store(exc) if exc.code is Code.NOT_FOUND else exc) from None
        war = await asyncio.to_thread(
            open_workflow, path, self._work_dir, url=url, model_store=self._model_store, name_override=name
        )
        try:
            if war.name in self._workflows or war.name in self._pending:
                raise ServingError(Code.ALREADY_EXISTS, f"Workflow {war.name} is already registered.")
            self._pending[war.name] = tuple(n.model for n in war.dag.nodes)
            try:
                await self._register_nodes(war, timeouts or SettingsOverrides())
            finally:
                self._pending.pop(war.name, None)
        finally:
            await asyncio.to_thread(shutil.rmtree, war.workflow_dir, True)
        self._workflows[war.name] = WorkflowInfo(war.name, url, war.defaults, war.dag, war.spec.dag_text)
        await self._on_change()
        log.info("workflow %s registered: nodes %s", war.name, ", ".join(n.name for n in war.dag.nodes))
        return f"Workflow {war.name} has been registered and scaled successfully."

    async def _register_nodes(self, war: WorkflowArchive, timeouts: SettingsOverrides) -> None:
        """Every node at once; all or nothing."""
        nodes = war.nodes
        outcomes = await asyncio.gather(
            *(self._register_node(war, n, timeouts) for n in nodes), return_exceptions=True
        )
        models = [node_model_name(war.name, n.name) for n in nodes]
        done = [m for m, o in zip(models, outcomes, strict=True) if not isinstance(o, BaseException)]
        failures = [_why(m, o) for m, o in zip(models, outcomes, strict=True) if isinstance(o, BaseException)]
        if not failures:
            return
        failures += await self._drop(done)  # TorchServe names a failed rollback among the failures
        cancelled = next((o for o in outcomes if isinstance(o, asyncio.CancelledError)), None)
        if cancelled is not None:
            raise cancelled
        raise _failed(war.name, failures)

    async def _register_node(self, war: WorkflowArchive, node: NodeSpec, timeouts: SettingsOverrides) -> None:
        model = node_model_name(war.name, node.name)
        s = node.settings
        settings = {
            "batch_size": s.batch_size,
            "max_batch_delay_ms": float(s.max_batch_delay_ms),
            # TorchServe starts max-workers workers for a node (its register's initialWorkers).
            "min_workers": s.max_workers,
            "max_workers": s.max_workers,
            **timeouts.given(),
        }
        if node.url is not None:
            await self._models.register(node.url, name=model, **settings)
            return
        archive = await asyncio.to_thread(function_node_archive, war, node, self._work_dir)
        archive = with_envelope(archive, self._envelope)  # as TorchServe records it for every model
        spec = ModelSpec(
            archive=war.url, name=model, overrides=SettingsOverrides(**settings), loaded_at_startup=False
        )
        await self._models.register_opened(archive, spec)

    # -- unregister --------------------------------------------------------------------------
    async def _drop(self, models: list[str] | tuple[str, ...]) -> list[str]:
        """Unregister these node models at once; the failures' messages (one already gone is not one)."""

        async def one(model: str) -> None:
            try:
                await self._models.unregister(model)
            except ServingError as exc:
                if exc.code is not Code.NOT_FOUND:
                    raise

        outcomes = await asyncio.gather(*(one(m) for m in models), return_exceptions=True)
        failures = []
        for model, outcome in zip(models, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.error("workflow node %s could not be unregistered: %r", model, outcome)
                failures.append(f"Error while unregistering workflow node {model}")
        return failures

    async def unregister(self, name: str) -> None:
        """Stop serving a workflow: out of the frontends' tables, then its nodes unregistered."""
        require_management(self.management_enabled, "workflow unregistration")
        workflow = self._workflows.pop(name, None)
        if workflow is None:
            raise workflow_not_found(name)
        await self._on_change()  # no frontend starts it any more before its nodes go
        failures = await self._drop(workflow.models)
        log.info("workflow %s unregistered", name)
        if failures:
            message = f"Error while unregistering the workflow {name}. Details: [{', '.join(failures)}]"
            raise ServingError(Code.INTERNAL, message)
