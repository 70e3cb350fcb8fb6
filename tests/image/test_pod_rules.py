"""The pod rules the image check relies on, on a fake image (no podman, no built image needed).

The image check starts a built image by these rules and the manifest-vs-image tests compare by them,
so a wrong rule would make both agree with a Deployment that a cluster would reject. Kubernetes'
rules tested here: `command`/`args` against ENTRYPOINT/CMD, `resourceFieldRef` rounding, security
context precedence; and paths inside an image resolve their symlinks inside it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.image.pod import Pod, mismatches, render
from tests.image.podman import Bind, ImageMeta, chroot_argv, inside

pytestmark = pytest.mark.unit


def _image(**overrides: object) -> ImageMeta:
    base: dict[str, object] = {
        "ref": "localhost/fake:1",
        "user": "10001:10001",
        "env": (
            ("PATH", "/opt/venv/bin:/usr/bin:/bin"),
            ("MARINER_CONFIG_FILE", "/etc/mariner/mariner.yaml"),
        ),
        "entrypoint": ("mariner", "serve"),
        "cmd": (),
        "working_dir": "/",
        "exposed_ports": frozenset({8080, 8081, 8082, 7070, 7071}),
        "volumes": frozenset(),
        "size_bytes": 0,
    }
    base.update(overrides)
    return ImageMeta(**base)  # type: ignore[arg-type]


def _fake_root(tmp_path: Path) -> Path:
    """An image filesystem with what the CPU Deployment needs, /var/run linked as in Debian."""
    root = tmp_path / "root"
    for d in ("etc/mariner", "models", "var/lib/mariner/work", "tmp", "run/secrets/mariner", "opt/venv/bin"):
        (root / d).mkdir(parents=True)
    (root / "var/run").symlink_to("/run")  # absolute: followed on the host it would leave the image
    (root / "etc/passwd").write_text(
        "root:x:0:0::/root:/bin/sh\nmariner:x:10001:10001::/nonexistent:/bin/false\n"
    )
    (root / "etc/group").write_text("root:x:0:\nmariner:x:10001:\n")
    script = root / "opt/venv/bin/mariner"
    script.write_text("#!/opt/venv/bin/python\n")
    script.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def cpu_pod() -> Pod:
    return Pod.of(render("overlays/cpu"))


def test_paths_resolve_symlinks_inside_the_image(tmp_path: Path) -> None:
    root = _fake_root(tmp_path)
    assert inside(root, "/var/run/secrets/mariner") == root / "run/secrets/mariner"
    assert inside(root, "/var/../etc/passwd") == root / "etc/passwd"
    (root / "loop").symlink_to("/loop")
    with pytest.raises(OSError, match="too many symlinks"):
        inside(root, "/loop/x")


def test_bind_targets_stay_in_the_image(tmp_path: Path) -> None:
    root = _fake_root(tmp_path)
    argv = chroot_argv(
        root, [Bind(tmp_path / "tokens", "/var/run/secrets/mariner", True)], uid=10001, gid=10001,
        groups=[10001], env={"A": "b c"}, workdir="/", argv=["mariner", "serve"], read_only_root=True,
    )  # fmt: skip
    script = argv[-1]
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert f"mount --bind {tmp_path / 'tokens'} {root / 'run/secrets/mariner'}\n" in script
    assert f"mount -o remount,bind,ro {root / 'run/secrets/mariner'}\n" in script
    assert f"mount -o remount,bind,ro {root}\n" in script
    assert script.endswith("'A=b c' mariner serve")
    assert "--userspec=10001:10001 --groups=10001" in script


def test_command_and_args_follow_kubernetes(cpu_pod: Pod) -> None:
    image = _image(entrypoint=("mariner", "serve"), cmd=("--log-level", "INFO"))
    assert cpu_pod.argv({}, image) == ["mariner", "serve", "--log-level", "INFO"]
    assert cpu_pod.argv({"args": ["--x"]}, image) == ["mariner", "serve", "--x"]
    assert cpu_pod.argv({"command": ["/bin/sh"]}, image) == ["/bin/sh"]  # CMD dropped with the entrypoint
    assert cpu_pod.argv({"command": ["a"], "args": ["b"]}, image) == ["a", "b"]


def test_cpu_limit_env_is_rounded_up_like_the_kubelet(cpu_pod: Pod) -> None:
    spec = copy.deepcopy(cpu_pod.spec)
    (server,) = [c for c in spec["containers"] if c["name"] == "mariner"]
    server["resources"]["limits"]["cpu"] = "1500m"
    env = Pod(spec, cpu_pod.config_maps).env(server, _image())
    assert env["MARINER_TORCH_THREADS"] == "2"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"  # the image's, kept under the pod's


def test_the_cpu_deployment_fits_a_matching_image(cpu_pod: Pod, tmp_path: Path) -> None:
    assert mismatches(cpu_pod, _image(), _fake_root(tmp_path)) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"exposed_ports": frozenset({8080, 8081, 8082, 7071})}, "containerPort 7070 is not EXPOSEd"),
        ({"exposed_ports": frozenset({8080, 8081, 8082, 7071})}, "readinessProbe asks port 7070"),
        ({"user": "0:0"}, "the image's USER 0:0 is not the pod's runAsUser 10001"),
        ({"entrypoint": ("python3", "-m", "http.server")}, "not `mariner serve`"),
        ({"working_dir": "/srv"}, "WorkingDir /srv does not exist"),
        ({"env": (("PATH", "/usr/bin"),)}, "the image reads None, the pod /etc/mariner/mariner.yaml"),
    ],
)
def test_an_image_that_does_not_fit_is_reported(
    cpu_pod: Pod, tmp_path: Path, change: dict[str, object], expected: str
) -> None:
    problems = "\n".join(mismatches(cpu_pod, _image(**change), _fake_root(tmp_path)))
    assert expected in problems


def test_a_missing_user_or_mount_point_is_reported(cpu_pod: Pod, tmp_path: Path) -> None:
    root = _fake_root(tmp_path)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "var/lib/mariner/work").rmdir()
    (root / "opt/venv/bin/mariner").chmod(0o644)
    problems = "\n".join(mismatches(cpu_pod, _image(), root))
    assert "runAsUser 10001 is not a user of the image" in problems
    assert "volumeMount /var/lib/mariner/work is not a directory in the image" in problems
    assert "mariner is not an executable on the image's PATH" in problems
