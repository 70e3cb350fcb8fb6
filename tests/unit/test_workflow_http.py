"""TorchServe's workflow management routes (supervisor.management.workflow_http) over a fake registry: the
parameters read as TorchServe reads them, its answers' shapes, and the model API's gate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from mariner.server.common.http_common import make_app
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.contracts.workflow_dag import WorkflowNode, build_dag, workflow_not_found
from mariner.server.supervisor.management.workflow_http import workflow_routes
from mariner.server.supervisor.workflow_spec import NodeSettings, WorkflowInfo
from tests.unit.fakes import serve

pytestmark = pytest.mark.unit


def info(name: str) -> WorkflowInfo:
    dag = build_dag(name, [WorkflowNode("pre", f"{name}__pre", True, 1, 10_000)], {})
    return WorkflowInfo(name, f"{name}.war", NodeSettings(batch_size=8), dag, "{pre=null}")


class FakeWorkflows:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.management_enabled = True
        self.known = {n: info(n) for n in ("c", "a", "b")}
        self.registered: list[tuple[str, str | None, SettingsOverrides | None]] = []
        self.unregistered: list[str] = []

    def workflows(self) -> list[WorkflowInfo]:
        return [self.known[n] for n in sorted(self.known)]

    def describe(self, name: str) -> WorkflowInfo:
        if name not in self.known:
            raise workflow_not_found(name)
        return self.known[name]

    async def register(
        self, url: str, *, name: str | None = None, timeouts: SettingsOverrides | None = None
    ) -> str:
        self.registered.append((url, name, timeouts))
        return f"Workflow {name or 'x'} has been registered and scaled successfully."

    async def unregister(self, name: str) -> None:
        self.describe(name)
        self.unregistered.append(name)


@pytest.fixture(scope="module")
def shared() -> FakeWorkflows:
    return FakeWorkflows()


@pytest.fixture
def plane(shared: FakeWorkflows) -> FakeWorkflows:
    shared.reset()  # each test starts from the same state
    return shared


@pytest.fixture(scope="module")
def url(shared: FakeWorkflows) -> Iterator[str]:
    """One server for the module: the tests only send requests (the fake is reset per test)."""
    with serve(make_app(workflow_routes(shared))) as base:
        yield base


def test_list_is_sorted_and_paginated_as_torchserve_s(url: str, plane: FakeWorkflows) -> None:
    page = requests.get(f"{url}/workflows?limit=2", timeout=10).json()
    assert page == {
        "nextPageToken": "2",
        "workflows": [
            {"workflowName": "a", "workflowUrl": "a.war"},
            {"workflowName": "b", "workflowUrl": "b.war"},
        ],
    }
    rest = requests.get(f"{url}/workflows?limit=2&next_page_token=2", timeout=10).json()
    assert rest == {"workflows": [{"workflowName": "c", "workflowUrl": "c.war"}]}
    # a limit that is not a number is TorchServe's default
    assert len(requests.get(f"{url}/workflows?limit=x", timeout=10).json()["workflows"]) == 3


def test_describe_answers_torchserve_s_document(url: str, plane: FakeWorkflows) -> None:
    r = requests.get(f"{url}/workflows/a", timeout=10)
    assert r.status_code == 200
    assert r.json() == [
        {
            "workflowName": "a",
            "workflowUrl": "a.war",
            "minWorkers": 1,
            "maxWorkers": 1,
            "batchSize": 8,
            "maxBatchDelay": 50,
            "workflowDag": "{pre=null}",
        }
    ]
    missing = requests.get(f"{url}/workflows/nope", timeout=10)
    assert missing.status_code == 404
    assert missing.json() == {
        "code": 404,
        "type": "WorkflowNotFoundException",
        "message": "Workflow not found: nope",
    }


def test_register_reads_query_or_json_parameters(url: str, plane: FakeWorkflows) -> None:
    r = requests.post(f"{url}/workflows?url=wf.war&workflow_name=wf&response_timeout=30", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "Workflow wf has been registered and scaled successfully."}
    body = {"url": "other.war", "startup_timeout": "nan", "unknown": 1}
    assert requests.post(f"{url}/workflows", json=body, timeout=10).status_code == 200
    (u1, n1, t1), (u2, n2, t2) = plane.registered
    assert (u1, n1, t1) == ("wf.war", "wf", SettingsOverrides(response_timeout_s=30))
    assert (u2, n2, t2) == ("other.war", None, SettingsOverrides())  # "nan" is not given, as in TorchServe


@pytest.mark.parametrize(
    ("query", "status", "kind"),
    [
        ("", 400, "BadRequestException"),
        ("?url=https://example.com/wf.war", 404, "WorkflowNotFoundException"),
        ("?url=wf.war&workflow_name=a/b", 400, "BadRequestException"),
        ("?url=wf%0a.war", 400, "BadRequestException"),
    ],
)
def test_register_refuses_bad_parameters(
    url: str, plane: FakeWorkflows, query: str, status: int, kind: str
) -> None:
    r = requests.post(f"{url}/workflows{query}", timeout=10)
    assert (r.status_code, r.json()["type"]) == (status, kind)
    assert plane.registered == []


def test_unregister_answers_torchserve_s_status(url: str, plane: FakeWorkflows) -> None:
    r = requests.delete(f"{url}/workflows/b", timeout=10)
    assert (r.status_code, r.json()) == (200, {"status": 'Workflow "b" unregistered'})
    assert requests.delete(f"{url}/workflows/nope", timeout=10).status_code == 404
    assert plane.unregistered == ["b"]


def test_register_and_unregister_need_model_management(url: str, plane: FakeWorkflows) -> None:
    plane.management_enabled = False
    for r in (
        requests.post(f"{url}/workflows?url=wf.war", timeout=10),
        requests.delete(f"{url}/workflows/a", timeout=10),
    ):
        assert r.status_code == 405
        assert r.json()["type"] == "MethodNotAllowedException"
    assert (plane.registered, plane.unregistered) == ([], [])
    assert requests.get(f"{url}/workflows", timeout=10).status_code == 200  # reading is allowed


def test_other_methods_are_not_allowed(url: str, plane: FakeWorkflows) -> None:
    assert requests.put(f"{url}/workflows/a", timeout=10).status_code == 405
