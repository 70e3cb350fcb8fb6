"""The locust p99 gate against a live Mariner: a reachable SLO passes, an impossible one fails.

Runs are judged on requests made, never on a clock: every protocol must make MIN_REQUESTS
requests, and the library-mode driver keeps the run going until they are made (its clock only
starts once payloads are prepared and every user is spawned), so a slow machine gives a longer
run, not a different verdict.

Locust runs in library mode in a subprocess (`python -m mariner.loadtest.gate --library`): importing
locust monkey-patches the importing process for gevent, which would leak into every later test
of this pytest session. Mariner runs as users run it, `mariner serve` in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import requests

from mariner.loadtest import oip, payloads
from mariner.loadtest.gate import USER_CLASS_NAMES, fine_bucket_response_time
from mariner.loadtest.servers import MarinerProcess
from mariner.loadtest.slo import Slo, judge

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
MODEL = "digits_torchscript"
RUN_SECONDS = 1
USERS = len(USER_CLASS_NAMES)  # one user per protocol: TorchServe gRPC and REST, OIP gRPC and REST
MIN_REQUESTS = 25  # per protocol; the run lasts until each has made this many
# What each protocol's requests are called in locust's statistics (and in verdict.json).
KINDS = (
    "grpc Predictions",
    f"POST /predictions/{MODEL}",
    "grpc ModelInfer",
    f"POST /v2/models/{MODEL}/infer",
)


@pytest.fixture(scope="module")
def mariner(shared_loadtest_mariner: MarinerProcess) -> MarinerProcess:
    """The session's shared server (tests/integration/conftest.py): these tests only send requests."""
    assert shared_loadtest_mariner.running, shared_loadtest_mariner.log_tail()
    return shared_loadtest_mariner


def run_gate(
    server: MarinerProcess, report_dir: Path, *, p99_ms: float, model: str = MODEL
) -> tuple[int, dict[str, Any]]:
    """One bounded library-mode locust run; (exit code, verdict.json)."""
    cmd = [
        sys.executable, "-m", "mariner.loadtest.gate", "--library",
        "--host", server.http_url, "--grpc-target", server.grpc_target, "--model", model,
        "--users", str(USERS), "--run-time", str(RUN_SECONDS), "--min-requests", str(MIN_REQUESTS),
        "--max-run-time", "400", "--protocols", ",".join(USER_CLASS_NAMES),
        "--p99-ms", str(p99_ms), "--max-fail-ratio", "0.01", "--report-dir", str(report_dir),
    ]  # fmt: skip
    # The timeout only catches a hung driver; the run itself is bounded by requests made.
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500, check=False)
    verdict_path = report_dir / "verdict.json"
    assert verdict_path.exists(), (
        f"no verdict; exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.returncode, json.loads(verdict_path.read_text())


def test_reachable_slo_passes_with_traffic_on_every_protocol(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=2000.0)  # generous: the machine is shared
    assert code == 0, verdict
    assert verdict["passed"] is True
    # Every answer was checked in the user (a digit prediction; for OIP a label tensor equal to
    # the argmax of the logits tensor), so no failure means every answer was a valid prediction.
    assert verdict["failures"] == 0
    by_name = verdict["by_name"]
    assert sorted(by_name) == sorted(KINDS)
    for kind in KINDS:
        assert by_name[kind]["requests"] >= MIN_REQUESTS, (kind, by_name[kind])
        assert by_name[kind]["failures"] == 0, (kind, by_name[kind])
    assert 0 < verdict["p50_ms"] <= verdict["p95_ms"] <= verdict["p99_ms"] <= 2000.0
    # The headless run leaves its reports behind.
    assert (tmp_path / "stats_stats.csv").read_text().count("\n") >= 3
    assert "<html" in (tmp_path / "report.html").read_text()[:2000].lower()


def test_impossible_slo_fails_the_run(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=0.001)  # no round trip takes 1 us
    assert code == 1
    assert verdict["passed"] is False
    assert verdict["failures"] == 0  # it failed on latency alone
    assert any("p99" in r for r in verdict["reasons"]), verdict["reasons"]


def test_failures_over_the_allowed_ratio_fail_the_run(mariner: MarinerProcess, tmp_path: Path) -> None:
    code, verdict = run_gate(mariner, tmp_path, p99_ms=2000.0, model="no_such_model")
    assert code == 1
    assert verdict["fail_ratio"] == 1.0
    assert any("failure ratio" in r for r in verdict["reasons"]), verdict["reasons"]
    # Failed requests still count as requests made: the run ended on the count, every kind ran.
    assert all(
        verdict["by_name"][kind.replace(MODEL, "no_such_model")]["requests"] >= MIN_REQUESTS for kind in KINDS
    )


# -- the OIP users' requests and checks, against the same server -------------------------------------
def test_oip_requests_predict_the_digits_the_torchserve_api_predicts(mariner: MarinerProcess) -> None:
    """The locust OIP users' requests give the same digit over gRPC, REST and TorchServe's API, and
    that digit is (nearly always) the true one: the users send real work, not just any 200."""
    pixels, truth = payloads.test_digits()
    rows = range(20)
    pb2, pb2_grpc = oip.grpc_messages()
    with grpc.insecure_channel(mariner.grpc_target) as channel:
        stub = pb2_grpc.GRPCInferenceServiceStub(channel)
        over_grpc = [
            oip.label_from_grpc(stub.ModelInfer(oip.grpc_request(pb2, MODEL, pixels[i]))) for i in rows
        ]
    over_rest, torchserve = [], []
    with requests.Session() as http:
        for i in rows:
            resp = http.post(
                f"{mariner.http_url}{oip.infer_path(MODEL)}", data=oip.rest_body(pixels[i]), timeout=60
            )
            assert resp.status_code == 200, resp.text
            over_rest.append(oip.label_from_rest(resp.content))
            resp = http.post(
                f"{mariner.http_url}/predictions/{MODEL}", data=payloads.test_digit_bodies()[i], timeout=60
            )
            assert resp.status_code == 200, resp.text
            torchserve.append(json.loads(resp.content)["label"])
    assert over_grpc == over_rest == torchserve
    assert (
        sum(int(a == b) for a, b in zip(over_grpc, truth[:20], strict=True)) >= 18
    )  # the model is ~97% right


def test_oip_answer_checks_refuse_a_label_the_logits_contradict() -> None:
    logits = np.zeros((1, 10), np.float32)
    logits[0, 3] = 5.0

    def rest(label: int, shape: list[int] | None = None) -> bytes:
        outputs = [
            {
                "name": "logits",
                "datatype": "FP32",
                "shape": shape or [1, 10],
                "data": logits.ravel().tolist(),
            },
            {"name": "label", "datatype": "INT64", "shape": [1], "data": [label]},
        ]
        return json.dumps({"model_name": MODEL, "outputs": outputs}).encode()

    assert oip.label_from_rest(rest(3)) == 3
    with pytest.raises(ValueError, match="not the argmax"):
        oip.label_from_rest(rest(4))
    with pytest.raises(ValueError, match="not a v2 infer response"):
        oip.label_from_rest(b'{"predictions": [3]}')
    with pytest.raises(ValueError, match="not a digit"):
        oip.label_from_rest(rest(12))
    pb2 = oip.grpc_messages()[0]
    out = pb2.ModelInferResponse.InferOutputTensor
    answer = pb2.ModelInferResponse(
        outputs=[
            out(name="logits", datatype="FP32", shape=[1, 10]),
            out(name="label", datatype="INT64", shape=[1]),
        ],
        raw_output_contents=[logits.tobytes(), np.array([3], np.int64).tobytes()],
    )
    assert oip.label_from_grpc(answer) == 3
    answer.raw_output_contents[1] = np.array([7], np.int64).tobytes()
    with pytest.raises(ValueError, match="not the argmax"):
        oip.label_from_grpc(answer)


# -- the judgement itself, on locust-shaped statistics -----------------------------------------------
def stats(requests: int, failures: int, p99: float, p50: float = 1.0) -> SimpleNamespace:
    def percentile(q: float) -> float:
        return p99 if q >= 0.99 else p50

    return SimpleNamespace(
        num_requests=requests,
        num_failures=failures,
        fail_ratio=failures / requests if requests else 0.0,
        total_rps=100.0,
        get_response_time_percentile=percentile,
    )


def test_judge_applies_both_limits_and_refuses_an_empty_run() -> None:
    slo = Slo(p99_ms=10.0, max_fail_ratio=0.01)
    assert judge(stats(1000, 10, 10.0), slo).passed  # both exactly at their limits
    assert judge(stats(1000, 11, 5.0), slo).reasons == ("failure ratio 1.10% is over the allowed 1.00%",)
    assert judge(stats(1000, 0, 10.01), slo).reasons == ("p99 10.01 ms is over the SLO of 10 ms",)
    assert not judge(stats(0, 0, 0.0), slo).passed
    assert not judge(stats(1000, 0, 1.0), slo, user_exceptions=1).passed


def test_judge_counts_requests_per_kind() -> None:
    slo = Slo(p99_ms=10.0, min_requests=25)
    enough = {"grpc Predictions": stats(25, 0, 1.0), "POST /predictions/m": stats(30, 0, 1.0)}
    assert judge(stats(55, 0, 1.0), slo, by_name=enough, expected_kinds=2).passed
    short = {**enough, "POST /predictions/m": stats(24, 0, 1.0)}
    assert judge(stats(49, 0, 1.0), slo, by_name=short, expected_kinds=2).reasons == (
        "fewer than 25 requests per kind (POST /predictions/m: 24)",
    )
    # A user class that made no request at all has no entry: it still counts against the run.
    assert judge(stats(30, 0, 1.0), slo, by_name=enough, expected_kinds=3).reasons == (
        "fewer than 25 requests per kind (1 kind(s) with none)",
    )


def test_fine_buckets_keep_sub_millisecond_resolution() -> None:
    assert fine_bucket_response_time(0.437) == 0.44
    assert fine_bucket_response_time(1.4) != fine_bucket_response_time(0.6)
    assert fine_bucket_response_time(42.37) == 42.4
    assert fine_bucket_response_time(147) == 150  # locust's own bucketing above 100 ms
