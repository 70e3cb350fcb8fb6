"""Workflow archives (.war): opened and checked like a .mar before anything registers; a bad one
is refused (400) naming what is wrong, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import yaml

from mariner.server.contracts.errors import Code, ServingError, torchserve_answer
from mariner.server.contracts.workflow_dag import MAX_NODES
from mariner.server.supervisor.workflow_archive import function_node_archive, open_workflow
from mariner.server.supervisor.workflow_spec import java_text

pytestmark = pytest.mark.unit

HANDLER = """\
import json


def pre(data, context):
    return data


def post(data, context):
    return data


if True:
    def guarded(data, context):
        return data
"""
SPEC = {
    "models": {"min-workers": 1, "max-workers": 2, "batch-size": 8, "m1": {"url": "m.mar", "batch-size": 4}},
    "dag": {"pre": ["m1"], "m1": ["post"]},
}


def make_war(
    path: Path,
    spec: object = SPEC,
    *,
    handler: str | None = HANDLER,
    manifest: dict | None = None,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """A .war laid out as torch-workflow-archiver writes one."""
    text = spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False)
    workflow = {"workflowName": "wf", "specFile": "wf.yaml"}
    if handler is not None:
        workflow["handler"] = "wf_handler.py"
    doc = manifest or {"createdOn": "01/01/2025", "archiverVersion": "0.2.15", "workflow": workflow}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("WAR-INF/MANIFEST.json", json.dumps(doc))
        zf.writestr("wf.yaml", text)
        if handler is not None:
            zf.writestr("wf_handler.py", handler)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return path


@pytest.fixture
def store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    (store / "m.mar").write_bytes(b"")
    (store / "n.mar").write_bytes(b"")
    return store


def open_war(war: Path, store: Path, work: Path, **kw: object) -> object:
    return open_workflow(war, work, url=war.name, model_store=store, **kw)  # type: ignore[arg-type]


def refusal(war: Path, store: Path, work: Path, **kw: object) -> ServingError:
    with pytest.raises(ServingError) as info:
        open_war(war, store, work, **kw)
    err = info.value
    assert err.code is Code.INVALID_ARGUMENT
    assert torchserve_answer(err).status == 400
    # a refused archive leaves no unpacked directory behind
    assert not work.exists() or list(work.iterdir()) == []
    return err


# -- a good archive ------------------------------------------------------------------------------
def test_a_workflow_is_read_with_its_nodes_in_running_order_and_torchserve_s_values(
    tmp_path: Path, store: Path
) -> None:
    war = open_workflow(make_war(tmp_path / "wf.war"), tmp_path / "work", url="wf.war", model_store=store)
    assert war.name == "wf"
    assert [n.name for n in war.nodes] == ["pre", "m1", "post"]
    assert [n.model for n in war.dag.nodes] == ["wf__pre", "wf__m1", "wf__post"]
    m1 = war.nodes[1]
    assert m1.url == "m.mar"
    # the model's own batch size over the global one; the global workers; TorchServe's defaults
    assert (m1.settings.batch_size, m1.settings.max_workers, m1.settings.max_batch_delay_ms) == (4, 2, 50)
    assert (m1.settings.retry_attempts, m1.settings.timeout_ms) == (1, 10_000)
    pre = war.nodes[0]
    assert pre.function
    # a function node: batch size 1, one worker, no delay (TorchServe's WorkflowModel for it)
    assert (pre.settings.batch_size, pre.settings.max_workers, pre.settings.max_batch_delay_ms) == (1, 1, 0)
    assert war.spec.dag_text == "{pre=[m1], m1=[post]}"  # TorchServe's describe shows it so
    assert war.dag.leaves() == ("post",)


def test_the_register_s_workflow_name_replaces_the_manifest_s(tmp_path: Path, store: Path) -> None:
    war = open_war(make_war(tmp_path / "wf.war"), store, tmp_path / "work", name_override="other")
    assert war.name == "other"  # type: ignore[attr-defined]
    assert war.dag.start.model == "other__pre"  # type: ignore[attr-defined]


def test_a_function_node_is_a_model_archive_of_hard_links_whose_handler_names_the_function(
    tmp_path: Path, store: Path
) -> None:
    war = open_workflow(make_war(tmp_path / "wf.war"), tmp_path / "work", url="wf.war", model_store=store)
    archive = function_node_archive(war, war.nodes[0], tmp_path / "work")
    assert (archive.name, archive.version, archive.handler) == ("wf__pre", "1.0", "wf_handler.py:pre")
    copied = archive.model_dir / "wf_handler.py"
    assert copied.read_text() == HANDLER
    assert os.stat(copied).st_ino == os.stat(war.workflow_dir / "wf_handler.py").st_ino  # no byte copied
    assert archive.model_dir != war.workflow_dir  # its own directory: unregistering it removes only it


def test_a_function_bound_inside_a_top_level_block_counts(tmp_path: Path, store: Path) -> None:
    spec = {"dag": {"pre": ["guarded"]}}
    war = open_war(make_war(tmp_path / "wf.war", spec), store, tmp_path / "work")
    assert [n.name for n in war.nodes] == ["pre", "guarded"]  # type: ignore[attr-defined]


# -- the graph -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dag", "why"),
    [
        ({"pre": ["m1"], "m1": ["post"], "post": ["m1"]}, "cycle through m1, post"),
        ({"pre": ["pre"]}, "node pre feeds itself"),
        ({"pre": ["m1"], "post": ["m1"]}, "exactly one start node"),
    ],
)
def test_a_graph_with_a_cycle_or_several_start_nodes_is_refused(
    tmp_path: Path, store: Path, dag: dict, why: str
) -> None:
    war = make_war(tmp_path / "wf.war", {"models": SPEC["models"], "dag": dag})
    err = refusal(war, store, tmp_path / "work")
    assert why in err.message
    assert torchserve_answer(err).type == "InvalidDAGException"


def test_a_node_that_is_neither_a_model_nor_a_function_of_the_handler_is_refused(
    tmp_path: Path, store: Path
) -> None:
    war = make_war(tmp_path / "wf.war", {"models": SPEC["models"], "dag": {"pre": ["m1"], "m1": ["nowhere"]}})
    err = refusal(war, store, tmp_path / "work")
    assert "nowhere" in err.message
    assert "neither models of models: nor functions of the handler wf_handler.py" in err.message
    assert torchserve_answer(err).type == "InvalidWorkflowException"


def test_function_nodes_without_a_handler_are_refused(tmp_path: Path, store: Path) -> None:
    err = refusal(make_war(tmp_path / "wf.war", handler=None), store, tmp_path / "work")
    assert "has no handler" in err.message


def test_a_handler_that_is_not_python_is_refused(tmp_path: Path, store: Path) -> None:
    err = refusal(make_war(tmp_path / "wf.war", handler="def pre(:\n"), store, tmp_path / "work")
    assert "not valid Python" in err.message


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("../outside.mar", "'..' is not allowed"),
        ("/etc/passwd", "outside the model store"),
        ("https://example.com/m.mar", "from a URL is not allowed"),
        ("missing.mar", "not found in the model store"),
    ],
)
def test_a_model_url_outside_the_model_store_is_refused(
    tmp_path: Path, store: Path, url: str, why: str
) -> None:
    spec = {"models": {"m1": {"url": url}}, "dag": {"pre": ["m1"]}}
    err = refusal(make_war(tmp_path / "wf.war", spec), store, tmp_path / "work")
    assert "model m1" in err.message
    assert why in err.message


@pytest.mark.parametrize(
    ("models", "why"),
    [
        ({"batch-size": "eight", "m1": {"url": "m.mar"}}, "batch-size is 'eight'"),
        ({"m1": {"url": "m.mar", "retry-attempts": 11}}, "retry-attempts is 11"),
        ({"m1": {"url": "m.mar", "max-workers": 0}}, "max-workers is 0"),
        ({"m1": {"batch-size": 2}}, "model m1 has no url"),
        ({"m1": "m.mar"}, "models.m1 must be a model"),
    ],
)
def test_bad_values_are_refused_naming_the_key_and_what_is_allowed(
    tmp_path: Path, store: Path, models: dict, why: str
) -> None:
    err = refusal(
        make_war(tmp_path / "wf.war", {"models": models, "dag": {"pre": ["m1"]}}), store, tmp_path / "work"
    )
    assert why in err.message


@pytest.mark.parametrize("name", ["a/b", "../x", "has space", 7])
def test_node_names_that_cannot_name_a_model_are_refused(tmp_path: Path, store: Path, name: object) -> None:
    err = refusal(make_war(tmp_path / "wf.war", {"dag": {"pre": [name]}}), store, tmp_path / "work")
    assert "not allowed" in err.message or "must be a" in err.message


def test_more_nodes_than_the_cap_are_refused(tmp_path: Path, store: Path) -> None:
    names = [f"f{i}" for i in range(MAX_NODES + 1)]
    handler = "".join(f"def {n}(data, context):\n    return data\n" for n in names)
    spec = {"dag": {"f0": names[1:]}}
    err = refusal(make_war(tmp_path / "wf.war", spec, handler=handler), store, tmp_path / "work")
    assert f"at most {MAX_NODES}" in err.message


def test_a_dag_with_far_more_keys_than_the_cap_is_refused_while_it_is_read(
    tmp_path: Path, store: Path
) -> None:
    # Untrusted input: thousands of dag keys must be refused by the node cap, with its message.
    spec = {"dag": {f"f{i}": [] for i in range(50 * MAX_NODES)}}
    err = refusal(make_war(tmp_path / "wf.war", spec, handler=None), store, tmp_path / "work")
    # refused on the first node past the cap, not after reading all 50 * MAX_NODES keys
    assert f"the dag has {MAX_NODES + 1} nodes; at most {MAX_NODES} are allowed" in err.message


# -- the archive and its files ----------------------------------------------------------------
def test_a_specification_with_an_alias_is_refused(tmp_path: Path, store: Path) -> None:
    spec = "models:\n  base: &b {url: m.mar}\n  m1: *b\ndag:\n  pre: [m1]\n"
    err = refusal(make_war(tmp_path / "wf.war", spec), store, tmp_path / "work")
    assert "alias" in err.message


def test_an_oversized_specification_is_refused(tmp_path: Path, store: Path) -> None:
    spec = "dag:\n  pre: [post]\n# " + "x" * (1 << 20) + "\n"
    err = refusal(make_war(tmp_path / "wf.war", spec), store, tmp_path / "work")
    assert "over the limit" in err.message


def test_an_archive_with_too_many_members_is_refused_before_unpacking(tmp_path: Path, store: Path) -> None:
    extra = {f"extra/{i}.txt": b"x" for i in range(1_001)}
    err = refusal(make_war(tmp_path / "wf.war", extra=extra), store, tmp_path / "work")
    assert "members" in err.message


def test_a_member_escaping_the_archive_is_refused(tmp_path: Path, store: Path) -> None:
    err = refusal(make_war(tmp_path / "wf.war", extra={"../evil.py": b"x"}), store, tmp_path / "work")
    assert "escapes the archive" in err.message


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        ({"workflow": {"workflowName": "wf"}}, "names no specFile"),
        ({"workflow": {"workflowName": "wf", "specFile": "../wf.yaml"}}, "points outside the archive"),
        ({"workflow": {"specFile": "wf.yaml"}}, "no workflow name"),
        ({"workflow": {"workflowName": "a/b", "specFile": "wf.yaml"}}, "workflow name"),
        ({"workflow": "wf"}, '"workflow" object'),
        ({"workflow": {"workflowName": "wf", "specFile": "wf.yaml", "handler": "sub/h.py"}}, "top level"),
    ],
)
def test_a_bad_manifest_is_refused(tmp_path: Path, store: Path, manifest: dict, why: str) -> None:
    err = refusal(make_war(tmp_path / "wf.war", manifest=manifest), store, tmp_path / "work")
    assert why in err.message


def test_something_that_is_not_a_zip_is_refused(tmp_path: Path, store: Path) -> None:
    war = tmp_path / "wf.war"
    war.write_bytes(b"not a zip at all")
    err = refusal(war, store, tmp_path / "work")
    assert "workflow archive wf.war refused" in err.message


def test_java_text_writes_the_dag_as_torchserve_s_describe() -> None:
    assert java_text({"a": ["b", "c"], "b": None, "c": [1, True]}) == "{a=[b, c], b=null, c=[1, true]}"


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("directory", "Is a directory"),  # os.fdopen refuses it before the regular-file check
        ("fifo", "not a regular file; a workflow archive is a .war file"),
    ],
)
def test_a_workflow_archive_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, store: Path, kind: str, why: str
) -> None:
    # Unpacked by the model archive's own unpack_file; a .war is never a directory.
    war = tmp_path / "wf.war"
    if kind == "directory":
        war.mkdir()
        (war / "WAR-INF").mkdir()
        (war / "WAR-INF" / "MANIFEST.json").write_text("{}")
    else:
        os.mkfifo(war)
    err = refusal(war, store, tmp_path / "work")
    assert err.message.startswith("workflow archive wf.war refused: ")
    assert why in err.message
