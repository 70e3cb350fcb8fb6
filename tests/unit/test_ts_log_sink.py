"""Where each of TorchServe's log records goes (its files, the console, the JSON log), how a
worker's output and `[METRICS]` lines are read, TorchServe's lifecycle sentences, the access
log middleware, and the config keys that steer them."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mariner.server.common.metrics_spec import DEFAULT_FRONTEND, MetricSpec, TsMetricsSpec
from mariner.server.compat.torchserve.logs import words
from mariner.server.compat.torchserve.logs.access import HttpAccessLog
from mariner.server.compat.torchserve.logs.records import Kind, Record
from mariner.server.compat.torchserve.logs.sink import LogSettings, LogSink
from mariner.server.compat.torchserve.logs.worker_output import BackendMetrics
from mariner.server.compat.torchserve.properties import from_torchserve_properties
from tests.unit.ts_logs_support import captured, read_available

__all__ = ["captured"]  # the fixture, used by name

pytestmark = pytest.mark.unit

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}"


def _read(fd: int) -> str:
    return read_available(fd).decode()


@pytest.fixture
def pipes() -> Iterator[tuple[int, int, int, int]]:
    """(stdout read, stdout write, stderr read, stderr write) standing in for the console."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    yield out_r, out_w, err_r, err_w
    for fd in (out_r, out_w, err_r, err_w):
        os.close(fd)


def _records() -> list[Record]:
    now = time.time()
    worker, out = "W-9000-m_1.0", "W-9000-m_1.0-stdout"
    return [
        Record(Kind.TS, now, "INFO", worker, words.WORKER_THREAD, "Retry worker: 9000 in 1 seconds."),
        Record(Kind.SERVER, now, "INFO", "supervisor", "mariner.supervisor", "models ready: m:1.0"),
        Record(Kind.MODEL_LOG, now, "INFO", out, words.MODEL_LOG, "print from handler"),
        Record(Kind.ACCESS, now, "INFO", "frontend-0", words.ACCESS_LOG, ACCESS),
        Record(Kind.TS_METRICS, now, "INFO", "frontend", words.TS_METRICS, TS_METRIC),
        Record(Kind.MODEL_METRICS, now, "INFO", out, words.MODEL_METRICS, MODEL_METRIC),
        Record(Kind.CONSOLE, now, "INFO", "main", "", words.SERVER_STARTED),
    ]


ACCESS = '/127.0.0.1:1 "GET /ping HTTP/1.1" 200 0'
TS_METRIC = "Requests2XX.Count:1.0|#Level:Host|#hostname:h,timestamp:1"
MODEL_METRIC = "HandlerTime.ms:1.0|#ModelName:m|#hostname:h,requestID:null,timestamp:1"


def test_every_record_goes_where_torchserves_log4j_sends_it(tmp_path: Path, pipes: tuple[int, ...]) -> None:
    out_r, out_w, err_r, err_w = pipes
    sink = LogSink(LogSettings(tmp_path / "logs", tmp_path / "metrics"), stdout_fd=out_w, stderr_fd=err_w)
    sink.start()
    for record in _records():
        sink.put(record)
    sink.close()
    logs, metrics = tmp_path / "logs", tmp_path / "metrics"
    assert sorted(p.name for p in logs.iterdir()) == ["access_log.log", "model_log.log", "ts_log.log"]
    assert sorted(p.name for p in metrics.iterdir()) == ["model_metrics.log", "ts_metrics.log"]
    ts_log = (logs / "ts_log.log").read_text()
    assert re.search(
        rf"^{STAMP} \[INFO \] W-9000-m_1.0 org.pytorch.serve.wlm.WorkerThread - Retry worker", ts_log, re.M
    )
    assert "mariner.supervisor - models ready" in ts_log  # the server's own records, for operators
    assert "MODEL_LOG - print from handler" in ts_log
    assert "ACCESS_LOG - /127.0.0.1:1" in ts_log
    assert re.fullmatch(rf"{STAMP} \[INFO \] W-9000-m_1.0-stdout MODEL_LOG - print from handler\n",
                        (logs / "model_log.log").read_text())  # fmt: skip
    assert re.fullmatch(
        rf'{STAMP} - /127.0.0.1:1 "GET /ping HTTP/1.1" 200 0\n', (logs / "access_log.log").read_text()
    )
    assert re.fullmatch(rf"{STAMP} - Requests2XX\.Count:1\.0\|#Level:Host\|#hostname:h,timestamp:1\n",
                        (metrics / "ts_metrics.log").read_text())  # fmt: skip
    assert "HandlerTime.ms:1.0" in (metrics / "model_metrics.log").read_text()
    console = _read(out_r)
    assert "Model server started.\n" in console.splitlines(keepends=True)  # bare, as TorchServe prints it
    assert "Retry worker" in console
    assert "print from handler" in console
    assert "Requests2XX" in console
    assert "models ready" not in console  # already on stderr as JSON: not printed twice
    assert _read(err_r) == ""


def test_with_the_console_off_a_worker_line_reaches_the_json_log_once(
    tmp_path: Path, pipes: tuple[int, ...]
) -> None:
    out_r, out_w, err_r, err_w = pipes
    settings = LogSettings(tmp_path, tmp_path, console=False)
    sink = LogSink(settings, stdout_fd=out_w, stderr_fd=err_w)
    sink.start()
    for record in _records():
        sink.put(record)
    sink.close()
    assert _read(out_r) == ""
    lines = [json.loads(line) for line in _read(err_r).splitlines()]
    assert lines == [
        {"ts": lines[0]["ts"], "level": "INFO", "logger": "MODEL_LOG", "worker": "W-9000-m_1.0-stdout",
         "msg": "print from handler"}
    ]  # fmt: skip
    assert "print from handler" in (tmp_path / "model_log.log").read_text()


def test_an_unwritable_location_leaves_its_files_out_and_the_rest_written(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory should be")
    out_r, out_w = os.pipe()
    try:
        sink = LogSink(LogSettings(blocked / "logs", tmp_path / "metrics"), stdout_fd=out_w)
        sink.start()
        for record in _records():
            sink.put(record)
        sink.close()
        assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == [
            "model_metrics.log",
            "ts_metrics.log",
        ]
        assert "Retry worker" in _read(out_r)  # the console goes on
    finally:
        os.close(out_r)
        os.close(out_w)


def test_log_settings_read_torchserves_locations(tmp_path: Path) -> None:
    settings = LogSettings.from_env(
        {"LOG_LOCATION": str(tmp_path / "a"), "METRICS_LOCATION": str(tmp_path / "b")}
    )
    assert (settings.log_dir, settings.metrics_dir) == (tmp_path / "a", tmp_path / "b")
    assert LogSettings.from_env({}).log_dir == Path("logs")


def _spec() -> TsMetricsSpec:
    model = (MetricSpec("HandlerTime", "gauge", "ms", ("ModelName", "Level")),)
    return TsMetricsSpec(DEFAULT_FRONTEND, model)


def test_handler_metrics_are_kept_as_metrics_yaml_and_the_mode_say() -> None:
    line = "HandlerTime.Milliseconds:2.5|#ModelName:m,Level:Model|#type:GAUGE|#hostname:h,1714"
    undeclared = "HandlerMethodTime.Milliseconds:1.0|#MethodName:pre|#type:GAUGE|#hostname:h,1714"
    logged = BackendMetrics(_spec(), "log", auto_detect=False)
    message = logged.message(line)
    assert message is not None
    assert message.startswith("HandlerTime.ms:2.5|#ModelName:m,Level:Model|#hostname:h,")
    assert logged.message(undeclared) is None  # not declared: dropped, as TorchServe drops it
    detected = BackendMetrics(_spec(), "legacy", auto_detect=True).message(undeclared)
    assert detected is not None
    assert detected.startswith("HandlerMethodTime.Milliseconds:1.0|#MethodName:pre|")
    assert BackendMetrics(_spec(), "prometheus", auto_detect=True).message(line) is None


def test_recovery_lines_are_torchserves(captured: list[Record]) -> None:
    recovery = words.Recovery(9000, "tp_model", "1.0")
    recovery.loaded()  # healthy: nothing to say
    recovery.stopped("WORKER_MODEL_LOADED")
    recovery.retry(0.2)
    recovery.stopped("WORKER_STARTED")
    recovery.loaded()
    words.worker_timed_out("W-9000-tp_model_1.0", 1)
    said = [r.message for r in captured]
    assert said[0] == "9000 Worker disconnected. WORKER_MODEL_LOADED"
    assert re.fullmatch(r"Auto recovery start timestamp: \d{13}", said[1])
    assert said[2:6] == [
        "Retry worker: 9000 in 0.2 seconds.",
        "9000 Worker disconnected. WORKER_STARTED",
        "Auto recovery failed again",
        "Auto recovery succeeded, reset recoveryStartTS",
    ]
    assert said[6] == "Number or consecutive unsuccessful inference 1"
    # One record: the exception is always the very next line after "Backend worker error".
    assert said[7].splitlines() == [
        "Backend worker error",
        "org.pytorch.serve.wlm.WorkerInitializationException: Backend worker did not respond in given time",
    ]
    assert {r.thread for r in captured} == {"W-9000-tp_model_1.0"}


def test_access_middleware_writes_one_line_per_answered_request(captured: list[Record]) -> None:
    async def app(scope: dict, receive: object, send: object) -> None:
        await send({"type": "http.response.start", "status": 404, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

    async def send(message: object) -> None:
        pass

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/predictions/m",
        "raw_path": b"/predictions/m",
        "query_string": b"a=1",
        "http_version": "1.1",
        "client": ("127.0.0.1", 5555),
    }
    asyncio.run(HttpAccessLog(app, "frontend-0")(scope, None, send))  # type: ignore[arg-type]
    assert [(r.kind, r.logger, r.thread) for r in captured] == [(Kind.ACCESS, "ACCESS_LOG", "frontend-0")]
    assert re.fullmatch(
        r'/127\.0\.0\.1:5555 "POST /predictions/m\?a=1 HTTP/1\.1" 404 \d+', captured[0].message
    )


def test_config_properties_keys_of_logs_and_metrics(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        mapped = from_torchserve_properties(
            {
                "metrics_mode": " Legacy ",
                "async_logging": "2",
                "model_metrics_auto_detect": "true",
                "disable_system_metrics": "TRUE",
                "metric_time_interval": "15",
            }
        )
    assert mapped["metrics_mode"] == "legacy"
    assert mapped["async_logging"] is False  # TorchServe's parseBoolean: its default, with a warning
    assert mapped["model_metrics_auto_detect"] is True
    assert mapped["disable_system_metrics"] is True
    assert mapped["metric_time_interval"] == 15
    assert "async_logging=2 is not true or false" in caplog.text
    assert "not used by Mariner" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert from_torchserve_properties({"metrics_mode": "statsd"})["metrics_mode"] == "log"
    assert "metrics_mode=statsd" in caplog.text
    with pytest.raises(ValueError, match="metric_time_interval"):
        from_torchserve_properties({"metric_time_interval": "soon"})
