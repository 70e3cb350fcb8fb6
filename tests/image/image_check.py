"""Start the built CPU image the way the CPU overlay's Deployment would, and check it serves.

`make image-test` runs this after `make image`. Nothing about the pod is written here: the rendered
`k8s/overlays/cpu` gives the image reference, the command, environment, user, volumes, probes and
grace period. The initContainer fills the model-store volume from the model image first (its own
command, in its own image), then the server image's entrypoint starts from its mounted filesystem
(tests/image/podman.py) as the pod's user, on a read-only root, with the ConfigMap, emptyDirs and a
token Secret holding fresh random tokens bound where the Deployment mounts them.

One deliberate difference: the listeners bind 127.0.0.1 (the chroot shares this machine's network),
on the manifest's ports when they are free, else on free ones. The bind host is the only thing
changed, through the MARINER_*_ADDRESS variables that beat the config file.

Checked: every probe of the Deployment as the kubelet asks it (startup and liveness over HTTP,
readiness over gRPC health), `/ping`, a prediction over HTTP and over gRPC with the inference token
(401 / UNAUTHENTICATED without it), `/metrics` counting both, and SIGTERM -> exit 0 within
terminationGracePeriodSeconds less the preStop sleep. Prints the image size and start-to-ready time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.image.pod import Pod, built_refs, config_ports, mismatches, render
from tests.image.podman import (
    Bind,
    ImageMeta,
    chroot_argv,
    image_exists,
    kill_all_in,
    mounted,
    processes_in,
)

# One 8x8 digit (a 0), as the README's curl example sends it.
DIGIT_ZERO = [
    0,
    0,
    5,
    13,
    9,
    1,
    0,
    0,
    0,
    0,
    13,
    15,
    10,
    15,
    5,
    0,
    0,
    3,
    15,
    2,
    0,
    11,
    8,
    0,
    0,
    4,
    12,
    0,
    0,
    8,
    8,
    0,
]
DIGIT_ZERO += [
    0,
    5,
    8,
    0,
    0,
    9,
    8,
    0,
    0,
    4,
    11,
    0,
    1,
    12,
    7,
    0,
    0,
    2,
    14,
    5,
    10,
    12,
    0,
    0,
    0,
    0,
    6,
    13,
    10,
    0,
    0,
    0,
]
# A generous cap for model loading after the startup probe passed (readiness has no deadline in
# Kubernetes; this only stops a hung check).
READY_CAP_S = 600.0


class CheckFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"image-check: {msg}", flush=True)


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok: Callable[[], bool], proc: subprocess.Popen[bytes] | None, cap_s: float) -> float:
    """Poll `ok` until true; fail at once when the server exits. Returns the seconds it took."""
    start = time.monotonic()
    while not ok():
        if proc is not None and proc.poll() is not None:
            raise CheckFailed(f"the server exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() - start > cap_s:
            raise CheckFailed(f"{what}: not within {cap_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def http_ok(url: str) -> bool:
    try:
        return 200 <= requests.get(url, timeout=5).status_code < 400  # the kubelet's success range
    except requests.RequestException:
        return False


def grpc_serving(target: str, service: str) -> bool:
    try:
        with grpc.insecure_channel(target) as ch:
            answer = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
    except grpc.RpcError:
        return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


def fill_volumes(pod: Pod, work: Path, uid: int, gid: int, tokens: dict[str, str]) -> dict[str, Path]:
    """A host directory per pod volume, filled as the kubelet would (ConfigMap files, Secret files
    0440 owned by the fsGroup, empty emptyDirs writable by the pod's group)."""
    fs_group = pod.spec.get("securityContext", {}).get("fsGroup", gid)
    out: dict[str, Path] = {}
    for v in pod.spec["volumes"]:
        d = work / "volumes" / v["name"]
        d.mkdir(parents=True)
        if "configMap" in v:
            for name, text in pod.config_maps[v["configMap"]["name"]]["data"].items():
                (d / name).write_text(text)
            os.chmod(d, 0o755)
        elif "secret" in v:
            mode = v["secret"].get("defaultMode", 0o644)
            for item in v["secret"].get("items") or [{"key": k, "path": k} for k in tokens]:
                f = d / item["path"]
                f.write_text(tokens[item["key"]] + "\n")
                os.chown(f, 0, fs_group)
                os.chmod(f, item.get("mode", mode))
            os.chmod(d, 0o755)
        elif "emptyDir" in v:
            os.chown(d, uid, fs_group)
            os.chmod(d, 0o2775)
        else:
            raise CheckFailed(f"volume {v['name']}: only configMap, secret and emptyDir are emulated")
        out[v["name"]] = d
    return out


def binds(container: dict, volumes: dict[str, Path]) -> list[Bind]:
    return [
        Bind(volumes[m["name"]], m["mountPath"], bool(m.get("readOnly")))
        for m in container.get("volumeMounts", [])
    ]


def run_init(pod: Pod, volumes: dict[str, Path], work: Path) -> None:
    init = pod.init
    meta = ImageMeta.inspect(init["image"])
    uid, gid, groups = pod.user(init, meta)
    with mounted(init["image"]) as root:
        argv = chroot_argv(
            root, binds(init, volumes), uid=uid, gid=gid, groups=groups, env=pod.env(init, meta),
            workdir=meta.working_dir, argv=pod.argv(init, meta),
            read_only_root=bool(init.get("securityContext", {}).get("readOnlyRootFilesystem")),
        )  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise CheckFailed(f"initContainer {init['name']} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    log(f"initContainer {init['name']}: {' '.join(init['command'])} -> ok")


@contextlib.contextmanager
def server_in(root: Path, command: list[str], server_log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run the image's server; when the check fails, kill everything in the image and print the
    end of its log (the reason is usually there)."""
    with server_log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        except BaseException:
            kill_all_in(root)
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            sys.stdout.write(server_log.read_text()[-6000:])
            raise


def check(overlay: str) -> None:
    pod = Pod.of(render(overlay))
    server = pod.server
    ref = server["image"]
    want = built_refs()[overlay]
    if ref != want:
        raise CheckFailed(f"k8s/{overlay} names image {ref}, but `make image` builds {want}")
    for image in (ref, pod.init["image"]):
        if not image_exists(image):
            raise CheckFailed(f"image {image} is not built: run `make image`")
    meta = ImageMeta.inspect(ref)
    log(f"{ref}: {meta.size_bytes / 1e6:.0f} MB, USER {meta.user}, ENTRYPOINT {list(meta.entrypoint)}")
    uid, gid, groups = pod.user(server, meta)
    env = pod.env(server, meta)
    config_text = pod.config_file(env["MARINER_CONFIG_FILE"])
    by_port = config_ports(config_text)
    ports = {p: p for p in by_port}
    if not all(free(p) for p in ports):
        ports = {p: free_port() for p in by_port}
    for port, key in by_port.items():
        env[f"MARINER_{key.upper()}"] = f"127.0.0.1:{ports[port]}"
    log(f"listeners on 127.0.0.1, ports {ports} (manifest -> here)")

    tokens = {"inference": secrets.token_hex(16), "management": secrets.token_hex(16)}
    grace = pod.spec.get("terminationGracePeriodSeconds", 30)
    pre_stop = server.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    with tempfile.TemporaryDirectory(prefix="mariner-image-check-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        volumes = fill_volumes(pod, work, uid, gid, tokens)
        run_init(pod, volumes, work)
        with mounted(ref) as root:
            problems = mismatches(pod, meta, root)
            if problems:
                raise CheckFailed("the Deployment does not fit the image:\n  " + "\n  ".join(problems))
            argv = chroot_argv(
                root, binds(server, volumes), uid=uid, gid=gid, groups=groups, env=env,
                workdir=meta.working_dir, argv=pod.argv(server, meta),
                read_only_root=bool(server.get("securityContext", {}).get("readOnlyRootFilesystem")),
            )  # fmt: skip
            log(f"starting {pod.argv(server, meta)} as {uid}:{gid} (groups {groups}), read-only root")
            with server_in(root, argv, work / "server.log") as proc:
                serve(pod, proc, root, ports, tokens, grace - pre_stop)
                # SIGTERM ends the whole pod: no frontend or model worker outlives the server.
                wait_for("every process of the image to exit", lambda: not processes_in(root), None, 30)


def serve(
    pod: Pod,
    proc: subprocess.Popen[bytes],
    root: Path,
    ports: dict[int, int],
    tokens: dict[str, str],
    stop_budget: float,
) -> None:
    c = pod.server
    here = {name: ports[pod.container_port(name)] for name in (p["name"] for p in c["ports"])}
    http = f"http://127.0.0.1:{here['http']}"
    start = time.monotonic()

    def probe(name: str) -> Callable[[], bool]:
        spec = c[name]
        port = ports[pod.container_port((spec.get("httpGet") or spec["grpc"])["port"])]
        if "httpGet" in spec:
            return lambda: http_ok(f"http://127.0.0.1:{port}{spec['httpGet']['path']}")
        return lambda: grpc_serving(f"127.0.0.1:{port}", spec["grpc"].get("service", ""))

    startup = c["startupProbe"]
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    t_live = wait_for("startupProbe", probe("startupProbe"), proc, budget)
    log(f"startupProbe passed after {t_live:.1f} s (the kubelet allows {budget} s)")
    t_ready = t_live + wait_for("readinessProbe", probe("readinessProbe"), proc, READY_CAP_S)
    log(f"readinessProbe (gRPC health) SERVING after {t_ready:.1f} s: start to ready")
    running = processes_in(root)
    if proc.pid not in running:  # what the exit check after SIGTERM relies on
        raise CheckFailed(f"the server (pid {proc.pid}) is not among the image's processes {running}")
    log(f"{len(running)} processes run in the image (supervisor, frontends, model workers)")
    if not probe("livenessProbe")():
        raise CheckFailed("livenessProbe fails on a ready server")
    if requests.get(f"{http}/ping", timeout=10).status_code != 200:
        raise CheckFailed("/ping is not 200")

    model = "digits_torchscript"
    bearer = {"Authorization": f"Bearer {tokens['inference']}"}
    url = f"{http}/predictions/{model}"
    if (r := requests.post(url, json=DIGIT_ZERO, timeout=60)).status_code != 401:
        raise CheckFailed(f"a prediction without a token got {r.status_code}, not 401")
    if (
        r := requests.post(url, json=DIGIT_ZERO, headers={"Authorization": "Bearer wrong"}, timeout=60)
    ).status_code != 401:
        raise CheckFailed(f"a prediction with a wrong token got {r.status_code}, not 401")
    r = requests.post(url, json=DIGIT_ZERO, headers=bearer, timeout=60)
    if r.status_code != 200:
        raise CheckFailed(f"HTTP prediction: {r.status_code} {r.text[:300]}")
    log(f"HTTP prediction with the inference token: 200 {json.dumps(r.json())[:100]}")
    # Management has its own token: the inference one does not open it.
    models_url = f"http://127.0.0.1:{here['management']}/models"
    for token, want in ((None, 401), (tokens["inference"], 401), (tokens["management"], 200)):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if (got := requests.get(models_url, headers=headers, timeout=30).status_code) != want:
            raise CheckFailed(f"GET /models on the management port: {got}, expected {want}")
    log("management API: 401 without a token and with the inference token, 200 with its own")

    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    request = inference_pb2.PredictionsRequest(
        model_name=model, input={"data": json.dumps(DIGIT_ZERO).encode()}
    )
    with grpc.insecure_channel(f"127.0.0.1:{here['grpc']}") as ch:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(ch)
        try:
            stub.Predictions(request, timeout=60)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise CheckFailed(
                    f"gRPC prediction without a token: {exc.code()}, not UNAUTHENTICATED"
                ) from None
        else:
            raise CheckFailed("gRPC prediction without a token succeeded")
        answer = stub.Predictions(
            request, timeout=60, metadata=[("authorization", f"Bearer {tokens['inference']}")]
        )
    if json.loads(answer.prediction) != r.json():
        raise CheckFailed(f"gRPC and HTTP answers differ: {answer.prediction[:200]!r} vs {r.text[:200]}")
    log("gRPC prediction with the inference token: same answer as HTTP")

    metrics = requests.get(f"http://127.0.0.1:{here['metrics']}/metrics", timeout=10)
    if metrics.status_code != 200:
        raise CheckFailed(f"/metrics without a token: {metrics.status_code}")
    # Successful answers per protocol (HTTP labels its code with the status, gRPC with the status name).
    ok: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.text):
        for s in family.samples:
            counted = s.name == "mariner_requests_total" and s.labels.get("model") == model
            if counted and s.labels.get("code") in ("200", "OK"):
                ok[s.labels["protocol"]] = ok.get(s.labels["protocol"], 0.0) + s.value
    grpc_ok = sum(v for k, v in ok.items() if "grpc" in k)
    http_ok_count = sum(v for k, v in ok.items() if "grpc" not in k)
    if grpc_ok < 1 or http_ok_count < 1:
        raise CheckFailed(f"/metrics does not count the HTTP and gRPC predictions just made: {ok}")
    log(f"/metrics (no token): successful predictions counted by protocol {ok}")

    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=stop_budget)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"SIGTERM: still running after {stop_budget:.0f} s (grace less preStop)") from None
    if rc != 0:
        raise CheckFailed(f"SIGTERM: exit code {rc}, not 0")
    log(f"SIGTERM -> exit 0 after {time.monotonic() - t0:.1f} s (budget {stop_budget:.0f} s)")
    log(f"whole run {time.monotonic() - start:.0f} s")


def run_check(check: Callable[[], None]) -> int:
    """A check's exit status: 0 when it passed, 1 when it failed (said why), 2 without root."""
    if os.geteuid() != 0:
        log("needs root (podman mount, chroot)")
        return 2
    try:
        check()
    except CheckFailed as exc:
        log(f"FAILED: {exc}")
        return 1
    log("OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlay", default="overlays/cpu", help="kustomization whose Deployment is started")
    args = parser.parse_args(argv)
    return run_check(lambda: check(args.overlay))


if __name__ == "__main__":
    sys.exit(main())
