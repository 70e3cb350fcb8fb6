"""A built image as the tests see it: its metadata, its filesystem, and a way to start its content.

`podman run` cannot start containers on the build machines (the OCI runtime trips over the cgroup
setup), so an image is started the way its runtime would, by hand: `podman create` + `podman mount`
give the image's root filesystem; a private mount namespace (`unshare --mount`) gets the pod's
volumes bound in and the root remounted read-only (as `readOnlyRootFilesystem` does); `chroot
--userspec` drops to the pod's user before the entrypoint runs. Every exec replaces the previous
program, so the process the caller holds is the server itself and SIGTERM reaches it directly. The
mount namespace dies with its last process, so no mount outlives the run; the container is unmounted
and removed on exit from `mounted()` whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def podman() -> str | None:
    return shutil.which("podman")


def _podman(*args: str, timeout: float = 120) -> str:
    exe = podman()
    if exe is None:
        raise RuntimeError("podman is not installed: apt-get install podman")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


def image_exists(ref: str) -> bool:
    exe = podman()
    if exe is None:
        return False
    return subprocess.run([exe, "image", "exists", ref], capture_output=True, check=False).returncode == 0


def require_image(ref: str, make_target: str) -> None:
    """Skip (under pytest) when the image was not built: these checks are about a built image."""
    if podman() is None:
        pytest.skip(f"podman is not installed, so image {ref} cannot have been built (`make {make_target}`)")
    if not image_exists(ref):
        pytest.skip(
            f"image {ref} is not built: run `make {make_target}` (CI builds it before `make image-test`)"
        )


@dataclass(frozen=True)
class ImageMeta:
    """What the container runtime takes from an image's config (`podman image inspect`)."""

    ref: str
    user: str
    env: tuple[tuple[str, str], ...]
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    working_dir: str
    exposed_ports: frozenset[int]  # TCP only
    volumes: frozenset[str]
    size_bytes: int

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    @classmethod
    def inspect(cls, ref: str) -> ImageMeta:
        (data,) = json.loads(_podman("image", "inspect", ref))
        config: dict[str, Any] = data.get("Config") or {}
        env = tuple(tuple(e.split("=", 1)) for e in config.get("Env") or [] if "=" in e)
        ports = frozenset(
            int(p.split("/")[0]) for p in config.get("ExposedPorts") or {} if p.endswith("/tcp")
        )
        return cls(
            ref=ref,
            user=config.get("User") or "",
            env=env,  # type: ignore[arg-type]
            entrypoint=tuple(config.get("Entrypoint") or ()),
            cmd=tuple(config.get("Cmd") or ()),
            working_dir=config.get("WorkingDir") or "/",
            exposed_ports=ports,
            volumes=frozenset(config.get("Volumes") or {}),
            size_bytes=int(data.get("Size") or 0),
        )


@contextmanager
def mounted(ref: str) -> Iterator[Path]:
    """The image's root filesystem (a fresh container's, so writes never reach the image)."""
    container = _podman("create", ref)
    try:
        root = Path(_podman("mount", container))
        try:
            yield root
        finally:
            _podman("unmount", container)
    finally:
        _podman("rm", "--force", container)


def inside(root: Path, path: str) -> Path:
    """`path` in the image rooted at `root`, symlinks resolved within the image (Debian's /var/run is
    a link to /run: followed on the host, it would lead out of the image and into the host's /run)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    current = root
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = current.parent if current != root else root
            continue
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise OSError(f"too many symlinks resolving {path} in {root}")
            target = str(candidate.readlink())
            if target.startswith("/"):
                current = root
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        current = candidate
    return current


def passwd_ids(root: Path) -> tuple[set[int], set[int]]:
    """uids in the image's /etc/passwd and gids in its /etc/group."""

    def ids(name: str, field: int) -> set[int]:
        path = inside(root, f"/etc/{name}")
        if not path.is_file():
            return set()
        out = set()
        for line in path.read_text().splitlines():
            parts = line.split(":")
            if len(parts) > field and parts[field].isdigit():
                out.add(int(parts[field]))
        return out

    return ids("passwd", 2), ids("group", 2)


def processes_in(root: Path) -> list[int]:
    """Processes whose root directory is `root`: everything started in the image, including model
    workers, which run in sessions of their own (a process group would miss them)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(root):
                    out.append(int(entry.name))
            except OSError:  # exited meanwhile, or a kernel thread
                continue
    return out


def kill_all_in(root: Path) -> None:
    for pid in processes_in(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass(frozen=True)
class Bind:
    """A host directory bound at `target` inside the image (a pod volume)."""

    source: Path
    target: str
    read_only: bool


def chroot_argv(
    root: Path,
    binds: Sequence[Bind],
    *,
    uid: int,
    gid: int,
    groups: Sequence[int],
    env: Mapping[str, str],
    workdir: str,
    argv: Sequence[str],
    read_only_root: bool,
) -> list[str]:
    """The command line that starts `argv` in the image as the pod would (see the module docstring)."""
    r = shlex.quote(str(root))
    steps = ["set -e"]
    for b in binds:
        target = shlex.quote(str(inside(root, b.target)))
        steps.append(f"mkdir -p {target}")  # the runtime creates missing mount points too
        steps.append(f"mount --bind {shlex.quote(str(b.source))} {target}")
        if b.read_only:
            steps.append(f"mount -o remount,bind,ro {target}")
    steps += [
        f"mount -t proc proc {r}/proc",
        f"mount --rbind /dev {r}/dev",
        f"mount --rbind /sys {r}/sys",
    ]
    if read_only_root:
        steps.append(f"mount -o remount,bind,ro {r}")
    supplementary = ",".join(str(g) for g in groups) or str(gid)
    env_words = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    steps.append(
        f"exec chroot --userspec={uid}:{gid} --groups={supplementary} {r} "
        f"/usr/bin/env -i -C {shlex.quote(workdir)} {env_words} {shlex.join(argv)}"
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(steps)]
