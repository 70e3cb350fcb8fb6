"""TorchServe's workflow inference API on the inference port: `POST /wfpredict/{workflow}`.

The body is decoded as for `/predictions` (JSON, text, bytes, form fields: `forms.decode_data`)
and handed to the workflow's start node with the request's headers; the frontend then runs the
graph (`frontend.workflow_runner`), each node a prediction of the model it is served as, through the
one call path (`frontend.protocols.call.run_call`: counted, timed and labelled under that model, as
TorchServe counts each node's job). Answers, as TorchServe's `WorkflowManager.predict`:

- one leaf node: its output bytes, 200, `application/json` unless its handler set a type;
- several leaves: a JSON object of each leaf's output parsed as JSON, by node name (TorchServe
  requires each to be a JSON object; any JSON value is taken here);
- a node that failed on its last try: 500 `InternalServerException` "Error executing <node>",
  here with the tries and the reason after it;
- an unknown workflow: 404 `WorkflowNotFoundException` "Workflow not found: <name>".

Differences, on purpose: a node whose handler answers the request with an error status of its
own (`set_response_status(400)`) ends the workflow with that answer (TorchServe feeds the error
body to the next node as if it were data); an empty body is refused (400) as on `/predictions`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mariner.server.common.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADERS,
    JSON,
    error_response,
    json_response,
    offload_if_large,
    read_body,
    request_headers,
)
from mariner.server.common.request_ids import new_request_id
from mariner.server.compat.torchserve.forms import decode_data
from mariner.server.contracts.errors import Code, Refused, ServingError, TorchServeAnswer
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.contracts.workflow_dag import WorkflowNode, WorkflowTable
from mariner.server.frontend.protocols.call import CANCELLED_STATUS, CallPlane, Infer, Ok, run_call
from mariner.server.frontend.protocols.http_call import infer_unless_client_gone
from mariner.server.frontend.protocols.torchserve.answer_check import sendable
from mariner.server.frontend.workflow_runner import NodeAnswered, NodeFailed, run_workflow

if TYPE_CHECKING:
    from collections.abc import Mapping

_PROTOCOL = WireProtocol.TS_HTTP


def _answer(result: InferResult, request_id: str, status: int | None = None) -> Response:
    if status is not None:
        result = replace(result, status=status)
    result = sendable(result, request_id)
    headers = {"x-request-id": request_id, "content-type": result.content_type or JSON}
    return Response(result.body, result.status, headers)


def _leaves(workflow: str, leaves: list[tuple[str, InferResult]], request_id: str) -> Response:
    if len(leaves) == 1:
        return _answer(leaves[0][1], request_id, 200)
    doc: dict[str, Any] = {}
    for name, result in leaves:
        try:
            doc[name] = json.loads(result.body)
        except ValueError:
            message = (
                f"workflow {workflow}: leaf node {name} answered something that is not JSON; a workflow "
                "with several leaf nodes answers a JSON object of their JSON outputs"
            )
            return error_response(
                ServingError(
                    Code.INTERNAL,
                    message,
                    torchserve=TorchServeAnswer(500, "InternalServerException", message),
                )
            )
    return json_response(doc)


class WorkflowPredictions:
    """`/wfpredict/{workflow}` over the frontend's DataPlane and its table of workflows."""

    def __init__(
        self, dataplane: CallPlane, workflows: WorkflowTable, *, max_body_bytes: int, max_headers: int
    ) -> None:
        self._plane = dataplane
        self._workflows = workflows
        self._max_body_bytes = max_body_bytes
        self._max_headers = max_headers

    async def _data(self, request: Request) -> dict[str, Any]:
        body = await read_body(request, self._max_body_bytes)
        if not body:
            raise ServingError(
                Code.INVALID_ARGUMENT, "empty body: send the workflow's input as the request body"
            )
        data: dict[str, Any] = await offload_if_large(
            len(body), decode_data, request.headers.get("content-type", ""), body
        )
        return data

    async def answer(self, request: Request, workflow: str) -> Response:
        request_id = new_request_id()
        plane = self._plane
        try:
            dag = self._workflows.get(workflow)
            data = await self._data(request)
        except Refused as exc:  # a body over the limit: 413 before it is read
            return error_response(exc.error, status=exc.http_status, headers={"x-request-id": request_id})
        except ServingError as exc:
            return error_response(exc, headers={"x-request-id": request_id})
        headers = request_headers(request, self._max_headers)

        def gone_aware(req: InferRequest) -> Any:
            return infer_unless_client_gone(plane, req, request.scope, request.receive)

        async def call(node: WorkflowNode, node_data: Mapping[str, Any], deadline: float) -> InferResult:
            async def work(infer: Infer) -> InferResult:
                req = InferRequest(
                    model=node.model,
                    version=None,
                    data=node_data,
                    protocol=_PROTOCOL,
                    request_id=new_request_id(),
                    headers=headers,
                    deadline=deadline,
                )
                return await infer(req)

            outcome = await run_call(
                plane, _PROTOCOL, node.model, None, work, infer=gone_aware, what="running a workflow node"
            )
            if isinstance(outcome, Ok):
                return outcome.value
            if outcome.answer is not None:
                raise NodeAnswered(node.name, outcome.answer)
            raise outcome.error

        try:
            leaves = await run_workflow(dag, data, call)
        except NodeAnswered as exc:
            return _answer(exc.result, request_id)
        except NodeFailed as exc:
            error = exc.serving_error(workflow)
            if error.code is Code.CANCELLED:
                return Response(status_code=CANCELLED_STATUS)  # nobody reads it
            return error_response(error, headers={"x-request-id": request_id})
        return _leaves(workflow, leaves, request_id)


def routes(
    dataplane: CallPlane,
    workflows: WorkflowTable,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> list[Route]:
    """TorchServe's workflow inference route, `POST|PUT /wfpredict/{workflow}`."""
    predictions = WorkflowPredictions(
        dataplane, workflows, max_body_bytes=max_body_bytes, max_headers=max_headers
    )

    async def wfpredict(request: Request) -> Response:
        """Run a workflow's graph for the request body; answer its leaf nodes' outputs."""
        return await predictions.answer(request, request.path_params["workflow"])

    return [Route("/wfpredict/{workflow}", wfpredict, methods=["POST", "PUT"])]
