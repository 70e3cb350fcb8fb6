"""Load, injected faults, overload and SIGTERM on a `mariner serve` process: nothing is lost.

The server serves the fault-injecting archive (tests/integration/fault_archive.py, responseTimeout
2 s) and digits_onnx.mar with a queue of 8 per model. Sixteen client threads on 127.0.0.1 drive
a bounded mix of TorchServe and Open Inference Protocol requests over gRPC and HTTP; an injector
(at most 16 more threads) fires bad_item, raise_batch, oom_batched, hang and exit, and a burst
that overflows the queue; then the process gets SIGTERM. Every answer is classified, and:

- the process exits 0, and its drain accounting (`drained: accepted=N answered=N ok=K`) has
  accepted == answered;
- every request got a success or a documented code, each for its cause: gRPC OK /
  INVALID_ARGUMENT / INTERNAL / RESOURCE_EXHAUSTED / UNAVAILABLE, HTTP 200 / 400 / 500 / 503
  (the table in DESIGN.md); UNAVAILABLE/503 only for a restarting instance or the shutdown,
  RESOURCE_EXHAUSTED only for overload (with Retry-After over HTTP); never DEADLINE_EXCEEDED /
  504: every fault goes to TorchServe's APIs, where, as on TorchServe, responseTimeout bounds a
  batch's run (the hang and its batch-mates: 500 "Worker died."), never a wait in the queue;
- the client's successes equal the server's ok, and its dataplane-level answers equal the
  server's accepted (see `test_load_faults_and_sigterm_lose_nothing` for why these are exact).
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

from mariner.server import protogen
from tests.e2e.serve_process import ServeProcess, drain_totals
from tests.integration.fault_archive import build_fault_archive

pytestmark = pytest.mark.e2e

DIGITS, FAULTY = "digits_onnx", "faulty"
PIXELS = [float(i % 17) for i in range(64)]
TRAFFIC_THREADS = 16  # plus at most INJECTOR_THREADS: 32 in flight at most
INJECTOR_THREADS = 16
MAX_TRAFFIC = 20_000  # requests, all traffic threads together (about 5,000 are sent)
SIGTERM_AFTER = 2200  # answers before the shutdown starts
# Every phase starts after a number of answers, never after a time: a slower machine only makes the
# run longer. The cap turns a server that stopped answering into a failure instead of a hang.
STALL_CAP_S = 600.0
CLIENT_TIMEOUT_S = 60.0  # far beyond any server-side timeout: the client never gives up first

# What each cause of an answer looks like (messages from server/dataplane.py, batcher.py, runner.py).
OVERLOADED = "overloaded"
RESTARTING = "is RESTARTING"  # ModelEndpoint.infer refuses while every instance is being replaced
RESTART_MESSAGES = (RESTARTING, "restarting", "instance stopped before answering", "is not loaded")
SHUTDOWN_REFUSED = "server is shutting down"  # DataPlane.infer, before it accepts the request
SHUTDOWN_ACCEPTED = ("shutting down", "shut down before this request ran")  # accepted, then refused
NOT_SENT = "not sent"  # the connection was refused: the server had stopped listening
# The answers this test may see, gRPC names (HTTP statuses are mapped to them) and HTTP statuses.
DOCUMENTED = {"OK", "INVALID_ARGUMENT", "INTERNAL", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
DOCUMENTED_HTTP = {200, 400, 500, 503}


@dataclass(frozen=True)
class Job:
    transport: str  # grpc | http
    api: str  # ts | oip
    model: str
    op: str = "ok"  # the fault archive's op; "ok" for digits
    value: Any = None


@dataclass
class Outcome:
    job: Job
    code: str  # gRPC status name; HTTP statuses are mapped to the same names
    status: int | None  # the HTTP status
    message: str
    retry_after: str | None
    sent: float
    done: float
    cause: str = ""  # set by classify()


TS_HANDLER_FAILED = "Prediction failed\norg.pytorch.serve.http.InternalServerException"
HTTP_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 500: "INTERNAL", 504: "DEADLINE_EXCEEDED"}


class Client:
    """Sends one Job over its transport and API; thread-safe (one gRPC channel, shared)."""

    def __init__(self, srv: ServeProcess) -> None:
        protogen.generate()
        from mariner.server._proto.inference import grpc_service_pb2, grpc_service_pb2_grpc
        from mariner.server._proto.torchserve import inference_pb2, inference_pb2_grpc

        self.srv = srv
        self.ts_pb, self.oip_pb = inference_pb2, grpc_service_pb2
        self.channel = grpc.insecure_channel(srv.target("grpc"))
        self.ts = inference_pb2_grpc.InferenceAPIsServiceStub(self.channel)
        self.oip = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.pixels_raw = struct.pack("<64f", *PIXELS)

    def close(self) -> None:
        self.channel.close()

    def payload(self, job: Job) -> bytes:
        if job.model == DIGITS:
            return json.dumps(PIXELS).encode()
        return json.dumps({"op": job.op, "value": job.value}).encode()

    def send(self, job: Job) -> Outcome:
        sent = time.monotonic()
        if job.transport == "grpc":
            code, status, message, retry_after = self._grpc(job)
        else:
            code, status, message, retry_after = self._http(job)
        return Outcome(job, code, status, message, retry_after, sent, time.monotonic())

    def _grpc(self, job: Job) -> tuple[str, None, str, None]:
        try:
            if job.api == "ts":
                request = self.ts_pb.PredictionsRequest(
                    model_name=job.model, input={"data": self.payload(job)}
                )
                self.ts.Predictions(request, timeout=CLIENT_TIMEOUT_S)
            else:
                tensor = self.oip_pb.ModelInferRequest.InferInputTensor(
                    name="pixels", datatype="FP32", shape=[1, 64]
                )
                request = self.oip_pb.ModelInferRequest(
                    model_name=job.model, inputs=[tensor], raw_input_contents=[self.pixels_raw]
                )
                reply = self.oip.ModelInfer(request, timeout=CLIENT_TIMEOUT_S)
                assert [o.name for o in reply.outputs] == ["logits", "probabilities", "label"]
        except grpc.RpcError as err:
            details = err.details() or ""
            if err.code() is grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
                return NOT_SENT, None, details, None
            if details.endswith(TS_HANDLER_FAILED):  # TorchServe's answer to a handler that raised
                return "INTERNAL", None, details, None
            return err.code().name, None, details, None
        return "OK", None, "", None

    def _http(self, job: Job) -> tuple[str, int | None, str, str | None]:
        base = self.srv.url("http")
        try:
            if job.api == "ts":
                headers = {"content-type": "application/json"}
                r = requests.post(
                    f"{base}/predictions/{job.model}",
                    data=self.payload(job),
                    headers=headers,
                    timeout=CLIENT_TIMEOUT_S,
                )
            else:
                doc = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64], "data": PIXELS}]}
                r = requests.post(f"{base}/v2/models/{job.model}/infer", json=doc, timeout=CLIENT_TIMEOUT_S)
        except requests.ConnectionError as err:
            # Refused at connect: never sent. Anything else (a reset mid-request) stays a failure.
            refused = "NewConnectionError" in repr(err) or "Connection refused" in str(err)
            return (NOT_SENT if refused else "CONNECTION_LOST"), None, str(err), None
        try:
            body = r.json()
        except ValueError:
            body = {}
        message = str(body.get("message", body.get("error", ""))) if isinstance(body, dict) else ""
        code = HTTP_CODES.get(r.status_code, f"HTTP_{r.status_code}")
        if r.status_code == 503 and isinstance(body, dict) and body.get("type") == "InternalServerException":
            code = "INTERNAL"  # TorchServe's answer to a handler that raised ("Prediction failed")
        elif r.status_code == 503:
            code = "RESOURCE_EXHAUSTED" if OVERLOADED in message else "UNAVAILABLE"
        if code == "OK" and job.api == "oip":
            assert [o["name"] for o in r.json()["outputs"]] == ["logits", "probabilities", "label"]
        return code, r.status_code, message, r.headers.get("retry-after")


def classify(o: Outcome, sigterm_at: float | None) -> str:
    """The cause of an answer, or 'VIOLATION: ...' when the answer is not one the design allows."""
    job, code, msg = o.job, o.code, o.message
    after_sigterm = sigterm_at is not None and o.done >= sigterm_at
    faulty = job.model == FAULTY
    if code == "OK":
        return "ok"
    if code == NOT_SENT:
        return "not sent" if after_sigterm else f"VIOLATION: connection refused before SIGTERM: {msg}"
    if code == "INVALID_ARGUMENT" and job.op == "bad_item":
        return "bad item"
    if code == "INTERNAL" and faulty:
        # a raise_batch request or one batched with it; on TorchServe's endpoints also the hang
        # and its batch-mates (TorchServe answers a response timeout 500 "Worker died.")
        return "batch failed"
    if code == "RESOURCE_EXHAUSTED" and OVERLOADED in msg:
        if o.status is not None and o.retry_after != "1":
            return f"VIOLATION: overloaded without Retry-After: 1 ({o.retry_after!r})"
        return "overload"
    if code == "UNAVAILABLE":
        if after_sigterm and SHUTDOWN_REFUSED in msg:
            return "shutdown, refused"
        if after_sigterm and any(m in msg for m in SHUTDOWN_ACCEPTED):
            return "shutdown, accepted"
        if faulty and any(m in msg for m in RESTART_MESSAGES):
            return "restart"
    return f"VIOLATION: {job.transport} {job.api} {job.model} {job.op} -> {code} {o.status}: {msg[:200]!r}"


class Load:
    """The traffic threads, the injector and the shared record of outcomes."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.tickets = itertools.count()
        self.sigterm_at: float | None = None
        self.give_up = time.monotonic() + STALL_CAP_S
        self.stalled = threading.Event()  # set when the cap passed: every client thread stops

    @property
    def answered(self) -> int:
        return len(self.outcomes)

    def record(self, outcome: Outcome) -> Outcome:
        outcome.cause = classify(outcome, self.sigterm_at)
        with self.lock:
            self.outcomes.append(outcome)
        return outcome

    @staticmethod
    def traffic_job(i: int) -> Job:
        """A fixed mix: 70% digits (both APIs, both transports), 30% the fault archive's ok/sleep."""
        transport = "grpc" if i % 2 else "http"
        slot = i % 10
        if slot < 5:
            return Job(transport, "ts", DIGITS)
        if slot < 7:
            return Job(transport, "oip", DIGITS)
        if slot < 9:
            return Job(transport, "ts", FAULTY, "ok", i)
        return Job(transport, "ts", FAULTY, "sleep", 0.02)

    def traffic(self) -> None:
        while not self.stalled.is_set():
            i = next(self.tickets)
            if i >= MAX_TRAFFIC:
                return
            outcome = self.record(self.client.send(self.traffic_job(i)))
            if outcome.cause in ("shutdown, refused", "not sent"):
                return  # this client saw the shutdown: it would go to another replica now

    def inject(self, job: Job) -> Outcome:
        """Send a fault until the server takes it: not refused for overload, nor while restarting."""
        refusals: Counter[str] = Counter()
        for _ in range(200):
            outcome = self.record(self.client.send(job))
            if not (outcome.cause == "overload" or RESTARTING in outcome.message):
                return outcome
            refusals[outcome.message] += 1
            time.sleep(0.05)
        raise AssertionError(f"the server never took {job}: {refusals}")

    def wait_for(self, answered: int) -> None:
        """Until `answered` answers came back (an event), however long a slow machine takes."""
        while self.answered < answered:
            if time.monotonic() > self.give_up:
                self.stalled.set()
                raise AssertionError(f"{self.answered} of {answered} answers after {STALL_CAP_S:.0f} s")
            time.sleep(0.01)

    def wait_model_ready(self, model: str) -> None:
        """Until the model reports ready (OIP model ready, an event), capped like wait_for."""
        url = f"{self.client.srv.url('http')}/v2/models/{model}/ready"
        while requests.get(url, timeout=CLIENT_TIMEOUT_S).status_code != 200:
            if time.monotonic() > self.give_up:
                self.stalled.set()
                raise AssertionError(f"model {model} not ready again after {STALL_CAP_S:.0f} s")
            time.sleep(0.05)

    def injector(self, pool: ThreadPoolExecutor) -> dict[str, list[Outcome]]:
        """The fault schedule, over both transports, each fault after some traffic."""

        def together(jobs: list[Job]) -> list[Outcome]:
            return list(pool.map(self.inject, jobs))

        faults: dict[str, list[Outcome]] = {}
        self.wait_for(200)
        faults["bad_item"] = together([Job("http", "ts", FAULTY, "bad_item", i) for i in range(2)]
                                      + [Job("grpc", "ts", FAULTY, "bad_item", 2)])  # fmt: skip
        self.wait_for(400)
        faults["raise_batch"] = together([Job("grpc", "ts", FAULTY, "raise_batch"),
                                          Job("http", "ts", FAULTY, "raise_batch")])  # fmt: skip
        self.wait_for(600)
        faults["oom_batched"] = together([Job("grpc" if i % 2 else "http", "ts", FAULTY, "oom_batched", i)
                                          for i in range(6)])  # fmt: skip
        self.wait_for(800)
        faults["hang"] = together([Job("http", "ts", FAULTY, "hang")])
        self.wait_for(1200)
        faults["exit"] = together([Job("grpc", "ts", FAULTY, "exit")])
        self.wait_for(1500)
        # The burst is about the queue: it waits until the exited worker is back (a new process,
        # which takes a while), or it would only be refused as restarting.
        self.wait_model_ready(FAULTY)
        burst = [
            Job("grpc" if i % 2 else "http", "ts", FAULTY, "sleep", 0.2) for i in range(INJECTOR_THREADS)
        ]
        faults["overload burst"] = list(pool.map(lambda j: self.record(self.client.send(j)), burst))
        return faults


def metric(srv: ServeProcess, name: str, **labels: str) -> float:
    text = requests.get(f"{srv.url('metrics')}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


@pytest.fixture
def store(model_store: Path, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    build_fault_archive(store, name=FAULTY, response_timeout_s=2)
    shutil.copy(model_store / f"{DIGITS}.mar", store / f"{DIGITS}.mar")
    return store


def test_load_faults_and_sigterm_lose_nothing(store: Path, tmp_path: Path) -> None:
    srv = ServeProcess(store, f"{FAULTY}.mar,{DIGITS}.mar", tmp_path / "serve.log", ["--max-queue", "8"])
    client: Client | None = None
    try:
        srv.wait_ready()
        client = Client(srv)
        load = Load(client)
        with (
            ThreadPoolExecutor(TRAFFIC_THREADS, thread_name_prefix="traffic") as traffic,
            ThreadPoolExecutor(INJECTOR_THREADS, thread_name_prefix="injector") as injector_pool,
        ):
            workers = [traffic.submit(load.traffic) for _ in range(TRAFFIC_THREADS)]
            faults = load.injector(injector_pool)
            load.wait_for(SIGTERM_AFTER)
            splits = metric(srv, "mariner_oom_batch_splits_total")
            restarts = {
                r: metric(srv, "mariner_instance_restarts_total", reason=r) for r in ("hung", "failed")
            }
            load.sigterm_at = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rc = srv.proc.wait(60)
            for w in workers:
                w.result(timeout=CLIENT_TIMEOUT_S)  # re-raises a client thread's failure
        log = srv.log_path.read_text()
    finally:
        if client is not None:
            client.close()
        srv.kill()

    outcomes = load.outcomes
    causes = Counter(o.cause for o in outcomes)
    codes = Counter((o.job.transport, o.code) for o in outcomes)
    report = f"causes: {dict(causes)}\ncodes: {dict(codes)}"

    assert rc == 0, log[-3000:]
    accepted, answered, ok, frontends = drain_totals(log)  # summed over the frontends
    assert frontends >= 1, log[-3000:]
    drained = f"drained over {frontends} frontends: accepted={accepted} answered={answered} ok={ok}"
    assert accepted == answered, drained
    print(f"{drained}\n{report}")  # shown with -s, and on failure

    # Every request got a success or a documented code, for a cause the design allows.
    violations = [o.cause for o in outcomes if o.cause.startswith("VIOLATION")]
    assert not violations, "\n".join(violations[:20]) + "\n" + report
    assert {code for _, code in codes} <= {*DOCUMENTED, NOT_SENT}, report
    assert {o.status for o in outcomes if o.status is not None} <= DOCUMENTED_HTTP, report
    assert sum(o.code != NOT_SENT for o in outcomes) >= SIGTERM_AFTER, report

    # Exact accounting, both ways. DataPlane.infer counts `accepted` once the model resolved and
    # no drain had begun, `answered` when an accepted request's answer (whatever it is) comes
    # back, and `ok` when that answer's per-request status is 200. Every request here is
    # well-formed, so the only answers given without accepting are the drain's "server is
    # shutting down" refusals, and connections refused after the listeners closed reach no
    # DataPlane at all. Each accepted request's answer reaches its client: the client's timeout
    # (60 s) is beyond any server-side one (responseTimeout 2 s and 30 s), no client goes away,
    # and the drain waits for every accepted request before the listeners close (a lost answer
    # would show as CONNECTION_LOST or an undocumented gRPC code, refused above). A client
    # success is exactly an accepted request with status 200: bad_item's per-item 400 is not ok
    # on either side, and nothing after the DataPlane (TorchServe bytes, OIP outputs of a good
    # digits answer) fails. Hence both equalities are exact.
    client_ok = causes["ok"]
    assert client_ok == ok, (client_ok, drained, report)
    admitted = sum(1 for o in outcomes if o.cause not in ("shutdown, refused", "not sent"))
    assert admitted == accepted, (admitted, drained, report)

    # The faults happened, and did what they should.
    assert [o.code for o in faults["bad_item"]] == ["INVALID_ARGUMENT"] * 3, faults["bad_item"]
    assert [o.code for o in faults["raise_batch"]] == ["INTERNAL"] * 2, faults["raise_batch"]
    assert all("secret" not in o.message for o in faults["raise_batch"])
    assert [o.code for o in faults["oom_batched"]] == ["OK"] * 6, faults["oom_batched"]
    assert splits >= 1, "no batch was split after running out of memory"
    # The hang is a TorchServe HTTP call: past responseTimeout TorchServe answers 500 "Worker died."
    # (so are its batch-mates, "batch failed"); what queued behind it waits for the new worker.
    assert [(o.code, o.status, o.message) for o in faults["hang"]] == [("INTERNAL", 500, "Worker died.")], (
        faults["hang"]
    )
    assert [o.code for o in faults["exit"]] == ["UNAVAILABLE"], faults["exit"]
    assert restarts == {"hung": 1, "failed": 1}, restarts
    assert causes["overload"] >= 1, report
    assert any(o.cause == "overload" for o in faults["overload burst"]), faults["overload burst"]
    assert causes["restart"] >= 1, report
    assert causes["shutdown, refused"] >= 1, report  # new calls during the drain were refused
    digits_failures = Counter(o.cause for o in outcomes if o.job.model == DIGITS and o.cause != "ok")
    assert set(digits_failures) <= {"overload", "shutdown, refused", "shutdown, accepted", "not sent"}, (
        digits_failures
    )
