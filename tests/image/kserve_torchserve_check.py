"""Start the built CPU image as KServe's TorchServe runtime would, and check it serves KServe.

`make image-test` runs this after the Deployment check (tests/image/image_check.py). The pod comes
from the rendered `k8s/kserve` ServingRuntime `kserve-torchserve-mariner` (KServe's own
`kserve-torchserve` with Mariner's image): its `args` (`torchserve --start --model-store=...
--ts-config=...`) under the image's ENTRYPOINT, its environment (`TS_SERVICE_ENVELOPE`, empty as
KServe renders an unset label), and `/mnt/models` laid out as KServe's storage initializer leaves
it: `config/config.properties` from k8s/kserve/model-repo and the digits archive in `model-store/`.
The server runs as the image's user from the image's filesystem (tests/image/podman.py).

One deliberate difference: the listeners bind 127.0.0.1 (the chroot shares this machine's network).
The config.properties sets `enable_envvars_config=true`, so the `TS_*_ADDRESS` variables, which
TorchServe applies over its command line, move the HTTP listeners to loopback on the same ports.

Checked on 8080, where KServe routes: KServe v1 (`/v1/models/<m>` ready, `:predict`), v2
(`/v2/health/ready`, `/v2/models/<m>/infer`) and TorchServe's `/predictions`; the models of
`model_snapshot` on the management port 8085; `/metrics` on 8082; SIGTERM -> exit 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from tests.image.image_check import (
    DIGIT_ZERO,
    READY_CAP_S,
    CheckFailed,
    free,
    free_port,
    http_ok,
    log,
    run_check,
    server_in,
    wait_for,
)
from tests.image.pod import REPO, built_refs, render
from tests.image.podman import Bind, ImageMeta, chroot_argv, image_exists, mounted

RUNTIME = "kserve-torchserve-mariner"
MODEL = "digits_torchscript"
PORTS = {"inference": 8080, "management": 8085, "metrics": 8082}


def runtime_container() -> dict:
    (runtime,) = [
        o for o in render("kserve") if o["kind"] == "ServingRuntime" and o["metadata"]["name"] == RUNTIME
    ]
    (container,) = runtime["spec"]["containers"]
    return container


def model_repo(work: Path) -> Path:
    """/mnt/models as KServe's storage initializer leaves it (read-only in the pod)."""
    mnt = work / "mnt-models"
    shutil.copytree(REPO / "k8s/kserve/model-repo/config", mnt / "config")
    store = mnt / "model-store"
    store.mkdir()
    archive = REPO / "model_store" / f"{MODEL}.mar"
    if not archive.is_file():
        raise CheckFailed(f"{archive} is missing: run `make models`")
    shutil.copy(archive, store)
    for p in [mnt, *mnt.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return mnt


def check() -> None:
    ref = built_refs()["overlays/cpu"]
    if not image_exists(ref):
        raise CheckFailed(f"image {ref} is not built: run `make image`")
    # The runtime's ports when free, else free ones (a listener just closed leaves its port in
    # TIME_WAIT): only the bind address is changed, through the TS_*_ADDRESS variables.
    ports = {key: port if free(port) else free_port() for key, port in PORTS.items()}
    log(f"listeners on 127.0.0.1, ports {ports}")
    c = runtime_container()
    meta = ImageMeta.inspect(ref)
    env = {**meta.env_dict(), **{e["name"]: e.get("value", "") for e in c.get("env", [])}}
    env["TS_SERVICE_ENVELOPE"] = ""  # "{{.Labels.serviceEnvelope}}" of an InferenceService without it
    for key, port in ports.items():
        env[f"TS_{key.upper()}_ADDRESS"] = f"http://127.0.0.1:{port}"
    argv = [*meta.entrypoint, *c["args"]]  # `args` replace the CMD, the ENTRYPOINT stays
    uid, _, gid = meta.user.partition(":")
    with tempfile.TemporaryDirectory(prefix="mariner-kserve-check-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        mnt = model_repo(work)
        with mounted(ref) as root:
            command = chroot_argv(
                root, [Bind(mnt, "/mnt/models", True)], uid=int(uid), gid=int(gid or uid),
                groups=[int(gid or uid)], env=env, workdir=meta.working_dir, argv=argv,
                read_only_root=False,
            )  # fmt: skip
            log(f"starting {argv} as {meta.user}")
            with server_in(root, command, work / "server.log") as proc:
                serve(proc, ports)


def serve(proc: subprocess.Popen[bytes], ports: dict[str, int]) -> None:
    http = f"http://127.0.0.1:{ports['inference']}"
    took = wait_for("/v2/health/ready", lambda: http_ok(f"{http}/v2/health/ready"), proc, READY_CAP_S)
    log(f"/v2/health/ready after {took:.1f} s")
    if (r := requests.get(f"{http}/v1/models/{MODEL}", timeout=30)).status_code != 200:
        raise CheckFailed(f"KServe v1 model ready: {r.status_code} {r.text[:300]}")
    r = requests.post(f"{http}/v1/models/{MODEL}:predict", json={"instances": [DIGIT_ZERO]}, timeout=60)
    if r.status_code != 200 or len(r.json().get("predictions", [])) != 1:
        raise CheckFailed(f"KServe v1 predict: {r.status_code} {r.text[:300]}")
    v1 = r.json()["predictions"][0]
    log(f"KServe v1 :predict: 200 {json.dumps(v1)[:100]}")
    tensor = {"name": "pixels", "shape": [1, 64], "datatype": "FP32", "data": DIGIT_ZERO}
    r = requests.post(f"{http}/v2/models/{MODEL}/infer", json={"inputs": [tensor]}, timeout=60)
    if r.status_code != 200 or not r.json().get("outputs"):
        raise CheckFailed(f"KServe v2 infer: {r.status_code} {r.text[:300]}")
    log("KServe v2 /infer: 200")
    r = requests.post(f"{http}/predictions/{MODEL}", json=DIGIT_ZERO, timeout=60)
    if r.status_code != 200 or r.json() != v1:
        raise CheckFailed(f"TorchServe /predictions: {r.status_code} {r.text[:300]} (v1 said {v1})")
    log("TorchServe /predictions: the same answer as KServe v1")
    r = requests.get(f"http://127.0.0.1:{ports['management']}/models", timeout=30)
    if r.status_code != 200 or [m["modelName"] for m in r.json()["models"]] != [MODEL]:
        raise CheckFailed(f"management: {r.status_code} {r.text[:300]} (model_snapshot names {MODEL})")
    log(f"management lists {MODEL} (config.properties' model_snapshot)")
    if not http_ok(f"http://127.0.0.1:{ports['metrics']}/metrics"):
        raise CheckFailed("/metrics does not answer")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    if rc != 0:
        raise CheckFailed(f"SIGTERM: exit code {rc}, not 0")
    log("SIGTERM -> exit 0")


if __name__ == "__main__":
    sys.exit(run_check(check))
