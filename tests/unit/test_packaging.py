"""What `pip install mariner` puts on a machine: one top-level name, and a serving-only stack.

The base dependency set must serve every archive the store builds and run the client; training,
benchmark and code-generation tools are extras (`[train]`, `[bench]`, `[protogen]`, `[dev]`).
Checked three ways: the declared sets, a static read of every import in server/ and client/,
and a subprocess that imports every serving module and runs every archive in the store with the
extras' packages made unimportable.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# The folders setup.py installs as `mariner.<folder>` (read, not imported: setup.py runs setup()).
FOLDERS: tuple[str, ...] = ast.literal_eval(
    re.search(r"^FOLDERS = (\(.*?\))$", (REPO / "setup.py").read_text(), re.MULTILINE)[1]  # type: ignore[index]
)
# Distributions a serving install must not carry: training, benchmarking, code generation.
NOT_SERVING = ("scikit-learn", "matplotlib", "torchao", "locust", "grpcio-tools", "torchvision")
# Import names of everything outside the base set that this project's environments hold. The
# subprocess below makes each unimportable, as on a machine with only the base set installed.
BLOCKED_IMPORTS = (
    "sklearn",
    "matplotlib",
    # optional (the `vision` extra): a serving install without it serves every other archive.
    "torchvision",
    "torchao",
    "locust",
    "gevent",
    "grpc_tools",
    "onnx",
    "onnxscript",
    # not tqdm: transformers (base set, for the MiniLM archives) requires it, so pip installs it
    # with any serving install.
    "model_archiver",
    "pytest",
    "hypothesis",
    "kubernetes_validate",
)
# Import name -> distribution, for the imports whose names differ from what pip installs.
IMPORT_TO_DIST = {
    "yaml": "pyyaml",
    "PIL": "pillow",
    "google": "protobuf",
    "grpc": "grpcio",
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "grpc_tools": "grpcio-tools",
    "ml_dtypes": "ml-dtypes",
    "prometheus_client": "prometheus-client",
    "sklearn": "scikit-learn",
    "ts": "torchserve",
}
# uvicorn[standard] brings these; the server prefers them when present.
EXTRA_OF_BASE = {"uvloop": "uvicorn", "httptools": "uvicorn"}
# Imports that are allowed outside the base set, each for a stated reason.
BUILD_TIME = {("server/protogen.py", "grpc_tools")}  # the stub generator: a build step, imported lazily


def _dist_name(requirement: str) -> str:
    return re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0].lower()


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def base(project: dict) -> set[str]:
    return {_dist_name(r) for r in project["dependencies"]}


def test_base_set_carries_no_training_benchmark_or_build_tools(base: set[str], project: dict) -> None:
    assert not base & set(NOT_SERVING), f"move {sorted(base & set(NOT_SERVING))} to an extra"
    extras = project["optional-dependencies"]
    assert {"train", "bench", "dev"} <= set(extras)
    train = {_dist_name(r) for r in extras["train"]}
    bench = {_dist_name(r) for r in extras["bench"]}
    assert {"scikit-learn", "torchao", "onnx", "torch-model-archiver"} <= train
    assert {"locust"} <= bench
    # Users' handlers import TorchServe's `ts`: serving carries it and what its import needs.
    assert {"torchserve", "pyyaml", "psutil", "packaging"} <= base
    # dev is everything: the Makefile installs it and `make test` needs all of it.
    assert any(r.replace(" ", "").startswith("mariner[") for r in extras["dev"]), extras["dev"]
    dev_extras = next(r for r in extras["dev"] if r.startswith("mariner["))
    # ...but the GPU image's extra: its onnxruntime-gpu must never sit beside the CPU onnxruntime.
    assert set(dev_extras[len("mariner[") : -1].split(",")) == set(extras) - {"dev", "gpu"}
    assert {_dist_name(r) for r in extras["gpu"]} >= {"onnxruntime-gpu"}


def _imports(path: Path) -> Iterator[tuple[str, bool]]:
    """(top-level module, optional) for every absolute import in `path`; optional when the import
    sits in a `try` whose handlers catch ImportError (the code runs without it)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in {"ImportError", "ModuleNotFoundError"}
            for h in node.handlers
        ):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in optional


def _serving_sources() -> list[Path]:
    return sorted(
        p
        for folder in ("server", "client", "handlers")
        for p in (REPO / folder).rglob("*.py")
        if "_proto" not in p.relative_to(REPO).parts
    )


def test_server_client_and_handler_imports_are_in_the_base_set(base: set[str]) -> None:
    stdlib = set(sys.stdlib_module_names)
    allowed = base | set(EXTRA_OF_BASE)
    outside = []
    for path in _serving_sources():
        rel = path.relative_to(REPO).as_posix()
        for module, optional in _imports(path):
            if module in stdlib or module == "mariner" or optional or (rel, module) in BUILD_TIME:
                continue
            if IMPORT_TO_DIST.get(module, module.replace("_", "-")).lower() not in allowed:
                outside.append(f"{rel}: {module}")
    assert not outside, f"imports outside the base dependency set: {outside}"
    assert len(_serving_sources()) > 20  # the walk really read the packages


# Runs in a fresh interpreter: every blocked package is made missing first, then every
# serving module is imported and every archive in the store answers one request of its family.
_BASE_ONLY = textwrap.dedent(
    """
    import importlib, importlib.abc, importlib.machinery, json, pkgutil, sys, tempfile
    from pathlib import Path

    BLOCKED = set(sys.argv[2].split(","))

    # None in sys.modules is how Python spells "not installed" for both kinds of caller: `import x`
    # raises ModuleNotFoundError, and probes (importlib.util.find_spec, which torch and
    # transformers use to look for optional packages such as psutil) get None and move on.
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    for name in BLOCKED:
        sys.modules[name] = None
    # Some libraries also read an optional package's installed metadata: hide that too.
    import importlib.metadata as md
    _distribution = md.distribution

    def hidden(name):
        if name.replace("-", "_").lower() in BLOCKED:
            raise md.PackageNotFoundError(name)
        return _distribution(name)

    md.distribution = hidden
    md.version = lambda name: hidden(name).version

    import mariner.client, mariner.handlers, mariner.server
    import ts.torch_handler.base_handler  # users' handlers subclass it: the base set carries ts
    imported = 0
    for pkg in (mariner.server, mariner.client, mariner.handlers):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(info.name)
            imported += 1

    from mariner.server.common.archive import open_archive
    from mariner.server.worker.context import Context
    from mariner.server.worker.runner import load_entry_point

    import io
    from PIL import Image

    store = Path(sys.argv[1])
    digit = [0, 0, 5, 13, 9, 1, 0, 0] + [0] * 56  # any 64 intensities in 0..16 will do
    photo = io.BytesIO()
    Image.new("RGB", (320, 240), (200, 120, 40)).save(photo, format="JPEG")
    # One request per family, and the key its answer must carry.
    requests = {
        "digits_": ({"body": json.dumps(digit).encode()}, "label"),
        "minilm_": ({"body": b"a sentence to embed"}, "embedding"),
        "resnet18_": ({"body": photo.getvalue()}, "topk"),
    }
    answered = []
    with tempfile.TemporaryDirectory() as work:
        for entry in json.loads((store / "index.json").read_text())["archives"]:
            archive = open_archive(store / entry["file"], Path(work))
            handle, initialize = load_entry_point(archive)
            ctx = Context(
                archive.name, str(archive.model_dir), archive.manifest,
                batch_size=1, gpu_id=None, model_yaml_config=archive.model_config,
            )
            initialize(ctx)
            request, key = next(r for p, r in requests.items() if entry["file"].startswith(p))
            (answer,) = handle([request], ctx)
            answer = json.loads(answer) if isinstance(answer, (str, bytes)) else answer
            assert key in answer, (entry["file"], str(answer)[:200])
            if key == "label":
                assert answer["label"] in range(10), (entry["file"], answer)
            answered.append(entry["file"])
    leaked = sorted(n for n, m in sys.modules.items() if n.split(".")[0] in BLOCKED and m is not None)
    print(json.dumps({"imported": imported, "answered": answered, "leaked": leaked}))
    """
)


# Needs the built store (`make models`), so it runs with `make test`, not `make test-unit`.
@pytest.mark.integration
def test_serving_modules_and_every_archive_work_with_only_the_base_set(model_store: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BASE_ONLY, str(model_store), ",".join(BLOCKED_IMPORTS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    index = json.loads((model_store / "index.json").read_text())
    assert result["answered"] == [e["file"] for e in index["archives"]]
    assert result["imported"] > 20
    assert result["leaked"] == []


def test_wheel_installs_only_the_mariner_package(tmp_path: Path) -> None:
    """setup.py maps the folders under `mariner.`: the wheel's only top-level name is `mariner`.

    Built from a copy of the sources, so the build leaves nothing in the working tree."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("proto", *FOLDERS):
        shutil.copytree(REPO / folder, src / folder, ignore=skip)
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            ".",
        ],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("mariner-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"mariner"}, top
    for folder in FOLDERS:
        assert any(n.startswith(f"mariner/{folder}/") for n in names), folder
    # The wheel's metadata says the same as pyproject.toml: no benchmark stack unless asked for.
    requires = [
        line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")
    ]
    unconditional = {_dist_name(r) for r in requires if "extra ==" not in r}
    assert not unconditional & set(NOT_SERVING), unconditional
    assert any(r.startswith("locust") and 'extra == "bench"' in r for r in requires), requires
