"""TorchServe's workflow management API on the management port (8081), with its answers:

- `POST /workflows?url=x.war[&workflow_name=n]` (or the same as a JSON body): register a
  workflow archive of the workflow store; 200 `{"status": "Workflow n has been registered and
  scaled successfully."}`; `response_timeout` and `startup_timeout` apply to every node;
- `GET /workflows[?limit=&next_page_token=]`: `{"nextPageToken"?, "workflows": [{"workflowName",
  "workflowUrl"}]}`, sorted by name, paginated as the model list is;
- `GET /workflows/{name}`: `[{"workflowName", "workflowUrl", "minWorkers", "maxWorkers",
  "batchSize", "maxBatchDelay", "workflowDag"}]` (the specification's global values and its dag
  as TorchServe prints it);
- `DELETE /workflows/{name}`: 200 `{"status": "Workflow \"n\" unregistered"}`;
- an unknown workflow: 404 `WorkflowNotFoundException` "Workflow not found: n"; a name taken:
  409 "Workflow n is already registered."; a node that fails: 500 `WorkflowException` naming it.

Register and unregister load and drop code, so, like model registration, they answer TorchServe's
405 unless model management is enabled (TorchServe itself does not gate them). The parameters are
read as TorchServe reads them (a number that is not one is not given, with a warning); `url` is
an entry of the workflow store, never a URL.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.archive import is_url
from mariner.server.common.http_common import (
    error_response,
    json_response,
    make_guard,
)
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.common.register_settings import register_call_overrides
from mariner.server.contracts.errors import Code, ServingError, TorchServeAnswer
from mariner.server.contracts.names import check_model_name, check_params
from mariner.server.supervisor.management.describe import MAX_PAGE
from mariner.server.supervisor.management.http import METHOD_NOT_ALLOWED, register_params
from mariner.server.supervisor.workflow_spec import WorkflowInfo

log = logging.getLogger("mariner.http")

_REGISTER_PARAMS = frozenset({"url", "workflow_name", "response_timeout", "startup_timeout", "s3_sse_kms"})


class WorkflowPlane(Protocol):
    """The supervisor's workflow registry, as these routes use it."""

    @property
    def management_enabled(self) -> bool: ...

    def workflows(self) -> list[WorkflowInfo]: ...

    def describe(self, name: str) -> WorkflowInfo: ...

    async def register(
        self, url: str, *, name: str | None = None, timeouts: SettingsOverrides | None = None
    ) -> str: ...

    async def unregister(self, name: str) -> None: ...


def _int_param(params: Mapping[str, str], key: str, default: int) -> int:
    """TorchServe's getIntParameter: a missing or malformed value is the default (warned about)."""
    try:
        return int(params[key]) if key in params else default
    except ValueError:
        log.warning("parameter %s=%r is not an integer (TorchServe accepts it): using %d instead",
                    key, params[key][:80], default)  # fmt: skip
        return default


def list_workflows(workflows: list[WorkflowInfo], limit: int, next_page_token: int) -> dict[str, Any]:
    """TorchServe's list of workflows: a `limit` outside 0..100 is 100; `nextPageToken` whenever
    the page was full."""
    if not 0 <= limit <= MAX_PAGE:
        limit = MAX_PAGE
    start = max(next_page_token, 0)
    last = start + limit
    doc: dict[str, Any] = {}
    if last > len(workflows):
        last = len(workflows)
    else:
        doc["nextPageToken"] = str(last)
    doc["workflows"] = [{"workflowName": w.name, "workflowUrl": w.url} for w in workflows[start:last]]
    return doc


def describe_workflow(w: WorkflowInfo) -> list[dict[str, Any]]:
    """TorchServe's describe of one workflow (a list of one document)."""
    d = w.defaults
    return [
        {
            "workflowName": w.name,
            "workflowUrl": w.url,
            "minWorkers": d.min_workers,
            "maxWorkers": d.max_workers,
            "batchSize": d.batch_size,
            "maxBatchDelay": d.max_batch_delay_ms,
            "workflowDag": w.dag_text,
        }
    ]


def _not_allowed(what: str) -> Response:
    log.warning(
        "%s refused (405): the model API is off; start the server with --enable-model-management "
        "(torchserve's --enable-model-api, enable_model_api=true) to allow it",
        what,
    )
    return json_response(METHOD_NOT_ALLOWED, status=405)


async def _register_params(request: Request) -> dict[str, Any]:
    """The query parameters, and a JSON body's fields over them (TorchServe takes either)."""
    params = await register_params(request)
    unknown = sorted(set(params) - _REGISTER_PARAMS)
    if unknown:
        log.warning("workflow register parameter(s) %s are not TorchServe's and are ignored",
                    ", ".join(repr(u[:40]) for u in unknown[:8]))  # fmt: skip
    check_params({k: v for k, v in params.items() if k in _REGISTER_PARAMS})
    return params


def workflow_routes(plane: WorkflowPlane) -> list[Route]:
    """The routes above, for the management app."""
    guarded = make_guard("management", log, error_response)

    async def list_page(request: Request) -> Response:
        """List the workflows served, paginated."""
        q = request.query_params
        doc = list_workflows(
            plane.workflows(), _int_param(q, "limit", MAX_PAGE), _int_param(q, "next_page_token", 0)
        )
        return json_response(doc)

    def path_name(request: Request) -> str:
        name: str = request.path_params["name"]
        check_params({"workflow_name": name})  # it reaches log lines and answers
        return name

    async def describe(request: Request) -> Response:
        """Describe a workflow: its url, global values and dag."""
        return json_response(describe_workflow(plane.describe(path_name(request))))

    async def register(request: Request) -> Response:
        """Register a workflow archive of the workflow store (needs model management)."""
        if not plane.management_enabled:
            return _not_allowed("workflow registration")
        params = await _register_params(request)
        url = params.get("url")
        if not isinstance(url, str) or not url:
            raise ServingError(Code.INVALID_ARGUMENT, "Parameter url is required.")
        if is_url(url):
            message = f"Given URL {url[:200]} does not match any allowed URL(s)"
            raise ServingError(
                Code.NOT_FOUND,
                f"registering a workflow from a URL is not allowed ({url[:200]!r}): copy the archive "
                "into the workflow store and pass its file name as url",
                torchserve=TorchServeAnswer(404, "WorkflowNotFoundException", message),
            )
        name = params.get("workflow_name") or None
        if name is not None:
            name = check_model_name(str(name), "parameter workflow_name")
        timeouts = register_call_overrides(
            response_timeout=params.get("response_timeout"), startup_timeout=params.get("startup_timeout")
        )
        return json_response({"status": await plane.register(url, name=name, timeouts=timeouts)})

    async def unregister(request: Request) -> Response:
        """Stop serving a workflow and its nodes (needs model management)."""
        if not plane.management_enabled:
            return _not_allowed("workflow unregistration")
        name = path_name(request)
        await plane.unregister(name)
        return json_response({"status": f'Workflow "{name}" unregistered'})

    def route(path: str, what: str, endpoint: Callable[[Request], Awaitable[Response]], method: str) -> Route:
        return Route(path, guarded(what, endpoint), methods=[method])

    return [
        route("/workflows", "listing workflows", list_page, "GET"),
        route("/workflows", "registering a workflow", register, "POST"),
        route("/workflows/{name}", "describing a workflow", describe, "GET"),
        route("/workflows/{name}", "unregistering a workflow", unregister, "DELETE"),
    ]
