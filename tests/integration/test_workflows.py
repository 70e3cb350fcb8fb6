"""TorchServe workflows (.war) on a real `mariner serve`: register from the workflow store, run
through `/wfpredict`, list, describe, unregister, and the answers of failing nodes.

The workflows are built here as torch-workflow-archiver lays them out: function nodes in the
archive's handler, and a model node on the tests' fault-injection archive (`fault_archive`),
which echoes a JSON request and fails on command. The main one is a diamond, so a node fed by
several others and two nodes running side by side are exercised:

    pre -> m1 (faulty.mar) -> join
    pre -> side ------------> join

One server for the module: the tests only send requests (each unregisters what it registers).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.integration.fault_archive import build_fault_archive, write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

HANDLER = """
import json


def _text(row):
    body = row.get("data") or row.get("body")
    return body.decode() if isinstance(body, (bytes, bytearray)) else body


def pre(data, context):
    if not data:  # TorchServe initialises a function entry point with handle(None, context)
        return None
    text = _text(data[0])
    if text == "boom":
        raise RuntimeError("pre failed on purpose")
    op = {"raise": "raise_batch", "bad": "bad_item"}.get(text, "ok")
    return [json.dumps({"op": op, "value": text})]


def side(data, context):
    if not data:
        return None
    return [{"side": json.loads(bytes(data[0]["body"]))["value"].upper()}]


def join(data, context):
    if not data:
        return None
    row = data[0]
    return [{
        "parents": sorted(row),
        "echo": json.loads(bytes(row["m1"]))["echo"],
        "side": json.loads(bytes(row["side"]))["side"],
        "trace": context.get_request_header(0, "x-trace"),
    }]


def tail(data, context):
    if not data:
        return None
    return [{"tail": len(bytes(data[0]["body"]))}]
"""
FLOW = {
    "models": {"retry-attempts": 2, "max-batch-delay": 0, "m1": {"url": "faulty.mar", "batch-size": 2}},
    "dag": {"pre": ["m1", "side"], "m1": ["join"], "side": ["join"]},
}
BROKEN_HANDLER = "raise ImportError('this handler cannot load')\n"


def write_war(path: Path, name: str, spec: dict[str, Any]) -> Path:
    """A .war as torch-workflow-archiver writes it."""
    manifest = {
        "createdOn": "01/01/2025 00:00:00",
        "workflow": {"workflowName": name, "specFile": f"{name}.yaml", "handler": f"{name}_handler.py"},
        "archiverVersion": "0.2.15",
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("WAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr(f"{name}.yaml", yaml.safe_dump(spec, sort_keys=False))
        zf.writestr(f"{name}_handler.py", HANDLER)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("workflows")
    models, workflows = root / "models", root / "workflows"
    workflows.mkdir()
    build_fault_archive(models, name="faulty", response_timeout_s=60)
    write_handler_archive(
        models / "broken.mar", "broken", "broken.py", {"broken.py": BROKEN_HANDLER, "model-config.yaml": ""}
    )
    write_war(workflows / "flow.war", "flow", FLOW)
    write_war(workflows / "fork.war", "fork", {"dag": {"pre": ["side", "tail"]}})
    write_war(
        workflows / "cycle.war", "cycle", {"dag": {"pre": ["side"], "side": ["tail"], "tail": ["side"]}}
    )
    broken = {"models": {"bad": {"url": "broken.mar"}}, "dag": {"pre": ["bad"]}}
    write_war(workflows / "halfway.war", "halfway", broken)
    return models, workflows


@pytest.fixture(scope="module")
def server(stores: tuple[Path, Path]) -> Iterator[MarinerServe]:
    models, workflows = stores
    srv = MarinerServe(models, "", enable_model_management=True, workflow_store=workflows).start()
    try:
        r = register(srv, url="flow.war", workflow_name="diamond")
        assert (r.status_code, r.json()) == (
            200,
            {"status": "Workflow diamond has been registered and scaled successfully."},
        ), r.text
        yield srv
    finally:
        srv.stop()


def register(srv: MarinerServe, **params: str) -> requests.Response:
    return requests.post(f"{srv.management}/workflows", params=params, timeout=300)


def predict(srv: MarinerServe, workflow: str, text: str, **headers: str) -> requests.Response:
    headers = {"Content-Type": "text/plain", **headers}
    return requests.post(f"{srv.http}/wfpredict/{workflow}", data=text, headers=headers, timeout=120)


def models(srv: MarinerServe) -> list[str]:
    return srv.served_models()


def test_each_node_is_served_as_a_model_named_after_the_workflow(server: MarinerServe) -> None:
    assert {"diamond__pre", "diamond__m1", "diamond__side", "diamond__join"} <= set(models(server))
    (m1,) = requests.get(f"{server.management}/models/diamond__m1", timeout=30).json()
    assert (m1["batchSize"], m1["maxBatchDelay"], m1["modelUrl"]) == (2, 0, "faulty.mar")  # the spec's values
    (pre,) = requests.get(f"{server.management}/models/diamond__pre", timeout=30).json()
    assert (pre["batchSize"], pre["minWorkers"], pre["mariner"]["handler"]) == (1, 1, "flow_handler.py:pre")
    # its function runs in a worker process of its own, not in the server's
    assert len(pre["workers"]) == 1
    assert pre["workers"][0]["pid"] not in (server.supervisor_pid, *server.frontend_pids())


def test_a_prediction_runs_the_graph_and_answers_the_leaf_s_output(server: MarinerServe) -> None:
    r = predict(server, "diamond", "hello", **{"X-Trace": "t-1"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    # join was fed by m1 and side (each output under its parent's name), every node the headers
    assert r.json() == {"parents": ["m1", "side"], "echo": "hello", "side": "HELLO", "trace": "t-1"}


def test_list_and_describe_answer_torchserve_s_documents(server: MarinerServe) -> None:
    listed = requests.get(f"{server.management}/workflows", timeout=30).json()
    assert {"workflowName": "diamond", "workflowUrl": "flow.war"} in listed["workflows"]
    r = requests.get(f"{server.management}/workflows/diamond", timeout=30)
    assert r.status_code == 200
    assert r.json() == [
        {
            "workflowName": "diamond",
            "workflowUrl": "flow.war",
            "minWorkers": 1,
            "maxWorkers": 1,
            "batchSize": 1,
            "maxBatchDelay": 0,
            "workflowDag": "{pre=[m1, side], m1=[join], side=[join]}",
        }
    ]


def test_an_unknown_workflow_is_torchserve_s_404(server: MarinerServe) -> None:
    for r in (
        predict(server, "nope", "x"),
        requests.get(f"{server.management}/workflows/nope", timeout=30),
        requests.delete(f"{server.management}/workflows/nope", timeout=30),
    ):
        assert r.status_code == 404
        assert r.json() == {
            "code": 404,
            "type": "WorkflowNotFoundException",
            "message": "Workflow not found: nope",
        }


def test_a_model_node_failing_every_try_answers_500_naming_it(server: MarinerServe) -> None:
    r = predict(server, "diamond", "raise")
    assert r.status_code == 500
    body = r.json()
    assert body["type"] == "InternalServerException"
    # TorchServe's "Error executing <node>", then the tries (1 + retry-attempts 2) and the reason
    assert body["message"] == "Error executing m1 (3 tries; the last: Prediction failed)"
    assert predict(server, "diamond", "again").status_code == 200  # the workflow goes on serving


def test_a_function_node_that_raises_answers_500_naming_it(server: MarinerServe) -> None:
    r = predict(server, "diamond", "boom")
    assert r.status_code == 500
    assert r.json()["message"].startswith("Error executing pre (3 tries")


def test_a_node_s_own_error_status_is_the_answer(server: MarinerServe) -> None:
    r = predict(server, "diamond", "bad")
    assert r.status_code == 400
    assert r.json() == {"error": "injected bad item"}


def test_registering_a_name_twice_is_a_conflict(server: MarinerServe) -> None:
    r = register(server, url="flow.war", workflow_name="diamond")
    assert (r.status_code, r.json()["message"]) == (409, "Workflow diamond is already registered.")


def test_a_graph_with_a_cycle_is_refused_and_registers_nothing(server: MarinerServe) -> None:
    before = models(server)
    r = register(server, url="cycle.war")
    assert r.status_code == 400
    assert r.json()["type"] == "InvalidDAGException"
    assert "cycle through side, tail" in r.json()["message"]
    assert models(server) == before


def test_an_archive_missing_from_the_workflow_store_is_404(server: MarinerServe) -> None:
    for url in ("missing.war", "../models/faulty.mar"):
        r = register(server, url=url)
        assert (r.status_code, r.json()["type"]) == (404, "WorkflowNotFoundException")


def test_a_node_that_fails_to_start_fails_the_register_and_leaves_nothing(server: MarinerServe) -> None:
    before = models(server)
    r = register(server, url="halfway.war")
    assert r.status_code == 500
    body = r.json()
    assert body["type"] == "WorkflowException"
    assert body["message"].startswith(
        "Workflow halfway has failed to register. Failures: [Workflow Node halfway__bad"
    )
    assert models(server) == before  # its function node, registered fine, was taken back
    assert requests.get(f"{server.management}/workflows/halfway", timeout=30).status_code == 404


def test_several_leaves_answer_an_object_and_unregister_removes_every_node(server: MarinerServe) -> None:
    assert register(server, url="fork.war").status_code == 200
    try:
        r = predict(server, "fork", "hi")
        assert r.status_code == 200, r.text
        assert r.json() == {"side": {"side": "HI"}, "tail": {"tail": len('{"op": "ok", "value": "hi"}')}}
    finally:
        gone = requests.delete(f"{server.management}/workflows/fork", timeout=120)
    assert (gone.status_code, gone.json()) == (200, {"status": 'Workflow "fork" unregistered'})
    assert not [m for m in models(server) if m.startswith("fork__")]
    assert predict(server, "fork", "hi").status_code == 404
    names = [
        w["workflowName"]
        for w in requests.get(f"{server.management}/workflows", timeout=30).json()["workflows"]
    ]
    assert names == ["diamond"]
