"""TorchServe's log files, console and lifecycle lines from a real `mariner serve`: the five
files with TorchServe's formats, a worker's output on the console once, "Model server started.",
a response timeout answered as TorchServe answers it (500 "Worker died." on its endpoints, 504
on KServe's) with TorchServe's recovery lines, a failed start's traceback on every retry,
startupTimeout, and the console turned off.

Nothing here waits on the machine's speed: a stuck handler blocks until the test releases it
(a file), one that never finishes initialising blocks forever, and every wait is for a line or a
state, capped only so that a broken server fails instead of hanging.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import requests

from mariner.server import protogen
from tests.integration.fault_archive import write_handler_archive
from tests.mariner_serve import MarinerServe

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CAP_S = 120.0  # a broken server fails the test after this; a working one answers at once
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}"

CHATTY = """
import json
import sys


class Chatty:
    def initialize(self, context):
        print("chatty initialize says hello")

    def handle(self, data, context):
        print(f"chatty handles {len(data)}")
        print("chatty warns on stderr", file=sys.stderr)
        context.metrics.add_time("HandlerTime", 1.5)
        return [json.dumps({"ok": True}) for _ in data]
"""

STUCK = """
import json
import os
import time


class Stuck:
    def initialize(self, context):
        pass

    def handle(self, data, context):
        release = data[0].get("body") or data[0].get("data")
        release = release.decode() if isinstance(release, (bytes, bytearray)) else str(release)
        while not os.path.exists(release):  # blocks until the test releases it
            time.sleep(0.02)
        return [json.dumps({"released": True}) for _ in data]
"""

FAILING = """
class Failing:
    def initialize(self, context):
        self.first()

    def first(self):
        self.second()

    def second(self):
        assert False

    def handle(self, data, context):
        return data
"""

NEVER_READY = """
import threading


class NeverReady:
    def initialize(self, context):
        threading.Event().wait()  # never returns

    def handle(self, data, context):
        return data
"""


def wait_for(what: Callable[[], object], why: str) -> object:
    end = time.monotonic() + CAP_S
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.05)
    pytest.fail(f"{why} (waited {CAP_S:.0f} s)")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    store = tmp_path_factory.mktemp("store")
    config = "minWorkers: 1\nmaxWorkers: 1\nbatchSize: 1\nmaxBatchDelay: 0\n"
    for name, handler, extra in (
        ("chatty", CHATTY, ""),
        ("stuck", STUCK, "responseTimeout: 2\n"),
        ("failing", FAILING, ""),
        ("never", NEVER_READY, "startupTimeout: 1\n"),
    ):
        files = {f"{name}.py": handler, "model-config.yaml": config + extra}
        write_handler_archive(store / f"{name}.mar", name, f"{name}.py", files)
    srv = MarinerServe(store, "chatty.mar,stuck.mar", enable_model_management=True).start()
    yield srv
    srv.stop()


def test_torchserves_five_files_and_its_console(server: MarinerServe) -> None:
    logs = server.log_location
    for name in ("ts_log", "model_log", "access_log", "ts_metrics", "model_metrics"):
        assert (logs / f"{name}.log").is_file(), f"{name}.log was not created"
    r = requests.post(f"{server.http}/predictions/chatty", data=b"{}", timeout=30)
    assert r.status_code == 200, r.text
    model_log = logs / "model_log.log"
    line = wait_for(
        lambda: re.search(
            rf"^{STAMP} \[INFO \] W-\d+-chatty_1\.0-stdout MODEL_LOG - chatty handles 1$",
            read(model_log),
            re.M,
        ),  # fmt: skip
        "the handler's print() never reached model_log.log",
    )
    assert re.search(
        r"\[WARN \] W-\d+-chatty_1\.0-stderr MODEL_LOG - chatty warns on stderr", read(model_log)
    )
    assert "chatty initialize says hello" in read(model_log)
    access = wait_for(lambda: read(logs / "access_log.log"), "no access line")
    assert re.search(
        rf'^{STAMP} - /127\.0\.0\.1:\d+ "POST /predictions/chatty HTTP/1\.1" 200 \d+$', access, re.M
    )
    ts_metrics = wait_for(
        lambda: "ts_inference_requests_total" in read(logs / "ts_metrics.log"), "no metrics"
    )
    assert ts_metrics
    metrics_text = read(logs / "ts_metrics.log")
    assert re.search(
        rf"^{STAMP} - ts_inference_requests_total\.Count:1\.0\|#model_name:chatty,model_version:default\|"
        r"#hostname:[^,]+,timestamp:\d+$",
        metrics_text,
        re.M,
    )
    assert re.search(r"- CPUUtilization\.Percent:", metrics_text)  # host metrics sampled at start
    wait_for(lambda: "HandlerTime" in read(logs / "model_metrics.log"), "no handler metric")
    assert re.search(
        r"- HandlerTime\.ms:1\.5\|#ModelName:chatty,Level:Model\|#hostname:", read(logs / "model_metrics.log")
    )
    # The console (stdout and stderr of `mariner serve`): TorchServe's lines, each once.
    console = server.log_text()
    assert console.count("Model server started.\n") == 1
    assert re.search(r"^Model server started\.$", console, re.M)
    assert console.count("chatty handles 1") == 1  # not again as a JSON line
    assert isinstance(line, re.Match)
    assert line.group(0) in console


def test_a_response_timeout_is_answered_as_torchserve_answers_it(
    server: MarinerServe, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    r = requests.post(f"{server.http}/predictions/stuck", data=str(release).encode(), timeout=60)
    release.touch()
    assert r.status_code == 500
    assert r.json() == {"code": 500, "type": "InternalServerException", "message": "Worker died."}
    ts_log = server.log_location / "ts_log.log"
    lines = wait_for(
        lambda: "Auto recovery succeeded, reset recoveryStartTS" in read(ts_log) and read(ts_log),
        "the worker never recovered",
    )
    assert isinstance(lines, str)
    said = [
        line.split(" - ", 1)[1] for line in lines.splitlines() if "org.pytorch.serve.wlm.WorkerThread" in line
    ]
    assert "Number or consecutive unsuccessful inference 1" in said
    assert re.search(
        r"Backend worker error\norg\.pytorch\.serve\.wlm\.WorkerInitializationException: "
        r"Backend worker did not respond in given time\n",
        lines,
    )
    assert any(re.fullmatch(r"\d+ Worker disconnected\. WORKER_MODEL_LOADED", s) for s in said)
    assert any(re.fullmatch(r"Auto recovery start timestamp: \d+", s) for s in said)
    assert any(re.fullmatch(r"Retry worker: \d+ in [\d.]+ seconds\.", s) for s in said)
    # The same over TorchServe's gRPC API; KServe's v1 API keeps its 504.
    server.wait_http_ok(f"{server.http}/v2/models/stuck/ready", CAP_S)  # the new worker serves
    second = tmp_path / "second"
    protogen.generate()
    from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="stuck", input={"data": str(second).encode()})
        with pytest.raises(grpc.RpcError) as info:
            stub.Predictions(request, timeout=60)
    second.touch()
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details().splitlines()[0] == "Worker died."
    wait_for(lambda: read(ts_log).count("Auto recovery succeeded") >= 2, "no second recovery")
    server.wait_http_ok(f"{server.http}/v2/models/stuck/ready", CAP_S)
    third = tmp_path / "third"
    kserve = {"instances": [{"data": str(third)}]}
    r = requests.post(f"{server.http}/v1/models/stuck:predict", json=kserve, timeout=60)
    third.touch()
    assert r.status_code == 504, r.text
    assert "responseTimeout" in r.json()["error"]


def test_a_failed_start_prints_its_traceback_on_every_retry(server: MarinerServe) -> None:
    r = requests.post(
        f"{server.management}/models",
        params={"url": "failing.mar", "initial_workers": "1", "synchronous": "false"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    model_log = server.log_location / "model_log.log"
    wait_for(lambda: read(model_log).count("AssertionError") >= 3, "fewer than three attempts")
    text = read(model_log)
    for attempt in text.split("AssertionError")[:3]:  # each attempt: the whole traceback first
        assert "Traceback (most recent call last):" in attempt
        assert "in first" in attempt
        assert "self.second()" in attempt
        assert "assert False" in attempt
    # Mariner's JSON log says it in its own words and points at the traceback (not repeated).
    json_lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    failed = [j["msg"] for j in json_lines if "failing" in j["msg"] and "failed to start" in j["msg"]]
    assert failed
    assert not any("AssertionError" in m for m in failed)
    worker = server.describe("failing")[0]["workers"][0]
    assert worker["status"] == "FAILED"  # and it keeps retrying (the async register keeps it)
    requests.delete(f"{server.management}/models/failing", timeout=30)


def test_startup_timeout_kills_and_retries_a_worker_that_never_gets_ready(server: MarinerServe) -> None:
    r = requests.post(
        f"{server.management}/models",
        params={"url": "never.mar", "initial_workers": "1", "synchronous": "false"},
        timeout=30,
    )
    assert r.status_code == 202, r.text
    assert server.describe("never")[0]["startupTimeout"] == 1
    wait_for(
        lambda: re.search(
            r"W-\d+-never_1\.0 org\.pytorch\.serve\.wlm\.WorkerThread - Backend worker error\n"
            r"org\.pytorch\.serve\.wlm\.WorkerInitializationException: "
            r"Backend worker did not respond in given time",
            server.log_text(),
        ),
        "no 'Backend worker error' for the worker past its startupTimeout",
    )
    wait_for(lambda: re.search(r"W-\d+-never_1\.0 .* Retry worker: \d+ in", server.log_text()), "no retry")
    requests.delete(f"{server.management}/models/never", timeout=30)


def test_with_the_console_off_worker_output_goes_to_the_json_log(tmp_path: Path) -> None:
    store = tmp_path / "store"
    files = {"chatty.py": CHATTY, "model-config.yaml": "minWorkers: 1\nmaxWorkers: 1\n"}
    write_handler_archive(store / "chatty.mar", "chatty", "chatty.py", files)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    metrics_dir = tmp_path / "metrics"
    srv = MarinerServe(
        store,
        "chatty.mar",
        ts_console=False,
        metrics_mode="prometheus",
        env={"LOG_LOCATION": str(blocked / "logs"), "METRICS_LOCATION": str(metrics_dir)},
    ).start()
    try:
        r = requests.post(f"{srv.http}/predictions/chatty", data=b"{}", timeout=30)
        assert r.status_code == 200
        found = wait_for(
            lambda: [
                j
                for j in (json.loads(x) for x in srv.log_text().splitlines() if x.startswith("{"))
                if j.get("logger") == "MODEL_LOG" and j["msg"] == "chatty handles 1"
            ],
            "the handler's print() never reached the JSON log",
        )
        assert isinstance(found, list)
        assert re.fullmatch(r"W-\d+-chatty_1\.0-stdout", found[0]["worker"])
        console = srv.log_text()
        assert "Model server started." not in console
        assert "[INFO ]" not in console  # no TorchServe pattern lines on stdout
        # The log location cannot be written: those files are left out, the server serves on.
        assert not (blocked / "logs").exists()
        assert sorted(p.name for p in metrics_dir.iterdir()) == ["model_metrics.log", "ts_metrics.log"]
        # prometheus mode: TorchServe's names on /metrics as its Java client writes them, and
        # nothing of them in its metric log.
        text = requests.get(f"{srv.metrics}/metrics", timeout=30).text
        assert re.search(r'^Requests2XX\{Level="Host",Hostname="[^"]+",\} \d+\.\d+$', text, re.M)
        assert read(metrics_dir / "ts_metrics.log") == ""
    finally:
        srv.stop()
