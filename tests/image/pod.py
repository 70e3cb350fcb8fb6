"""The Mariner pod as the rendered kustomize overlays describe it, checked against a built image.

The image check and the image tests read the pod from the manifests (`kubectl kustomize`), never
from a copy kept here: the command, environment, volumes, user, probes and grace period the
Deployment gives the server are the ones the image is started with and compared to. `mismatches`
lists every way a Deployment and an image disagree (a probe on a port the image does not serve, a
user the image lacks, a mount point or entrypoint that is not there); an empty list means the pod
would start the image as intended.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.image.podman import ImageMeta, inside, passwd_ids

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SERVER = "mariner"  # the server container's name in the Deployment
Obj = dict[str, Any]


def project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def built_refs() -> dict[str, str]:
    """What `make image` / `make image-gpu` tag (scripts/image_build.sh), by the base's image names."""
    v = project_version()
    return {
        "overlays/cpu": f"localhost/mariner:{v}",
        "overlays/gpu": f"localhost/mariner-gpu:{v}",
        "models": f"localhost/mariner-models:{v}",
    }


def render(rel: str) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("kubectl is not on PATH: bash scripts/ensure_kubectl.sh")
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize k8s/{rel} failed: {proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@dataclass(frozen=True)
class Pod:
    """The server pod of one overlay: its Deployment's pod spec and the ConfigMaps it can mount."""

    spec: Obj
    config_maps: dict[str, Obj]

    @classmethod
    def of(cls, objects: list[Obj]) -> Pod:
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == SERVER]
        cms = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
        return cls(deployment["spec"]["template"]["spec"], cms)

    @property
    def server(self) -> Obj:
        (c,) = [c for c in self.spec["containers"] if c["name"] == SERVER]
        return c

    @property
    def init(self) -> Obj:
        (c,) = self.spec.get("initContainers", [])
        return c

    def volume(self, name: str) -> Obj:
        (v,) = [v for v in self.spec["volumes"] if v["name"] == name]
        return v

    def user(self, container: Obj, image: ImageMeta) -> tuple[int, int, list[int]]:
        """uid, gid and supplementary groups the kubelet runs `container` with (pod and container
        securityContext over the image's USER); fsGroup is a supplementary group, as in a pod."""
        pod_sc = self.spec.get("securityContext", {})
        sc = {**pod_sc, **container.get("securityContext", {})}
        image_uid, _, image_gid = image.user.partition(":")
        uid = sc.get("runAsUser", int(image_uid) if image_uid.isdigit() else None)
        gid = sc.get("runAsGroup", int(image_gid) if image_gid.isdigit() else uid)
        if uid is None or gid is None:
            raise ValueError(f"{image.ref}: USER {image.user!r} is not numeric and the pod sets no runAsUser")
        groups = [g for g in (pod_sc.get("fsGroup"), *pod_sc.get("supplementalGroups", [])) if g is not None]
        return int(uid), int(gid), [int(g) for g in groups] or [int(gid)]

    def argv(self, container: Obj, image: ImageMeta) -> list[str]:
        """Kubernetes' rule: `command` replaces the ENTRYPOINT (and drops the CMD), `args` the CMD."""
        command = container.get("command")
        args = container.get("args")
        if command is not None:
            return [*command, *(args or [])]
        return [*image.entrypoint, *(args if args is not None else image.cmd)]

    def env(self, container: Obj, image: ImageMeta) -> dict[str, str]:
        """The image's environment with the container's on top, `resourceFieldRef`s resolved."""
        out = image.env_dict()
        for e in container.get("env", []):
            if "value" in e:
                out[e["name"]] = str(e["value"])
                continue
            ref = e.get("valueFrom", {}).get("resourceFieldRef")
            if ref is None:
                raise ValueError(f"env {e['name']}: only values and resourceFieldRef are emulated")
            owner = next(
                c for c in self._all_containers() if c["name"] == ref.get("containerName", container["name"])
            )
            kind, _, resource = ref["resource"].partition(".")
            quantity = owner.get("resources", {}).get(kind, {}).get(resource)
            if quantity is None:
                raise ValueError(f"env {e['name']}: {ref['resource']} is not set on {owner['name']}")
            divisor = _cpu(str(ref.get("divisor", "1")))
            out[e["name"]] = str(math.ceil(_cpu(str(quantity)) / divisor))  # the kubelet rounds up
        return out

    def _all_containers(self) -> list[Obj]:
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]

    def config_file(self, path: str) -> str:
        """The text of a file the server container reads from a mounted ConfigMap."""
        parent, name = str(Path(path).parent), Path(path).name
        mount = next(m for m in self.server["volumeMounts"] if m["mountPath"].rstrip("/") == parent)
        cm = self.config_maps[self.volume(mount["name"])["configMap"]["name"]]
        return cm["data"][name]

    def container_port(self, port: int | str, container: Obj | None = None) -> int:
        c = container or self.server
        if isinstance(port, int):
            return port
        (found,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == port]
        return found

    def probe_ports(self) -> dict[str, int]:
        out = {}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = self.server.get(probe)
            if spec is None:
                continue
            action = spec.get("httpGet") or spec.get("grpc") or spec.get("tcpSocket")
            if action is None:
                raise ValueError(f"{probe}: only httpGet, grpc and tcpSocket probes are checked")
            out[probe] = self.container_port(action["port"])
        return out


def _cpu(quantity: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", quantity)
    if m is None:
        raise ValueError(f"CPU quantity {quantity!r} not understood")
    return float(m[1]) / (1000 if m[2] else 1)


def config_ports(config_text: str) -> dict[int, str]:
    """Port -> the config key (`*_address`) that binds it, from the server's config file."""
    cfg = yaml.safe_load(config_text) or {}
    return {
        int(str(v).rpartition(":")[2]): k for k, v in cfg.items() if k.endswith("_address") and ":" in str(v)
    }


def _executable(root: Path, path_env: str, name: str) -> Path | None:
    candidates = [name] if "/" in name else [f"{d}/{name}" for d in path_env.split(":") if d]
    for c in candidates:
        found = inside(root, c)
        if found.is_file() and found.stat().st_mode & 0o111:
            return Path(c)
    return None


def mismatches(pod: Pod, image: ImageMeta, root: Path) -> list[str]:
    """Every way the Deployment's server container and the image (metadata and filesystem) disagree."""
    problems: list[str] = []
    c = pod.server
    uid, gid, _ = pod.user(c, image)
    uids, gids = passwd_ids(root)
    if uid == 0:
        problems.append("the pod runs the server as root")
    if uid not in uids:
        problems.append(f"runAsUser {uid} is not a user of the image (/etc/passwd has {sorted(uids)})")
    if gid not in gids:
        problems.append(f"runAsGroup {gid} is not a group of the image (/etc/group has {sorted(gids)})")
    if image.user and image.user.split(":")[0] != str(uid):
        problems.append(f"the image's USER {image.user} is not the pod's runAsUser {uid}")

    env = pod.env(c, image)
    config_path = env.get("MARINER_CONFIG_FILE")
    if config_path is None:
        problems.append("the server gets no MARINER_CONFIG_FILE")
        return problems
    if image.env_dict().get("MARINER_CONFIG_FILE") != config_path:
        problems.append(
            f"the image reads {image.env_dict().get('MARINER_CONFIG_FILE')}, the pod {config_path}"
        )
    served = config_ports(pod.config_file(config_path))
    declared = {p["containerPort"] for p in c.get("ports", [])}
    for port in sorted(declared - image.exposed_ports):
        problems.append(f"containerPort {port} is not EXPOSEd by the image ({sorted(image.exposed_ports)})")
    for port in sorted(declared - served.keys()):
        problems.append(f"containerPort {port} is not bound by the server's config ({sorted(served)})")
    for probe, port in pod.probe_ports().items():
        if port not in image.exposed_ports or port not in served:
            problems.append(f"{probe} asks port {port}, which the image does not serve")

    argv = pod.argv(c, image)
    if argv[:2] != ["mariner", "serve"] and not (
        argv and argv[0].endswith("/mariner") and argv[1:2] == ["serve"]
    ):
        problems.append(f"the server starts {argv}, not `mariner serve`")
    if argv and _executable(root, env.get("PATH", ""), argv[0]) is None:
        problems.append(f"{argv[0]} is not an executable on the image's PATH")
    if not inside(root, image.working_dir).is_dir():
        problems.append(f"WorkingDir {image.working_dir} does not exist in the image")

    for m in c.get("volumeMounts", []):
        if not inside(root, m["mountPath"]).is_dir() and m["mountPath"] not in image.volumes:
            problems.append(f"volumeMount {m['mountPath']} is not a directory in the image")
    cfg = yaml.safe_load(pod.config_file(config_path)) or {}
    mounted = {m["mountPath"].rstrip("/") for m in c.get("volumeMounts", [])}
    if "model_store" in cfg and str(cfg["model_store"]).rstrip("/") not in mounted:
        problems.append(f"model_store {cfg['model_store']} is not a mounted volume")
    # The work dir is the server's own private directory inside a mounted volume (or the volume).
    if "work_dir" in cfg and not any(Path(m) in (Path(cfg["work_dir"]), *Path(cfg["work_dir"]).parents)
                                     for m in mounted):  # fmt: skip
        problems.append(f"work_dir {cfg['work_dir']} is not in a mounted volume")
    for key in ("inference_token_file", "management_token_file"):
        if key in cfg and str(Path(cfg[key]).parent) not in mounted:
            problems.append(f"{key} {cfg[key]} is not in a mounted volume")
    return problems
