"""Open and check a TorchServe workflow archive (`.war`, torch-workflow-archiver's zip).

A `.war` holds `WAR-INF/MANIFEST.json` (`workflow.workflowName`, `workflow.specFile`, optionally
`workflow.handler`: a .py file of functions) and those files. It is code the server will run and
a graph it will serve, so it is checked before anything starts, the way a .mar is (`archive`):

* it is a regular file of the workflow store, unpacked with the member checks of every archive
  (`archive_formats`: no absolute or `..` member, no symlink, member count and bytes capped on
  what it declares and on what it writes), under tighter caps (`WAR_LIMITS`), into a private
  directory;
* the manifest is a JSON object whose files resolve inside the archive; the specification is
  read by the bounded YAML loader (`safe_yaml`: no aliases, size, depth and node caps) and
  checked value by value (`workflow_spec`), its graph by `workflow_dag` (node count, no cycle,
  one start node);
* every model node's `url` names an archive of the model store (never a URL, `..` or a path
  elsewhere), and every function node's name is bound at the top level of the handler, read
  as a syntax tree (`ast`, never imported: archive code runs only in worker processes).

A refusal is 400 `InvalidWorkflowException` (or `InvalidDAGException`) naming the archive, the
field and what is allowed; TorchServe answers most of these with a 500. This runs in a thread of
the supervisor, never on its event loop.

Each function node is served as a model of its own (TorchServe's `<workflow>__<node>` with the
handler `<file>.py:<function>`), and each model version owns its directory (unregistering one
removes it), so `function_node_archive` gives each one a copy of the unpacked workflow made of
hard links: no byte is copied.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mariner.server.common.archive import ModelArchive, resolve_in_store, unpack_file
from mariner.server.common.archive_fields import check_handler, inside
from mariner.server.common.archive_formats import ArchiveLimits
from mariner.server.common.safe_yaml import YamlRefused, load_yaml
from mariner.server.contracts.errors import ServingError
from mariner.server.contracts.names import check_model_name
from mariner.server.contracts.workflow_dag import WorkflowDag, WorkflowNode, build_dag, node_model_name
from mariner.server.supervisor.workflow_spec import (
    NodeSettings,
    NodeSpec,
    WorkflowSpec,
    parse_spec,
    workflow_refused,
)

__all__ = ["WAR_LIMITS", "WorkflowArchive", "function_node_archive", "open_workflow"]

WAR_MANIFEST = "WAR-INF/MANIFEST.json"
# A workflow carries a specification, a handler and a few extra files; its models are archives
# of the model store. Far tighter than a model archive's caps.
WAR_LIMITS = ArchiveLimits(max_members=1_000, max_unpacked_bytes=256 << 20)
MAX_MANIFEST_BYTES = 1 << 20
MAX_SPEC_BYTES = 1 << 20
MAX_HANDLER_BYTES = 4 << 20
# The version every node is served under (TorchServe's for a workflow's models and functions).
NODE_VERSION = "1.0"


@dataclass(frozen=True)
class WorkflowArchive:
    """An unpacked, checked workflow: what its manifest and specification say, and its graph."""

    name: str
    url: str  # as the register call named it (list and describe show it)
    path: Path
    sha256: str
    workflow_dir: Path
    manifest: dict[str, Any]
    handler: str | None  # the handler file's name in the archive
    spec: WorkflowSpec
    dag: WorkflowDag

    @property
    def defaults(self) -> NodeSettings:
        return self.spec.defaults

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        """The nodes in running order (the start node first)."""
        by_name = {n.name: n for n in self.spec.nodes}
        return tuple(by_name[n.name] for n in self.dag.nodes)


def _unpack(path: Path, dest: Path) -> str:
    """Unpack the regular file `path` into `dest` and return its sha256 (hashed from the very
    bytes unpacked), through the model archive's own `unpack_file` so both kinds take the same
    care; a workflow has no digest pin, its caps are `WAR_LIMITS`, and a directory is refused
    (a workflow archive is only ever a .war file)."""
    return unpack_file(
        path,
        dest,
        WAR_LIMITS,
        None,
        not_regular="not a regular file; a workflow archive is a .war file (a zip)",
    )


def _read(where: str, path: Path | None, what: str, limit: int) -> bytes:
    if path is None or not path.is_file():
        raise workflow_refused(f"{where}: {what} is missing from the archive")
    if path.stat().st_size > limit:
        raise workflow_refused(f"{where}: {what} is over the limit of {limit} bytes")
    return path.read_bytes()


def _manifest(where: str, root: Path) -> dict[str, Any]:
    raw = _read(where, root / WAR_MANIFEST, WAR_MANIFEST, MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise workflow_refused(f"{where}: {WAR_MANIFEST} is not JSON text ({exc})") from None
    workflow = manifest.get("workflow") if isinstance(manifest, dict) else None
    if not isinstance(workflow, dict):
        raise workflow_refused(f'{where}: {WAR_MANIFEST} must be a JSON object with a "workflow" object')
    for key in ("workflowName", "specFile", "handler"):
        if workflow.get(key) is not None and not isinstance(workflow[key], str):
            raise workflow_refused(f"{where}: manifest field workflow.{key} must be a string")
    if not workflow.get("specFile"):
        raise workflow_refused(f"{where}: the manifest names no specFile (workflow.specFile)")
    return manifest


def _file(where: str, root: Path, key: str, relative: str) -> Path:
    found = inside(root, relative)
    if found is None:
        raise workflow_refused(
            f"{where}: manifest field workflow.{key} {relative!r} points outside the archive; it must "
            "be a relative path inside it"
        )
    return found


def _top_level_names(source: bytes, where: str) -> set[str] | None:
    """The names a module binds at its top level (functions, classes, assignments, imports,
    also inside top-level if/try/with blocks); None when a star import makes that unknowable."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise workflow_refused(
            f"{where}: the handler is not valid Python ({type(exc).__name__}: {exc})"
        ) from None
    names: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return names


def _check_functions(where: str, root: Path, handler: str | None, spec: WorkflowSpec) -> None:
    functions = [n.name for n in spec.nodes if n.function]
    if not functions:
        return
    if handler is None:
        raise workflow_refused(
            f"{where}: the dag names {', '.join(functions)}, which are not models of models: and the "
            "archive has no handler to hold them as functions"
        )
    source = _read(where, _file(where, root, "handler", handler), f"handler {handler}", MAX_HANDLER_BYTES)
    bound = _top_level_names(source, f"{where}: {handler}")
    missing = [f for f in functions if bound is not None and f not in bound]
    if missing:
        raise workflow_refused(
            f"{where}: the dag names {', '.join(missing)}, which are neither models of models: nor "
            f"functions of the handler {handler}"
        )


def _dag(name: str, spec: WorkflowSpec) -> WorkflowDag:
    nodes = [
        WorkflowNode(
            n.name,
            node_model_name(name, n.name),
            n.function,
            n.settings.retry_attempts,
            n.settings.timeout_ms,
        )
        for n in spec.nodes
    ]
    return build_dag(name, nodes, spec.edges)


def _check_models(where: str, spec: WorkflowSpec, model_store: Path) -> None:
    for node in spec.nodes:
        if node.url is None:
            continue
        try:
            resolve_in_store(model_store, node.url)
        except ServingError as exc:
            raise workflow_refused(f"{where}: model {node.name}: {exc.message}") from None


def open_workflow(
    path: Path, work_root: Path, *, url: str, model_store: Path, name_override: str | None = None
) -> WorkflowArchive:
    """Check and unpack the workflow archive `path` into a private directory under `work_root`
    (removed again when it is refused); `name_override` is register's `workflow_name`."""
    where = f"workflow archive {path.name}"
    work_root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="workflow-", dir=work_root))
    try:
        try:
            digest = _unpack(path, root)
        except (zipfile.BadZipFile, ValueError, OSError) as exc:
            raise workflow_refused(f"{where} refused: {exc}") from None
        manifest = _manifest(where, root)
        workflow = manifest["workflow"]
        name = name_override or workflow.get("workflowName")
        if not name:
            raise workflow_refused(f"{where}: no workflow name: give workflow_name or workflow.workflowName")
        name = check_model_name(name, f"{where}: workflow name")
        spec_file = workflow["specFile"]
        raw = _read(where, _file(where, root, "specFile", spec_file), f"specFile {spec_file}", MAX_SPEC_BYTES)
        try:
            doc = load_yaml(raw, max_bytes=MAX_SPEC_BYTES)
        except YamlRefused as exc:
            raise workflow_refused(f"{where}: {spec_file} {exc}") from None
        spec = parse_spec(doc, f"{where}: {spec_file}", name)
        handler = workflow.get("handler") or None
        if handler is not None and (not handler.endswith(".py") or Path(handler).parent != Path(".")):
            raise workflow_refused(
                f"{where}: the handler {handler!r} must be a .py file at the archive's top level (its "
                "functions are imported by the file's name)"
            )
        _check_functions(where, root, handler, spec)
        dag = _dag(name, spec)
        _check_models(where, spec, model_store)
        return WorkflowArchive(name, url, path, digest, root, manifest, handler, spec, dag)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def function_node_archive(war: WorkflowArchive, node: NodeSpec, work_root: Path) -> ModelArchive:
    """A function node as a model archive: a hard-linked copy of the unpacked workflow and a
    manifest naming `<handler file>:<function>` (TorchServe's handler for a workflow function)."""
    if war.handler is None or not node.function:
        raise ValueError(f"node {node.name} is not a function of a handler")
    model = node_model_name(war.name, node.name)
    model_dir = Path(tempfile.mkdtemp(prefix=f"{model}-", dir=work_root))
    try:
        shutil.copytree(war.workflow_dir, model_dir, copy_function=os.link, dirs_exist_ok=True)
        handler = f"{Path(war.handler).name}:{node.name}"
        check_handler(war.path.name, model_dir, handler)
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    manifest = {
        "createdOn": war.manifest.get("createdOn"),
        "runtime": "python",
        "model": {"modelName": model, "modelVersion": NODE_VERSION, "handler": handler},
        "archiverVersion": war.manifest.get("archiverVersion"),
    }
    return ModelArchive(model, NODE_VERSION, war.path, war.sha256, model_dir, manifest)
