"""The Kubernetes manifests under k8s/, proven without a cluster.

Every kustomization is rendered with `kubectl kustomize` (offline). Core objects are validated in
strict mode (unknown fields are errors) against the Kubernetes 1.30 schemas of `kubernetes-validate`;
custom resources (ServiceMonitor, PrometheusRule, ServingRuntime, InferenceService), which those
schemas do not cover, get their required fields checked here. Then the invariants across files:
ports, probes and Services against the server's defaults and the ConfigMap's config file;
selectors against labels; the termination grace against the drain; authentication (the config
starts with the token Secret's files and is refused without them, the Secret is mounted read-only
where the config reads it and never committed, probes and scrapes need no token); GPU limits only
in the GPU overlay; and every metric name in the PromQL of the rules, dashboard, HPA and adapter rule against
what `/metrics` of a live Mariner exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import requests
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_flags import build_parser
from mariner.server.common.config_loading import load_config
from mariner.server.common.listeners import check_exposure
from mariner.server.common.security import OPEN_HTTP_HEALTH_PATHS, Tokens
from mariner.server.compat.torchserve.java_properties import read_properties
from mariner.server.contracts.errors import Code, ServingError
from tests.mariner_serve import MarinerServe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
K8S_VERSION = "1.30"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "kserve", "monitoring")
DEPLOYABLE = ("base", "overlays/cpu", "overlays/gpu")  # the ones holding the Mariner Deployment
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("serving.kserve.io/v1alpha1", "ServingRuntime"),
    ("serving.kserve.io/v1beta1", "InferenceService"),
}
# Container port name -> the ServerConfig field whose address it serves.
PORT_FIELDS = {
    "http": "inference_address",
    "management": "management_address",
    "metrics": "metrics_address",
    "grpc": "grpc_inference_address",
    "grpc-management": "grpc_management_address",
}
# app.py stops the gRPC servers with grace=2.0 after the drain and the refuse period.
GRPC_STOP_GRACE_S = 2.0
GPU = "nvidia.com/gpu"
# Metric names in our PromQL that Mariner does not export, and who does.
EXTERNAL_METRICS = {
    "up": "Prometheus (scrape health)",
    "kube_deployment_status_replicas_unavailable": "kube-state-metrics",
}
EXTERNAL_LABELS = {"deployment"}  # kube-state-metrics
# Labels Prometheus attaches to every scraped series (ServiceMonitor).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint"}
# Declared always, but with samples only where CUDA is in use.
GPU_MEMORY = "mariner_gpu_memory_allocated_bytes"
# One 8x8 digit (a 0), as the README's curl example sends it.
DIGITS: list[int] = json.loads(
    "[0,0,5,13,9,1,0,0,0,0,13,15,10,15,5,0,0,3,15,2,0,11,8,0,0,4,12,0,0,8,8,0,"
    "0,5,8,0,0,9,8,0,0,4,11,0,1,12,7,0,0,2,14,5,10,12,0,0,0,0,6,13,10,0,0,0]"
)

# Bearer tokens: the Secret the operator creates (never committed), its keys, the config keys naming
# the files, and the tokens a test writes into them (two inference tokens: a rotation in progress).
TOKEN_SECRET = "mariner-tokens"
TOKEN_FIELDS = {"inference_token_file": "inference", "management_token_file": "management"}
TEST_TOKENS = {"inference": ("inference-old-0001", "inference-new-0002"), "management": ("management-0003",)}
KSERVE_RUNTIME = "kserve-mariner"

Obj = dict[str, Any]


# -- rendering ----------------------------------------------------------------------------------
def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not on PATH: the manifests are rendered with `kubectl kustomize` (kubectl >= 1.27). "
            "Install it with `bash scripts/ensure_kubectl.sh`."
        )
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    kubectl = _kubectl()
    out: dict[str, list[Obj]] = {}
    for rel in KUSTOMIZATIONS:
        proc = subprocess.run(
            [kubectl, "kustomize", str(K8S / rel)], capture_output=True, text=True, timeout=120, check=False
        )
        if proc.returncode != 0:
            pytest.fail(f"`kubectl kustomize k8s/{rel}` failed (exit {proc.returncode}):\n{proc.stderr}")
        out[rel] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def objects(rendered: dict[str, list[Obj]], rel: str, kind: str) -> list[Obj]:
    return [o for o in rendered[rel] if o["kind"] == kind]


def one(rendered: dict[str, list[Obj]], rel: str, kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects(rendered, rel, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"k8s/{rel}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(rendered: dict[str, list[Obj]], rel: str) -> Obj:
    return one(rendered, rel, "Deployment", "mariner")["spec"]["template"]["spec"]


def container(spec: Obj, name: str = "mariner") -> Obj:
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return found


def env_of(c: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in c.get("env", [])}


def config_file_text(rendered: dict[str, list[Obj]], rel: str) -> str:
    """The config file the pod's server reads (MARINER_CONFIG_FILE), from the ConfigMap mounted there."""
    spec = pod_spec(rendered, rel)
    c = container(spec)
    config_path = Path(env_of(c)["MARINER_CONFIG_FILE"]["value"])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = one(rendered, rel, "ConfigMap", volume["configMap"]["name"])
    return cm["data"][config_path.name]


def server_config(rendered: dict[str, list[Obj]], rel: str, tmp_path: Path) -> ServerConfig:
    """The ServerConfig the pod's server would load: the ConfigMap's file plus the container's env."""
    env = env_of(container(pod_spec(rendered, rel)))
    local = tmp_path / f"{rel.replace('/', '_')}-{Path(env['MARINER_CONFIG_FILE']['value']).name}"
    local.write_text(config_file_text(rendered, rel))
    plain_env = {k: e["value"] for k, e in env.items() if "value" in e and k.startswith("MARINER_")}
    plain_env["MARINER_CONFIG_FILE"] = str(local)
    return load_config([], env=plain_env)


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a nested structure."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- PromQL: metric and label names, without a PromQL parser --------------------------------------
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
_KEYWORDS |= {"offset", "inf", "nan", "atan2"}


@dataclass(frozen=True)
class PromQLNames:
    metrics: frozenset[str]
    labels: frozenset[str]


def promql_names(expr: str, series: str | None = None) -> PromQLNames:
    """Metric and label names used in a PromQL expression.

    Strings, label matchers `{...}`, ranges `[...]` and grouping clauses `by (...)` are taken out
    first (their label names recorded), so what is left is functions (followed by `(`), keywords,
    numbers and metric names. prometheus-adapter templates are understood: `<<.Series>>` becomes
    `series`; Grafana variables (`$x`, `${x}`) are dropped.
    """
    labels: set[str] = set()
    metrics: set[str] = set()
    if series is not None:
        expr = expr.replace("<<.Series>>", series)
    expr = re.sub(r"<<[^>]*>>", " ", expr)
    for m in re.finditer(r"\{([^{}]*)\}", _STRING.sub('""', expr)):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", m.group(1)))
    # __name__ matchers name metrics too: read them before the strings are blanked.
    metrics |= set(re.findall(r"__name__\s*=\s*\"([^\"]+)\"", expr))
    labels.discard("__name__")
    s = _STRING.sub('""', expr)
    s = re.sub(r"\{[^{}]*\}", " ", s)
    s = re.sub(r"\[[^\[\]]*\]", " ", s)
    for m in _GROUPING.finditer(s):
        labels |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    s = _GROUPING.sub(" ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)
    for m in re.finditer(r"(?<![\w.:$])([a-zA-Z_:][\w:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if call is None and name.lower() not in _KEYWORDS:
            metrics.add(name)
    return PromQLNames(frozenset(metrics), frozenset(labels))


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        (
            "histogram_quantile(0.99, sum by (le, model) "
            '(rate(a_seconds_bucket{job="m", code=~"5.."}[5m]))) > 0.025',
            {"a_seconds_bucket"},
            {"le", "model", "job", "code"},
        ),
        (
            "sum(rate(x_total[1m] offset 5m)) / on (pod) group_left (node) y_info > 1e3",
            {"x_total", "y_info"},
            {"pod", "node"},
        ),
        ('up{job="mariner"} == 0', {"up"}, {"job"}),
        ('rate(z{a="sum(w)"}[$__rate_interval])', {"z"}, {"a"}),
        ('count({__name__="named", pod!=""}) by (pod)', {"named"}, {"pod"}),
        ("sum by (<<.GroupBy>>) (avg_over_time(<<.Series>>{<<.LabelMatchers>>}[1m]))", {"q"}, set()),
        ("sum(a:recorded:rate5m) without (instance) and bool b", {"a:recorded:rate5m", "b"}, {"instance"}),
    ],
)
def test_promql_name_extraction(expr: str, metrics: set[str], labels: set[str]) -> None:
    names = promql_names(expr, series="q")
    assert (set(names.metrics), set(names.labels)) == (metrics, labels)


def promql_sources(rendered: dict[str, list[Obj]]) -> dict[str, PromQLNames]:
    """Every PromQL expression shipped in k8s/, by where it comes from."""
    out: dict[str, PromQLNames] = {}
    rule = one(rendered, "base", "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            out[f"PrometheusRule {r.get('alert') or r.get('record')}"] = promql_names(r["expr"])
    dashboard = json.loads((K8S / "monitoring/mariner-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            out[f"dashboard {panel['title']!r} {t['refId']}"] = promql_names(t["expr"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", var["definition"])
            assert m, f"dashboard variable {var['name']}: expected label_values(selector, label)"
            names = promql_names(m.group(1))
            out[f"dashboard variable {var['name']}"] = PromQLNames(names.metrics, names.labels | {m.group(2)})
    adapter = yaml.safe_load((K8S / "monitoring/prometheus-adapter-values.yaml").read_text())
    served: dict[str, PromQLNames] = {}  # custom-metrics API name -> the series behind it
    for i, r in enumerate(adapter["rules"]["custom"]):
        series = promql_names(r["seriesQuery"])
        (name,) = series.metrics
        out[f"adapter rule {i} seriesQuery"] = series
        out[f"adapter rule {i} metricsQuery"] = promql_names(r["metricsQuery"], series=name)
        served[r["name"]["as"]] = series
    for rel in DEPLOYABLE:
        for metric in one(rendered, rel, "HorizontalPodAutoscaler")["spec"]["metrics"]:
            if metric["type"] == "Pods":
                # The HPA reads the adapter's metric, i.e. the series of the rule that serves it; a
                # name no rule serves is checked as a series name (and fails unless Mariner has it).
                name = metric["pods"]["metric"]["name"]
                out[f"{rel} HPA {name}"] = served.get(name, PromQLNames(frozenset({name}), frozenset()))
    return out


# -- bearer tokens --------------------------------------------------------------------------------
def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_token_files(directory: Path) -> dict[str, Path]:
    """The Secret's files as the kubelet projects them: one per key, one token per line."""
    out = {}
    for key, values in TEST_TOKENS.items():
        out[key] = directory / key
        out[key].write_text("".join(f"{v}\n" for v in values))
    return out


def exposure_of(config: Obj, tmp_path: Path, name: str) -> tuple[Tokens, Tokens]:
    """check_exposure of a config file holding `config`, loaded the way `mariner serve` loads it."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return check_exposure(load_config(["--config-file", str(path)], env={}))


def assert_refused(call: Any) -> None:
    with pytest.raises(ServingError) as info:
        call()
    assert info.value.code == Code.PERMISSION_DENIED
    assert "refusing to listen beyond loopback without authentication" in info.value.message
    for listener in ("HTTP inference", "gRPC inference", "HTTP management", "gRPC management"):
        assert listener in info.value.message


def assert_tokens_work(inference: Tokens, management: Tokens) -> None:
    for token in TEST_TOKENS["inference"]:  # every line of the file: rotation
        assert inference.accepts(f"Bearer {token}")
        assert not management.accepts(f"Bearer {token}")
    (admin,) = TEST_TOKENS["management"]
    assert management.accepts(f"Bearer {admin}")
    assert not inference.accepts(f"Bearer {admin}")
    assert not inference.accepts(None)


# -- a live Mariner -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveMetrics:
    declared: frozenset[str]  # every sample name a family may have, from # TYPE lines
    sampled: frozenset[str]  # names with at least one sample
    labels: frozenset[str]  # label names on mariner_* samples


def _scrape(server: MarinerServe) -> LiveMetrics:
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    declared: set[str] = set()
    sampled: set[str] = set()
    labels: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total", "_created"),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
        }.get(family.type, ("",))
        declared |= {family.name + s for s in suffixes}
        for sample in family.samples:
            sampled.add(sample.name)
            if sample.name.startswith("mariner_"):
                labels |= set(sample.labels)
    return LiveMetrics(frozenset(declared), frozenset(sampled), frozenset(labels))


GPU_WORKER_GAUGE = (
    "from mariner.server.common.metrics import Metrics; "
    "Metrics().gpu_memory_bytes.labels(device='cuda:0').set(0)"
)


@pytest.fixture(scope="module")
def live(
    model_store: Path, rendered: dict[str, list[Obj]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[MarinerServe, LiveMetrics]]:
    """Mariner with the ConfigMap's settings (ports 0, the local store, its token files written with
    test tokens), after one prediction."""
    cfg = server_config(rendered, "overlays/cpu", tmp_path_factory.mktemp("config"))
    tokens = write_token_files(tmp_path_factory.mktemp("tokens"))
    work_dir = tmp_path_factory.mktemp("work")
    server = MarinerServe(
        model_store,
        "digits_torchscript.mar",
        slo_ms=cfg.slo_ms,
        max_queue=cfg.max_queue,
        pin_index=cfg.pin_index,
        grace_seconds=cfg.grace_seconds,
        refuse_seconds=0.0,
        work_dir=work_dir,
        inference_token_file=tokens[Path(cfg.inference_token_file or "").name],
        management_token_file=tokens[Path(cfg.management_token_file or "").name],
        open_health=cfg.open_health,
        open_metrics=cfg.open_metrics,
    ).start()
    try:
        r = requests.post(
            f"{server.http}/predictions/digits_torchscript",
            json=DIGITS,
            headers=bearer(TEST_TOKENS["inference"][-1]),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        before = _scrape(server)
        if GPU_MEMORY not in before.sampled:
            # No CUDA in use: no worker wrote the GPU gauge, so /metrics (merged over processes)
            # has no series of it. Give it the one a GPU pod has: a process sets it through the
            # server's own metric object in the server's multiprocess metrics dir, as a GPU worker
            # does, so its real name and label names are exported.
            (metrics_dir,) = work_dir.glob("mariner-metrics-*")
            subprocess.run(
                [sys.executable, "-c", GPU_WORKER_GAUGE],
                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)},
                check=True,
                timeout=120,
            )
        yield server, _scrape(server)
    finally:
        server.stop()


# -- rendering and schemas ----------------------------------------------------------------------
def test_every_kustomization_is_rendered() -> None:
    found = {str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml")}
    assert found == set(KUSTOMIZATIONS), "a kustomization under k8s/ is not covered by these tests"


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_core_objects_are_valid_kubernetes_1_30(rendered: dict[str, list[Obj]], rel: str) -> None:
    problems = []
    assert rendered[rel], f"k8s/{rel} renders nothing"
    for obj in rendered[rel]:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            used = kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{what}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{what}: {e.message} (a typo in apiVersion/kind, or a custom resource?)")
        else:
            assert used == K8S_VERSION, f"{what} was validated against {used}, not {K8S_VERSION}"
    assert not problems, f"k8s/{rel}:\n" + "\n".join(problems)


def test_strict_validation_catches_a_misspelt_field(rendered: dict[str, list[Obj]]) -> None:
    """The validation above can fail: a typo in a probe's name is an error, not ignored."""
    deployment = json.loads(json.dumps(one(rendered, "overlays/cpu", "Deployment")))
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


DEPLOYED_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ServiceMonitor",
    "PrometheusRule",
    "ServiceAccount",
}


def test_kinds_are_the_expected_ones(rendered: dict[str, list[Obj]]) -> None:
    custom_names = {kind for _, kind in CUSTOM_KINDS}
    kinds = {(o["apiVersion"], o["kind"]) for objs in rendered.values() for o in objs}
    wrong_version = {k for k in kinds if k[1] in custom_names} - CUSTOM_KINDS
    assert not wrong_version, f"custom resources at an unexpected apiVersion: {wrong_version}"
    for rel in DEPLOYABLE:
        missing = DEPLOYED_KINDS - {o["kind"] for o in rendered[rel]}
        assert not missing, f"k8s/{rel} has no {sorted(missing)}"


# -- ports, probes, config ----------------------------------------------------------------------
@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_ports_match_server_defaults_and_config(
    rendered: dict[str, list[Obj]], rel: str, tmp_path: Path
) -> None:
    defaults = ServerConfig()
    cfg = server_config(rendered, rel, tmp_path)
    c = container(pod_spec(rendered, rel))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(ports) == set(PORT_FIELDS)
    for name, field_name in PORT_FIELDS.items():
        assert ports[name] == port_of(getattr(defaults, field_name)), f"{name}: not the server's default"
        host, _, port = getattr(cfg, field_name).rpartition(":")
        assert int(port) == ports[name], f"{field_name} in the ConfigMap disagrees with port {name}"
        assert host in ("0.0.0.0", "[::]"), f"{field_name} binds {host}: unreachable for probes and Services"

    for svc in objects(rendered, rel, "Service"):
        for sp in svc["spec"]["ports"]:
            target = sp["targetPort"]
            number = ports[target] if isinstance(target, str) else target
            assert number in ports.values(), f"Service {svc['metadata']['name']}: no container port {target}"
            # Drop-in for TorchServe: clients keep the port numbers they know.
            assert sp["port"] == number
            assert sp["name"] == next(n for n, p in ports.items() if p == number)
            assert sp.get("appProtocol") == ("grpc" if sp["name"].startswith("grpc") else "http")


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_probes_hit_the_health_endpoints(rendered: dict[str, list[Obj]], rel: str) -> None:
    c = container(pod_spec(rendered, rel))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}

    def resolve(port: int | str) -> int:
        return ports[port] if isinstance(port, str) else port

    ready = c["readinessProbe"]
    if "grpc" in ready:
        assert resolve(ready["grpc"]["port"]) == ports["grpc"]
        assert ready["grpc"].get("service", "") == "", "readiness must ask for the overall status"
    else:
        assert (ready["httpGet"]["path"], resolve(ready["httpGet"]["port"])) == ("/readyz", ports["http"])
    for probe in ("livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], resolve(get["port"])) == ("/healthz", ports["http"]), probe
    # The probes carry no token (a grpc probe cannot), so what they ask must be open.
    for probe in ("livenessProbe", "startupProbe", "readinessProbe"):
        if "httpGet" in c[probe]:
            assert c[probe]["httpGet"]["path"] in OPEN_HTTP_HEALTH_PATHS, probe
            assert not c[probe]["httpGet"].get("httpHeaders"), f"{probe}: no credentials in the pod spec"
    # The startup budget must cover a slow interpreter start before liveness may kill the pod.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60


def test_health_endpoints_answer_on_a_live_server(live: tuple[MarinerServe, LiveMetrics]) -> None:
    """What the probes ask, asked of a real server with the deploy's tokens, without a token:
    liveness, readiness over HTTP and gRPC health."""
    server, _ = live
    assert requests.get(f"{server.http}/healthz", timeout=5).status_code == 200
    assert requests.get(f"{server.http}/readyz", timeout=5).status_code == 200
    with grpc.insecure_channel(server.grpc_target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    assert status.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_grace_period_outlasts_the_drain(rendered: dict[str, list[Obj]], rel: str, tmp_path: Path) -> None:
    spec = pod_spec(rendered, rel)
    cfg = server_config(rendered, rel, tmp_path)
    pre_stop = container(spec).get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    needed = pre_stop + cfg.grace_seconds + cfg.refuse_seconds + GRPC_STOP_GRACE_S
    assert spec["terminationGracePeriodSeconds"] > needed, (
        f"terminationGracePeriodSeconds {spec['terminationGracePeriodSeconds']} <= preStop {pre_stop} + "
        f"grace {cfg.grace_seconds} + refuse {cfg.refuse_seconds} + gRPC stop {GRPC_STOP_GRACE_S}"
    )


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_writable_paths_are_empty_dirs_on_a_read_only_root(
    rendered: dict[str, list[Obj]], rel: str, tmp_path: Path
) -> None:
    spec = pod_spec(rendered, rel)
    c = container(spec)
    cfg = server_config(rendered, rel, tmp_path)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    env = env_of(c)
    # The work dir may be a directory inside the volume: the server makes it private (0700) itself.
    inside = [str(p) for p in (cfg.work_dir, *cfg.work_dir.parents) if str(p) in mounts]
    work = inside[0] if inside else str(cfg.work_dir)
    for path in (work, env["TMPDIR"]["value"]):
        assert path in mounts, f"{path} is not mounted: the server cannot write it on a read-only root"
        volume = volumes[mounts[path]["name"]]
        assert "emptyDir" in volume, f"{path} must be an emptyDir"
        assert not mounts[path].get("readOnly"), f"{path} must be writable"
    # The model store is filled by the initContainer, into the volume the server reads.
    store = mounts[str(cfg.model_store)]
    (init,) = spec["initContainers"]
    init_mount = next(m for m in init["volumeMounts"] if m["name"] == store["name"])
    assert init["command"][-1].rstrip("/") == init_mount["mountPath"].rstrip("/")


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_mariner_env_names_are_server_settings(rendered: dict[str, list[Obj]], rel: str) -> None:
    known = {f"MARINER_{f.name.upper()}" for f in fields(ServerConfig)}
    names = {n for n in env_of(container(pod_spec(rendered, rel))) if n.startswith("MARINER_")}
    assert names <= known, f"{sorted(names - known)} are not Mariner settings (typo?)"


# -- labels, selectors, references ----------------------------------------------------------------
@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_selectors_match_the_pods(rendered: dict[str, list[Obj]], rel: str) -> None:
    deployment = one(rendered, rel, "Deployment", "mariner")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    for svc in objects(rendered, rel, "Service"):
        assert selects(svc["spec"]["selector"], labels), f"Service {svc['metadata']['name']} selects no pod"
    assert selects(one(rendered, rel, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    assert selects(one(rendered, rel, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"], labels)
    for constraint in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        assert selects(constraint["labelSelector"]["matchLabels"], labels)
    target = one(rendered, rel, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "mariner")
    # The HPA owns the replica count.
    assert "replicas" not in deployment["spec"]
    spec = deployment["spec"]["template"]["spec"]
    accounts = {o["metadata"]["name"] for o in objects(rendered, rel, "ServiceAccount")}
    assert spec["serviceAccountName"] in accounts
    config_maps = {o["metadata"]["name"] for o in objects(rendered, rel, "ConfigMap")}
    for v in spec["volumes"]:
        if "configMap" in v:
            assert v["configMap"]["name"] in config_maps, f"volume {v['name']}: no such ConfigMap"


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_service_monitor_scrapes_the_metrics_port_once(rendered: dict[str, list[Obj]], rel: str) -> None:
    monitor = one(rendered, rel, "ServiceMonitor")
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"], "a ServiceMonitor needs a selector"
    assert spec["endpoints"], "a ServiceMonitor needs endpoints"
    chosen = [
        s
        for s in objects(rendered, rel, "Service")
        if selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert len(chosen) == 1, (
        f"the ServiceMonitor selects {len(chosen)} Services: series would be scraped twice"
    )
    port_names = {p["name"] for p in chosen[0]["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["port"] == "metrics"
        assert endpoint.get("path", "/metrics") == "/metrics"
    # The rules select job="mariner": Prometheus Operator names the job after the Service.
    assert chosen[0]["metadata"]["name"] == "mariner"
    ns = monitor["metadata"].get("namespace")
    assert ns == chosen[0]["metadata"].get("namespace")


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_network_policy_opens_each_port_to_its_audience(rendered: dict[str, list[Obj]], rel: str) -> None:
    policy = one(rendered, rel, "NetworkPolicy")["spec"]
    ports = {p["name"] for p in container(pod_spec(rendered, rel))["ports"]}
    opened: dict[str, list[Obj]] = {}
    for rule in policy["ingress"]:
        for p in rule["ports"]:
            assert p["port"] in ports, f"NetworkPolicy names port {p['port']}, which the container lacks"
            opened.setdefault(p["port"], []).extend(rule["from"])
    assert set(opened) == ports, f"ports without an ingress rule: {ports - set(opened)}"
    assert opened["metrics"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ], "metrics must be open to the monitoring namespace only"
    assert not any("ipBlock" in peer for peers in opened.values() for peer in peers)
    assert "Egress" in policy["policyTypes"]
    assert policy.get("egress") == []


# -- security -------------------------------------------------------------------------------------
RESTRICTED_VOLUMES = {
    "configMap",
    "emptyDir",
    "projected",
    "secret",
    "downwardAPI",
    "persistentVolumeClaim",
    "csi",
    "ephemeral",
}


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_pod_meets_the_restricted_pod_security_standard(rendered: dict[str, list[Obj]], rel: str) -> None:
    spec = pod_spec(rendered, rel)
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] != 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec.get("automountServiceAccountToken") is False
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    for v in spec["volumes"]:
        kinds = set(v) - {"name"}
        assert kinds <= RESTRICTED_VOLUMES, f"volume {v['name']}: {kinds} is not allowed under restricted"
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert not sc["capabilities"].get("add"), c["name"]
        assert sc.get("readOnlyRootFilesystem") is True, c["name"]
        assert not sc.get("privileged"), c["name"]
        assert sc.get("runAsUser", pod_sc["runAsUser"]) != 0, c["name"]
        assert c["resources"]["requests"], c["name"]
        assert c["resources"]["limits"].get("memory"), c["name"]
    for ns in objects(rendered, rel, "Namespace"):
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# -- authentication -------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_deploy_config_is_neither_open_nor_broken(
    rendered: dict[str, list[Obj]], rel: str, tmp_path: Path
) -> None:
    """The ConfigMap's config starts with the Secret's files in place and refuses to start without
    token settings: its 0.0.0.0 listeners are never served without authentication."""
    config = yaml.safe_load(config_file_text(rendered, rel))
    assert set(TOKEN_FIELDS) <= set(config), "mariner.yaml must name the token files"
    assert not config.get("insecure"), "the deploy must not opt out of authentication"
    assert not {"inference_token", "management_token"} & set(config), "token values in a ConfigMap"
    # Probes and Prometheus carry no token: health and metrics are open, explicitly.
    assert config["open_health"] is True
    assert config["open_metrics"] is True
    env = env_of(container(pod_spec(rendered, rel)))
    assert "MARINER_INSECURE" not in env
    for name in ("MARINER_INFERENCE_TOKEN", "MARINER_MANAGEMENT_TOKEN"):
        assert "value" not in env.get(name, {}), f"{name}: a token written into the pod spec"

    files = write_token_files(tmp_path)
    mounted = dict(config)
    for field_name, key in TOKEN_FIELDS.items():
        mounted[field_name] = str(files[key])
    assert_tokens_work(*exposure_of(mounted, tmp_path, "with-tokens.yaml"))

    unset = {k: v for k, v in config.items() if k not in TOKEN_FIELDS}
    assert_refused(lambda: exposure_of(unset, tmp_path, "without-tokens.yaml"))
    # A Secret with empty keys (or the images' placeholders) holds no token: refused as well.
    for key in TOKEN_FIELDS.values():
        files[key].write_text("# no token here\n")
    assert_refused(lambda: exposure_of(mounted, tmp_path, "empty-tokens.yaml"))


def assert_secret_mounted_at(tokens_dir: Path, c: Obj, volumes: list[Obj], file_names: set[str]) -> Obj:
    """The token Secret is mounted read-only at `tokens_dir`, as the files the config names."""
    mounts = [m for m in c.get("volumeMounts", []) if Path(m["mountPath"]) == tokens_dir]
    assert len(mounts) == 1, f"nothing (or several things) mounted at {tokens_dir}, where the tokens are read"
    (mount,) = mounts
    assert mount.get("readOnly") is True, f"{tokens_dir} must be mounted read-only"
    # subPath mounts never see an updated Secret.
    assert "subPath" not in mount
    assert "subPathExpr" not in mount
    (volume,) = [v for v in volumes if v["name"] == mount["name"]]
    secret = volume.get("secret")
    assert secret, f"volume {volume['name']} at {tokens_dir} must be a Secret"
    assert secret["secretName"] == TOKEN_SECRET
    assert not secret.get("optional"), "a missing Secret must stop the pod, not start it without tokens"
    mode = secret["defaultMode"]
    assert mode & 0o007 == 0, f"defaultMode {mode:o}: token files readable by every user"
    assert mode & 0o222 == 0, f"defaultMode {mode:o}: token files writable"
    items = {i["path"]: i["key"] for i in secret.get("items", [])}
    assert items == {name: name for name in file_names}, (
        "the Secret's keys must be the files the config names"
    )
    return secret


@pytest.mark.parametrize("rel", DEPLOYABLE)
def test_token_secret_is_mounted_read_only_where_the_config_reads_it(
    rendered: dict[str, list[Obj]], rel: str, tmp_path: Path
) -> None:
    cfg = server_config(rendered, rel, tmp_path)
    paths = [Path(getattr(cfg, f)) for f in TOKEN_FIELDS]
    (tokens_dir,) = {p.parent for p in paths}
    assert {p.name for p in paths} == set(TOKEN_FIELDS.values())
    spec = pod_spec(rendered, rel)
    assert_secret_mounted_at(tokens_dir, container(spec), spec["volumes"], {p.name for p in paths})
    # 0440 is readable through the group: the pod's fsGroup gives the files the server's group.
    pod_sc = spec["securityContext"]
    assert pod_sc.get("fsGroup") == pod_sc["runAsGroup"], "token files must be readable by the server's group"
    # Only the server sees the tokens.
    token_volumes = {
        v["name"] for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TOKEN_SECRET
    }
    for init in spec.get("initContainers", []):
        assert not {m["name"] for m in init.get("volumeMounts", [])} & token_volumes, init["name"]


def test_kserve_runtime_mounts_the_tokens_and_refuses_without_them(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    runtime = one(rendered, "kserve", "ServingRuntime", KSERVE_RUNTIME)["spec"]
    (c,) = runtime["containers"]
    args: list[str] = c["args"]
    cfg = load_config(args, env={})
    paths = [Path(getattr(cfg, f)) for f in TOKEN_FIELDS]
    (tokens_dir,) = {p.parent for p in paths}
    assert_secret_mounted_at(tokens_dir, c, runtime.get("volumes", []), {p.name for p in paths})
    assert cfg.open_health, "KServe's and Knative's probes carry no token"
    assert cfg.open_metrics, "KServe's Prometheus scraping carries no token"
    assert not cfg.insecure
    assert c["readinessProbe"]["httpGet"]["path"] in OPEN_HTTP_HEALTH_PATHS
    # The image's baked-in config (loaded first, as MARINER_CONFIG_FILE) names the same files.
    baked = load_config(args, env={"MARINER_CONFIG_FILE": str(K8S / "base/mariner.yaml")})
    assert [getattr(baked, f) for f in TOKEN_FIELDS] == [getattr(cfg, f) for f in TOKEN_FIELDS]
    # A ServingRuntime cannot set fsGroup: every InferenceService on it does, or 0440 is unreadable.
    group = c["securityContext"]["runAsGroup"]
    on_runtime = [
        o["spec"]["predictor"]
        for o in objects(rendered, "kserve", "InferenceService")
        if o["spec"]["predictor"]["model"].get("runtime") == KSERVE_RUNTIME
    ]
    assert on_runtime
    for predictor in on_runtime:
        assert predictor["securityContext"]["fsGroup"] == group
        # The pod KServe builds from the two, checked against the core schema (the CRs are not).
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": KSERVE_RUNTIME},
            "spec": {
                "containers": runtime["containers"],
                "volumes": runtime["volumes"],
                "securityContext": predictor["securityContext"],
            },
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)

    files = write_token_files(tmp_path)
    flags = {f"--{f.replace('_', '-')}": f for f in TOKEN_FIELDS}

    def token_flag(arg: str) -> str | None:
        flag = arg.partition("=")[0]
        return flags.get(flag)

    substituted = [
        f"{arg.partition('=')[0]}={files[TOKEN_FIELDS[name]]}" if (name := token_flag(arg)) else arg
        for arg in args
    ]
    assert substituted != args
    assert_tokens_work(*check_exposure(load_config(substituted, env={})))
    unset = [arg for arg in args if token_flag(arg) is None]
    assert_refused(lambda: check_exposure(load_config(unset, env={})))


def test_no_secret_values_are_committed(rendered: dict[str, list[Obj]]) -> None:
    """Tokens come from a Secret the operator creates; k8s/ holds none, and no kustomization makes one."""
    problems = []
    for path in sorted(K8S.rglob("*")):
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            continue
        rel = path.relative_to(REPO)
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "Secret" and (doc.get("data") or doc.get("stringData")):
                problems.append(f"{rel}: a Secret with data")
            if path.name == "kustomization.yaml" and doc.get("secretGenerator"):
                problems.append(f"{rel}: a secretGenerator")
            for key, value in walk(doc):
                if key in ("inference_token", "management_token") and value:
                    problems.append(f"{rel}: {key} written into a manifest")
                if isinstance(value, str) and value.startswith(("--inference-token=", "--management-token=")):
                    problems.append(f"{rel}: a token on a command line")
    for rel, objs in rendered.items():
        for o in objs:
            if o["kind"] == "Secret":
                problems.append(f"k8s/{rel} renders Secret {o['metadata']['name']}")
    assert not problems, "\n".join(problems)
    # The check above reads the file that matters.
    assert "inference_token_file" in (K8S / "base/mariner.yaml").read_text()


def test_live_server_wants_tokens_except_for_probes_and_metrics(
    live: tuple[MarinerServe, LiveMetrics],
) -> None:
    """The server as the deploy configures it: inference and management need their tokens (every
    line of a token file works), health and /metrics answer without one."""
    server, _ = live
    url = f"{server.http}/predictions/digits_torchscript"
    assert requests.post(url, json=DIGITS, timeout=30).status_code == 401
    assert requests.post(url, json=DIGITS, headers=bearer("not-a-token"), timeout=30).status_code == 401
    for token in TEST_TOKENS["inference"]:
        assert requests.post(url, json=DIGITS, headers=bearer(token), timeout=30).status_code == 200
    models = f"{server.management}/models"
    assert requests.get(models, timeout=10).status_code == 401
    assert requests.get(models, headers=bearer(TEST_TOKENS["inference"][0]), timeout=10).status_code == 401
    assert requests.get(models, headers=bearer(TEST_TOKENS["management"][0]), timeout=10).status_code == 200
    for path in ("/ping", "/healthz", "/readyz"):
        assert requests.get(f"{server.http}{path}", timeout=10).status_code == 200, path
    assert requests.get(f"{server.metrics}/metrics", timeout=10).status_code == 200


def test_prometheus_scrapes_without_a_token(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    for rel in DEPLOYABLE:
        assert server_config(rendered, rel, tmp_path).open_metrics
        for endpoint in one(rendered, rel, "ServiceMonitor")["spec"]["endpoints"]:
            assert not {"bearerTokenSecret", "authorization", "bearerTokenFile"} & set(endpoint)


# -- CPU vs GPU ---------------------------------------------------------------------------------
def test_gpu_limits_appear_only_in_the_gpu_overlay(rendered: dict[str, list[Obj]]) -> None:
    for rel, objs in rendered.items():
        if rel == "overlays/gpu":
            continue
        assert not any(k == GPU for k, _ in walk(objs)), f"k8s/{rel} asks for {GPU}"
    spec = pod_spec(rendered, "overlays/gpu")
    resources = container(spec)["resources"]
    assert resources["limits"][GPU] >= 1
    assert GPU not in resources.get("requests", {}), "extended resources belong in limits only"
    other = [c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] != "mariner"]
    assert not any(k == GPU for k, _ in walk(other))
    assert spec["nodeSelector"]
    assert any(t["key"] == GPU for t in spec["tolerations"])


def test_gpu_overlay_batches_more_with_fewer_replicas(
    rendered: dict[str, list[Obj]], tmp_path: Path, model_store: Path
) -> None:
    cpu_cfg = server_config(rendered, "overlays/cpu", tmp_path)
    gpu_cfg = server_config(rendered, "overlays/gpu", tmp_path)
    archive_batch = 32  # model-config.yaml of the digits archives (checked below)
    with zipfile.ZipFile(model_store / "digits_torchscript.mar") as mar:
        assert yaml.safe_load(mar.read("model-config.yaml"))["batchSize"] == archive_batch
    assert cpu_cfg.batch_size is None, "the CPU flavour keeps each archive's batchSize"
    assert gpu_cfg.batch_size is not None
    assert gpu_cfg.batch_size > archive_batch
    cpu_hpa = one(rendered, "overlays/cpu", "HorizontalPodAutoscaler")["spec"]
    gpu_hpa = one(rendered, "overlays/gpu", "HorizontalPodAutoscaler")["spec"]
    assert gpu_hpa["maxReplicas"] < cpu_hpa["maxReplicas"]
    assert gpu_hpa["minReplicas"] <= cpu_hpa["minReplicas"]
    gpu_image = container(pod_spec(rendered, "overlays/gpu"))["image"]
    cpu_image = container(pod_spec(rendered, "overlays/cpu"))["image"]
    assert gpu_image != cpu_image
    assert "gpu" in gpu_image


# -- autoscaling and the metrics behind it --------------------------------------------------------
def test_hpa_scales_on_cpu_and_queue_depth(rendered: dict[str, list[Obj]]) -> None:
    adapter = yaml.safe_load((K8S / "monitoring/prometheus-adapter-values.yaml").read_text())
    served = {r["name"]["as"] for r in adapter["rules"]["custom"]}
    for rel in DEPLOYABLE:
        hpa = one(rendered, rel, "HorizontalPodAutoscaler")
        assert hpa["apiVersion"] == "autoscaling/v2"
        spec = hpa["spec"]
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
        kinds = {m["type"] for m in spec["metrics"]}
        pods = [m["pods"] for m in spec["metrics"] if m["type"] == "Pods"]
        assert pods, f"k8s/{rel}: the HPA has no per-pod metric"
        assert all(p["metric"]["name"] in served for p in pods), (
            f"k8s/{rel}: the HPA's custom metric must be one the prometheus-adapter rule serves ({served})"
        )
        assert all(p["target"]["type"] == "AverageValue" for p in pods)
        if rel != "overlays/gpu":
            assert kinds == {"Resource", "Pods"}
            (cpu,) = [m["resource"] for m in spec["metrics"] if m["type"] == "Resource"]
            assert cpu["name"] == "cpu"
            assert cpu["target"]["type"] == "Utilization"
            # Utilization is relative to requests: without a CPU request the HPA cannot compute it.
            assert container(pod_spec(rendered, rel))["resources"]["requests"]["cpu"]
    for r in adapter["rules"]["custom"]:
        overrides = r["resources"]["overrides"]
        assert overrides["pod"]["resource"] == "pod"
        assert overrides["namespace"]["resource"] == "namespace"
        assert re.fullmatch(r["name"]["matches"].strip("^$"), r["name"]["as"])


def test_every_promql_name_exists_on_a_live_server(
    rendered: dict[str, list[Obj]], live: tuple[MarinerServe, LiveMetrics]
) -> None:
    _, metrics = live
    problems = []
    for where, names in promql_sources(rendered).items():
        for name in sorted(names.metrics):
            if name in EXTERNAL_METRICS:
                continue
            if not name.startswith("mariner_"):
                problems.append(f"{where}: {name} is neither Mariner's nor a known external metric")
            elif name not in metrics.declared:
                problems.append(f"{where}: {name} is not exported by Mariner")
            elif name not in metrics.sampled:
                problems.append(f"{where}: {name} has no sample after a prediction")
        if all(n.startswith("mariner_") for n in names.metrics):
            unknown = names.labels - metrics.labels - TARGET_LABELS - {"le"}
        else:
            unknown = names.labels - metrics.labels - TARGET_LABELS - EXTERNAL_LABELS - {"le"}
        if unknown:
            problems.append(f"{where}: labels {sorted(unknown)} are on no Mariner series")
    assert not problems, "\n".join(problems)
    # The checks above have something to check.
    assert len(promql_sources(rendered)) > 15


def test_error_ratio_matches_the_code_label_values(live: tuple[MarinerServe, LiveMetrics]) -> None:
    """The rules count code=~"5..": the code label must hold HTTP-style statuses (gRPC too)."""
    server, _ = live
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    codes = {
        s.labels["code"]
        for f in text_string_to_metric_families(text)
        if f.name == "mariner_requests"
        for s in f.samples
        if s.name == "mariner_requests_total"
    }
    assert "200" in codes
    assert all(re.fullmatch(r"\d{3}", c) for c in codes)


def test_latency_alert_threshold_is_the_slo_bucket(
    rendered: dict[str, list[Obj]], live: tuple[MarinerServe, LiveMetrics], tmp_path: Path
) -> None:
    cfg = server_config(rendered, "overlays/cpu", tmp_path)
    rule = next(
        r
        for g in one(rendered, "base", "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
        if "histogram_quantile(0.99" in r.get("expr", "")
    )
    threshold = float(re.search(r"\)\s*>\s*([0-9.]+)", rule["expr"]).group(1))  # type: ignore[union-attr]
    assert threshold == pytest.approx(cfg.slo_ms / 1e3), "the p99 alert must fire at the server's slo_ms"
    # histogram_quantile is exact at bucket boundaries: the SLO must be one of them.
    server, _ = live
    text = requests.get(f"{server.metrics}/metrics", timeout=10).text
    bounds = {
        float(s.labels["le"])
        for f in text_string_to_metric_families(text)
        if f.name == "mariner_request_duration_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    }
    assert any(b == pytest.approx(threshold) for b in bounds)


# -- custom resources: the fields their CRDs require --------------------------------------------
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_prometheus_rule_is_well_formed(rendered: dict[str, list[Obj]]) -> None:
    rule = one(rendered, "base", "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups)
    alerts = []
    for group in groups:
        assert group["rules"], f"group {group['name']} is empty"
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r), r
            expr = r["expr"]
            assert expr.count("(") == expr.count(")"), r.get("alert")
            assert expr.count("{") == expr.count("}"), r.get("alert")
            if "alert" in r:
                alerts.append(r["alert"])
                assert DURATION.match(r["for"]), r["for"]
                assert r["labels"]["severity"] in {"critical", "warning", "info"}
                assert r["annotations"]["summary"]
                assert r["annotations"]["description"]
    assert len(alerts) == len(set(alerts))
    names = " ".join(alerts)
    for needed in ("P99", "ErrorRatio", "NotReady"):
        assert needed in names, f"no {needed} alert"


def test_kserve_runtime_and_inference_services(rendered: dict[str, list[Obj]], model_store: Path) -> None:
    runtime = one(rendered, "kserve", "ServingRuntime", "kserve-mariner")["spec"]
    assert any(f["name"] == "pytorch" for f in runtime["supportedModelFormats"])
    assert set(runtime["protocolVersions"]) == {"v2", "grpc-v2"}
    (c,) = runtime["containers"]
    assert c["name"] == "kserve-container"
    assert c["image"]
    args = build_parser().parse_args(c["args"])  # every flag is a real `mariner serve` flag
    assert args.model_store == "/mnt/models/model-store"
    http_port = port_of(args.inference_address)
    assert http_port == 8080
    assert {p["containerPort"] for p in c["ports"]} == {http_port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": http_port}
    assert str(runtime["annotations"]["prometheus.kserve.io/port"]) == str(port_of(args.metrics_address))

    services = {
        o["metadata"]["name"]: o["spec"]["predictor"] for o in objects(rendered, "kserve", "InferenceService")
    }
    assert set(services) == {"digits-mariner", "digits-torchserve", "digits-torchserve-mariner"}
    mariner, torchserve = services["digits-mariner"]["model"], services["digits-torchserve"]["model"]
    assert mariner["runtime"] == "kserve-mariner"
    assert mariner["protocolVersion"] in runtime["protocolVersions"]
    assert torchserve["runtime"] == "kserve-torchserve"
    for model in (mariner, torchserve):
        assert model["modelFormat"]["name"] == "pytorch"
    assert mariner["storageUri"] == torchserve["storageUri"], "both runtimes serve the same archives"
    claim = mariner["storageUri"].removeprefix("pvc://").split("/")[0]
    assert claim in {o["metadata"]["name"] for o in objects(rendered, "kserve", "PersistentVolumeClaim")}

    # The storage layout KServe's TorchServe runtime expects, readable by Mariner's parser too.
    props = read_properties((K8S / "kserve/model-repo/config/config.properties").read_text())
    assert props["model_store"] == args.model_store
    snapshot = json.loads(props["model_snapshot"])
    archives = {a["file"] for a in json.loads((model_store / "index.json").read_text())["archives"]}
    assert snapshot["modelCount"] == len(snapshot["models"])
    for name, versions in snapshot["models"].items():
        for version in versions.values():
            assert version["marName"] in archives, (
                f"{name}: {version['marName']} is not built by the pipeline"
            )
    assert props["metrics_mode"] == "prometheus"
    assert props["disable_token_authorization"] == "true"
    assert (K8S / "kserve/model-repo/model-store").is_dir()


def test_kserve_torchserve_runtime_runs_mariner_from_torchserve_args(
    rendered: dict[str, list[Obj]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KServe's TorchServe runtime with Mariner's image: its args, under the image's `mariner serve`
    entrypoint, become TorchServe's launcher in the foreground; with model-repo's config.properties
    (KServe's layout) Mariner takes inference on 8080 (where KServe routes), management where the
    file says, the models of its model_snapshot, and starts beyond loopback because the file turns
    TorchServe's keys off under this runtime only."""
    from mariner.server.compat.torchserve.command import parse

    runtime = one(rendered, "kserve", "ServingRuntime", "kserve-torchserve-mariner")["spec"]
    (c,) = runtime["containers"]
    assert c["args"][0] == "torchserve"
    assert {e["name"] for e in c["env"]} == {"TS_SERVICE_ENVELOPE"}
    model = {o["metadata"]["name"]: o for o in objects(rendered, "kserve", "InferenceService")}[
        "digits-torchserve-mariner"
    ]["spec"]["predictor"]["model"]
    assert model["runtime"] == "kserve-torchserve-mariner"
    assert model["protocolVersion"] in runtime["protocolVersions"]
    # The storage initializer's /mnt/models, from the repository's model-repo.
    mnt = tmp_path / "mnt/models"
    shutil.copytree(K8S / "kserve/model-repo/config", mnt / "config")
    (mnt / "model-store").mkdir()
    args = [a.replace("/mnt/models", str(mnt)) for a in c["args"][1:]]
    launch = parse(args, kserve=True)
    assert launch.action == "start"
    assert launch.foreground
    monkeypatch.chdir(tmp_path)  # no stray ./config.properties or snapshot is read
    env = {"TS_SERVICE_ENVELOPE": ""}  # KServe renders an unset label as empty
    cfg = load_config(list(launch.serve_args), env=env)
    assert cfg.inference_address == "0.0.0.0:8080"
    assert port_of(cfg.management_address) == 8085
    assert str(port_of(cfg.metrics_address)) == str(runtime["annotations"]["prometheus.kserve.io/port"])
    assert cfg.model_snapshot is not None
    assert "digits_torchscript" in cfg.model_snapshot["models"]
    assert not cfg.service_envelope
    assert cfg.kserve_runtime
    assert cfg.disable_token_auth
    check_exposure(cfg)  # starts; `mariner serve` with the same file alone is refused:
    assert_refused(lambda: check_exposure(load_config(["--ts-config", args[-1].split("=", 1)[1],
                                                       "--inference-address", "0.0.0.0:8080",
                                                       "--grpc-inference-address", "0.0.0.0:7070",
                                                       "--grpc-management-address", "0.0.0.0:7071"],
                                                      env=env)))  # fmt: skip


def test_dashboard_covers_the_signals(rendered: dict[str, list[Obj]]) -> None:
    text = (K8S / "monitoring/mariner-dashboard.json").read_text()
    dashboard = json.loads(text)
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for p in panels:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert all(t["expr"] for t in p["targets"]), p["title"]
            assert all(t["refId"] for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "${datasource}"
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(mariner_request_duration_seconds_bucket" in exprs
    for needed in (
        "rate(mariner_requests_total",
        "mariner_queue_depth",
        "mariner_batch_size_bucket",
        "by (code)",
        "mariner_gpu_memory_allocated_bytes",
    ):
        assert needed in exprs, f"the dashboard shows nothing with {needed}"
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"datasource", "namespace", "model"}
    cm = one(rendered, "monitoring", "ConfigMap", "mariner-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["mariner-dashboard.json"]) == dashboard
