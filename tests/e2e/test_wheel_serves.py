"""A wheel built from a fresh clone serves: the build generates the gRPC stubs itself.

A fresh clone has no `server/_proto/` (stubs are build products, git-ignored). `pip install .`
used to succeed and `mariner serve` then fail with "gRPC stubs are not generated". This builds a
wheel the way pip does for `pip install .` or `pip install git+...` (build isolation: the build
requirements of pyproject.toml, grpcio-tools among them, in a throwaway environment) from a copy
of the sources without stubs, installs it into a virtualenv of its own and serves an archive
over HTTP and gRPC with the `mariner` script the wheel installed.

The virtualenv gets the wheel alone; its dependencies (torch and the rest, the same pinned
versions) are reached through a .pth line naming this environment's site-packages, whose own
editable `mariner` is not activated that way (a .pth line adds a path; it does not run the .pth
files found there), and the test checks that `mariner` is imported from the wheel.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import grpc
import pytest
import requests

from mariner.server import protogen
from tests.e2e.serve_process import REPO, ServeProcess

pytestmark = pytest.mark.e2e

FOLDERS: tuple[str, ...] = ast.literal_eval(
    re.search(r"^FOLDERS = (\(.*?\))$", (REPO / "setup.py").read_text(), re.MULTILINE)[1]  # type: ignore[index]
)
STUBS = (
    "mariner/server/_proto/torchserve/inference_pb2.py",
    "mariner/server/_proto/torchserve/inference_pb2_grpc.py",
    "mariner/server/_proto/inference/grpc_service_pb2.py",
)
BODY = json.dumps([4.0] * 64).encode()


def fresh_clone(dest: Path) -> Path:
    """The files a clone has, without the stubs or any other build product."""
    skip = shutil.ignore_patterns("_proto", "__pycache__", "*.pyc", "*.egg-info", "build")
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy2(REPO / name, dest / name)
    for folder in ("proto", *FOLDERS):
        shutil.copytree(REPO / folder, dest / folder, ignore=skip)
    assert not (dest / "server" / "_proto").exists()
    return dest


def run(cmd: list[str], cwd: Path, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{cmd}: {proc.stderr[-3000:]}"
    return proc.stdout


def test_a_wheel_built_from_a_fresh_clone_carries_its_stubs_and_serves(
    tmp_path: Path, model_store: Path
) -> None:
    src = fresh_clone(tmp_path / "src")
    out = tmp_path / "wheel"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), "."], src)
    (wheel,) = out.glob("mariner-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert set(STUBS) <= names, sorted(n for n in names if "_proto" in n)

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, timeout=120)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], tmp_path)
    (purelib,) = (venv / "lib").glob("python3.*/site-packages")
    (purelib / "_mariner_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = run(
        [str(python), "-c", "import mariner.server._proto.torchserve as m; print(m.__file__)"], tmp_path
    )
    assert Path(where.strip()).is_relative_to(venv), where

    server = ServeProcess(
        model_store,
        "digits=digits_torchscript.mar",
        tmp_path / "serve.log",
        launcher=[str(venv / "bin" / "mariner")],
        cwd=tmp_path,
    )
    try:
        server.wait_ready()
        r = requests.post(
            f"{server.url()}/predictions/digits",
            data=BODY,
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        protogen.generate()
        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        with grpc.insecure_channel(server.target()) as channel:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            answer = stub.Predictions(
                inference_pb2.PredictionsRequest(model_name="digits", input={"data": BODY}), timeout=30
            )
        assert json.loads(answer.prediction) == r.json()
    finally:
        server.kill()
