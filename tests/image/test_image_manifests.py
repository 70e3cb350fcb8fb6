"""The kustomize overlays against the images `make image` / `make image-gpu` built.

A Deployment that names a probe port the image does not serve, a user the image lacks, a mount point
or entrypoint that is not in it, starts nothing on a cluster, and no amount of linting the files
separately shows it. These tests read the image's own metadata (`podman image inspect`: User,
ExposedPorts, Entrypoint/Cmd, Env, WorkingDir, Volumes) and its filesystem (/etc/passwd, PATH) and
compare them with the rendered overlays (tests/image/pod.py). They skip only when the image is not
built, and say so; `make image-test` (in CI) builds the images first, so there they run.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.image.pod import Pod, built_refs, mismatches, project_version, render
from tests.image.podman import Bind, ImageMeta, chroot_argv, inside, mounted, require_image

pytestmark = pytest.mark.image

OVERLAYS = ("overlays/cpu", "overlays/gpu")
MAKE_TARGET = {"overlays/cpu": "image", "overlays/gpu": "image-gpu"}
# The CPU image's size budget: torch's CPU wheel alone is about 700 MB installed.
CPU_IMAGE_MAX_BYTES = 1_500_000_000


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def pods() -> dict[str, Pod]:
    return {rel: Pod.of(render(rel)) for rel in OVERLAYS}


def test_overlays_name_the_images_make_builds(pods: dict[str, Pod]) -> None:
    """The references `make image` tags are the ones the overlays deploy (no image needed)."""
    refs = built_refs()
    assert refs["overlays/cpu"].endswith(f":{project_version()}")
    for rel, pod in pods.items():
        assert pod.server["image"] == refs[rel], f"k8s/{rel}"
        assert pod.init["image"] == refs["models"], f"k8s/{rel}: the initContainer's model image"


def test_deployment_fits_the_image(pods: dict[str, Pod], overlay: str) -> None:
    pod = pods[overlay]
    ref = pod.server["image"]
    require_image(ref, MAKE_TARGET[overlay])
    meta = ImageMeta.inspect(ref)
    with mounted(ref) as root:
        assert mismatches(pod, meta, root) == []
    # What mismatches() relies on, stated plainly for the reader of a failure.
    assert meta.entrypoint[:2] == ("mariner", "serve")
    assert meta.user == "10001:10001"


def test_a_deployment_that_does_not_fit_is_caught(pods: dict[str, Pod]) -> None:
    """The comparison can fail: a probe on a port the image does not serve, a user the image lacks,
    a mount point it lacks and a command it cannot run are each reported."""
    pod = pods["overlays/cpu"]
    ref = pod.server["image"]
    require_image(ref, "image")
    spec = copy.deepcopy(pod.spec)
    spec["securityContext"]["runAsUser"] = 4242
    (server,) = [c for c in spec["containers"] if c["name"] == "mariner"]
    server["readinessProbe"] = {"grpc": {"port": 9090}}
    server["volumeMounts"].append({"name": "tmp", "mountPath": "/srv/not-in-image"})
    server["command"] = ["mariner-nope", "serve"]
    broken = Pod(spec, pod.config_maps)
    meta = ImageMeta.inspect(ref)
    with mounted(ref) as root:
        problems = "\n".join(mismatches(broken, meta, root))
    assert "runAsUser 4242 is not a user of the image" in problems
    assert "readinessProbe asks port 9090, which the image does not serve" in problems
    assert "volumeMount /srv/not-in-image is not a directory in the image" in problems
    assert "mariner-nope is not an executable on the image's PATH" in problems
    assert "not `mariner serve`" in problems


def test_model_image_feeds_the_init_container(pods: dict[str, Pod]) -> None:
    """The model image holds the archive the config serves and the index pin_index checks, where the
    initContainer copies from, and has the `cp` its command runs."""
    pod = pods["overlays/cpu"]
    ref = pod.init["image"]
    require_image(ref, "image")
    config = yaml.safe_load(pod.config_file("/etc/mariner/mariner.yaml"))
    source = pod.init["command"][-2].removesuffix("/.")
    meta = ImageMeta.inspect(ref)
    with mounted(ref) as root:
        store = inside(root, source)
        assert (store / "index.json").is_file()
        for name in str(config["models"]).split(","):
            archive = store / name.strip()
            assert archive.is_file(), f"{ref} lacks {archive.name}"
            assert archive.stat().st_mode & 0o004, f"{archive.name} is not readable by the pod's user"
        path = meta.env_dict().get("PATH", "/usr/bin:/bin")
        assert any(inside(root, f"{d}/{pod.init['command'][0]}").is_file() for d in path.split(":"))


def test_cpu_image_is_small() -> None:
    ref = built_refs()["overlays/cpu"]
    require_image(ref, "image")
    size = ImageMeta.inspect(ref).size_bytes
    assert size < CPU_IMAGE_MAX_BYTES, f"{ref} is {size / 1e6:.0f} MB"


def _run_in_image(ref: str, argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    meta = ImageMeta.inspect(ref)
    env = {**meta.env_dict(), "HOME": "/tmp"}
    with mounted(ref) as root:
        command = chroot_argv(
            root, [], uid=10001, gid=10001, groups=[10001], env=env, workdir=meta.working_dir, argv=argv,
            read_only_root=True,
        )  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    ("rel", "modules", "distributions"),
    [
        ("overlays/cpu", "onnxruntime, mariner.server.cli, torch", ("onnxruntime",)),
        ("overlays/gpu", "onnxruntime, pynvml, mariner.server.cli", ("onnxruntime-gpu", "nvidia-ml-py")),
    ],
)
def test_serving_packages_import_as_the_pod_user(
    rel: str, modules: str, distributions: tuple[str, ...], tmp_path: Path
) -> None:
    """The GPU image has onnxruntime's CUDA build in place of the CPU one (never both) and NVML; both
    images import the server as uid 10001 on a read-only root. (The GPU image runs for real only on
    a GPU node; here its imports are what can be proven.)"""
    ref = built_refs()[rel]
    require_image(ref, MAKE_TARGET[rel])
    script = (
        f"import {modules}; from importlib import metadata as m; "
        "print(' '.join(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    )
    proc = _run_in_image(ref, ["python3", "-c", script], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    installed = set(proc.stdout.split())
    assert set(distributions) <= installed, sorted(installed)
    other = "onnxruntime" if rel == "overlays/gpu" else "onnxruntime-gpu"
    assert other not in installed
    assert not {"pip", "wheel", "grpcio-tools", "pytest"} & installed, (
        "build or test tools in the runtime image"
    )


# What a worker does before it imports a handler, then what users' handlers import: TorchServe's
# BaseHandler and vision built-ins (torchvision, captum), and torchvision's nms.
_TS_HANDLERS = """
import os, torch, ts
from mariner.server.worker.torchvision_ops import ensure_torchvision_importable
ensure_torchvision_importable()
from ts.torch_handler.base_handler import BaseHandler
from ts.torch_handler.image_classifier import ImageClassifier
from ts.torch_handler.object_detector import ObjectDetector
from ts.utils.util import PredictionException
import torchvision.ops
boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
print(torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist())
print(os.path.exists(os.path.join(os.path.dirname(ts.__file__), "frontend", "model-server.jar")))
"""


@pytest.mark.parametrize("rel", OVERLAYS)
def test_torchserve_handlers_import_as_the_pod_user(rel: str, tmp_path: Path) -> None:
    """Users' handlers import `ts` (and the vision built-ins torchvision): the images carry them,
    without TorchServe's Java frontend, which Mariner never runs (scripts/image_trim.sh)."""
    ref = built_refs()[rel]
    require_image(ref, MAKE_TARGET[rel])
    # torch._dynamo (which torchvision.ops imports) needs a writable temp dir: the pod's /tmp emptyDir.
    tmp_path.chmod(0o1777)
    meta = ImageMeta.inspect(ref)
    with mounted(ref) as root:
        command = chroot_argv(
            root, [Bind(tmp_path, "/tmp", read_only=False)], uid=10001, gid=10001, groups=[10001],
            env={**meta.env_dict(), "HOME": "/tmp"}, workdir=meta.working_dir,
            argv=["python3", "-c", _TS_HANDLERS], read_only_root=True,
        )  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["[0, 2]", "False"], proc.stdout


@pytest.mark.parametrize("rel", OVERLAYS)
def test_runtime_image_has_no_build_tools(rel: str) -> None:
    """No compiler in the built image (its filesystem, not only its Dockerfile's text): nothing can
    be compiled at run time, so the `compiled` (torch.compile) variant is not served from it."""
    ref = built_refs()[rel]
    require_image(ref, MAKE_TARGET[rel])
    meta = ImageMeta.inspect(ref)
    tools = ("cc", "gcc", "g++", "c++", "clang", "make", "cmake", "ninja", "ld", "as", "pip", "pip3")
    with mounted(ref) as root:
        found = [
            f"{d}/{tool}"
            for d in meta.env_dict()["PATH"].split(":")
            for tool in tools
            if inside(root, f"{d}/{tool}").exists()
        ]
    assert found == [], f"{ref} carries build tools: {found}"
