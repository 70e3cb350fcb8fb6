"""TorchServe's log line formats, the size-bounded log file, the bounded line reader of child
output and the record wire between a frontend and the supervisor."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from mariner.server.compat.torchserve.logs.files import RotatingFile
from mariner.server.compat.torchserve.logs.lines import (
    Clock,
    access_message,
    java_double,
    metric_message,
    model_metric_message,
    parse_backend_metric,
    pattern_line,
    plain_line,
    remote_address,
    safe_text,
)
from mariner.server.compat.torchserve.logs.pump import LineReader, OutputPump
from mariner.server.compat.torchserve.logs.records import Kind, Record, RecordPipe, decode, encode
from mariner.server.compat.torchserve.logs.sink import LogSettings, LogSink
from tests.unit.ts_logs_support import read_available

pytestmark = pytest.mark.unit

ISO8601 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3}"


def test_lines_follow_torchserves_log4j_patterns() -> None:
    t = time.mktime((2024, 5, 1, 12, 0, 0, 0, 0, -1)) + 0.123
    stamp = Clock().stamp(t)
    assert stamp == "2024-05-01T12:00:00,123"  # log4j's ISO8601: local time, comma, milliseconds
    assert (
        pattern_line(stamp, "INFO", "W-9000-mnist_1.0-stdout", "MODEL_LOG", "hello")
        == "2024-05-01T12:00:00,123 [INFO ] W-9000-mnist_1.0-stdout MODEL_LOG - hello\n"
    )
    assert pattern_line(stamp, "ERROR", "t", "c", "m").startswith(f"{stamp} [ERROR] t c - m")
    assert plain_line(stamp, "Requests2XX.Count:1.0") == f"{stamp} - Requests2XX.Count:1.0\n"


def test_access_line_is_torchserves_session_line_and_cannot_forge_lines() -> None:
    remote = remote_address(("127.0.0.1", 51234))
    line = access_message(remote, "POST", "/predictions/mnist?x=1", "HTTP/1.1", 200, 12)
    assert line == '/127.0.0.1:51234 "POST /predictions/mnist?x=1 HTTP/1.1" 200 12'
    forged = access_message(remote, "GET", "/ping\n2024 [INFO ] fake", "HTTP/1.1", 404, 0)
    assert "\n" not in forged
    assert "\\x0a" in forged
    assert len(safe_text("a" * 10_000)) < 4200
    assert remote_address(None) == "127.0.0.1"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1, "1.0"),
        (12.5, "12.5"),
        (0.001, "0.001"),
        (0.0001, "1.0E-4"),
        (1e7, "1.0E7"),
        (12345678.9, "1.23456789E7"),
        (-2.5, "-2.5"),
        (0, "0.0"),
    ],  # fmt: skip
)
def test_values_are_written_as_java_writes_a_double(value: float, text: str) -> None:
    assert java_double(value) == text


def test_frontend_metric_line_is_torchserves_log_metric() -> None:
    known = {
        "Level": "Host",
        "Hostname": "h1",
        "model_name": "m",
        "model_version": "default",
        "hostname": "h1",
    }
    assert (
        metric_message("Requests2XX", "Count", 1, ("Level", "Hostname"), known, now=1714560000)
        == "Requests2XX.Count:1.0|#Level:Host|#hostname:h1,timestamp:1714560000"
    )
    line = metric_message(
        "ts_inference_requests_total", "Count", 1, ("model_name", "model_version", "hostname"), known, now=1
    )
    assert (
        line == "ts_inference_requests_total.Count:1.0|#model_name:m,model_version:default"
        "|#hostname:h1,timestamp:1"
    )


def test_backend_metric_lines_are_read_as_torchserves_frontend_reads_them() -> None:
    metric = parse_backend_metric(
        "HandlerTime.ms:12.3|#ModelName:mnist,Level:Model|#type:GAUGE|#hostname:h1,1714,req-1"
    )
    assert metric is not None
    assert (metric.name, metric.unit, metric.value, metric.kind) == ("HandlerTime", "ms", 12.3, "GAUGE")
    assert metric.dimensions == (("ModelName", "mnist"), ("Level", "Model"))
    assert metric.request_id == "req-1"
    declared = ("ModelName", "Level", "Hostname")
    assert re.fullmatch(
        r"HandlerTime\.Milliseconds:12\.3\|#ModelName:mnist,Level:Model\|#hostname:h1,requestID:req-1,timestamp:\d+",
        model_metric_message(metric, "Milliseconds", declared),
    )
    no_id = parse_backend_metric("X.count:1|#|#type:COUNTER|#hostname:h1,1714")
    assert no_id is not None
    assert "requestID:null" in model_metric_message(no_id, "count", ("Hostname",))
    for bad in ("no metric here", "X.u:notanumber|#|#hostname:h,1", "X.u:1|#a:b", " " * 16384):
        assert parse_backend_metric(bad) is None
    padded = parse_backend_metric("  Handler Time.ms:1|#|#hostname:h1,1714")
    assert padded is not None
    assert padded.name == "Handler Time", "leading space is not the name's"


def test_a_log_file_rotates_by_size_and_keeps_a_bounded_number_of_old_files(tmp_path: Path) -> None:
    path = tmp_path / "ts_log.log"
    f = RotatingFile(path, max_bytes=100, backups=2)
    assert f.open()
    assert path.exists()
    for i in range(20):
        f.write(f"line {i:02d} {'x' * 30}\n".encode())
    f.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["ts_log.log", "ts_log.log.1", "ts_log.log.2"]
    assert all(p.stat().st_size <= 100 for p in tmp_path.iterdir())
    assert path.read_text().splitlines()[-1].startswith("line 19")  # the newest lines stay in the live file
    keepless = RotatingFile(tmp_path / "other.log", max_bytes=50, backups=0)
    for _ in range(5):
        keepless.write(b"y" * 40 + b"\n")
    keepless.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("other")) == ["other.log"]


def test_an_unwritable_log_file_costs_a_warning_not_the_server(tmp_path: Path) -> None:
    f = RotatingFile(tmp_path / "missing-dir" / "ts_log.log", max_bytes=100, backups=1)
    assert not f.open()
    f.write(b"dropped\n")  # no exception
    f.close()


def test_line_reader_splits_bounds_and_rate_limits_lines() -> None:
    lines: list[str] = []
    dropped: list[int] = []
    reader = LineReader(lines.append, on_dropped=dropped.append, max_line=16, rate=None)
    reader.feed(b"one\ntw")
    reader.feed(b"o\r\n" + b"z" * 40 + b"\nthree")
    reader.eof()
    assert lines == ["one", "two", "z" * 16 + " [line cut at 16 bytes]", "three"]
    lines.clear()
    limited = LineReader(lines.append, on_dropped=dropped.append, rate=0.001, burst=3)
    limited.feed(b"".join(f"{i}\n".encode() for i in range(10)))
    limited.eof()
    assert lines == ["0", "1", "2"]
    assert dropped == [7]  # reported once, with the count


def test_a_long_line_in_many_chunks_is_cut_once() -> None:
    lines: list[str] = []
    reader = LineReader(lines.append, max_line=8, rate=None)
    for _ in range(10):
        reader.feed(b"abcdef")
    reader.feed(b"\nnext\n")
    assert lines == ["abcdefab [line cut at 8 bytes]", "next"]


def test_records_cross_the_pipe_intact() -> None:
    message = "Backend worker error\norg.pytorch.serve.wlm.WorkerInitializationException: x"
    record = Record(
        Kind.TS, 1714560000.5, "ERROR", "W-9000-m_1.0", "org.pytorch.serve.wlm.WorkerThread", message
    )
    line = encode(record)
    assert line.count("\n") == 1
    assert line.endswith("\n")
    assert decode(line[:-1]) == record
    assert decode("not a record") is None
    assert decode("99\x1f1\x1fINFO\x1ft\x1fc\x1fm") is None  # no such kind


def test_record_pipe_never_blocks_and_counts_what_it_dropped() -> None:
    read_fd, write_fd = os.pipe()
    pipe = RecordPipe(write_fd, max_backlog=64 * 1024)
    record = Record(Kind.ACCESS, time.time(), "INFO", "frontend-0", "ACCESS_LOG", "x" * 1000)
    for _ in range(2000):  # far more than the pipe and the backlog hold, nobody reading
        pipe.put(record)
    received = read_available(read_fd)
    while chunk := (pipe.flush(), read_available(read_fd))[1]:  # what waited in the backlog
        received += chunk
    pipe.close()
    os.close(read_fd)
    decoded = [decode(line) for line in received.decode().splitlines()]
    assert 0 < sum(1 for r in decoded if r and r.kind == Kind.ACCESS) < 2000
    notes = [r for r in decoded if r and r.kind == Kind.SERVER]
    assert notes
    assert "log records dropped" in notes[0].message


def test_output_pump_reads_every_pipe_to_its_end() -> None:
    pump = OutputPump()
    got: dict[str, list[str]] = {"a": [], "b": []}
    ended: list[str] = []
    fds = {}
    for name in got:
        r, w = os.pipe()
        pump.add(r, LineReader(got[name].append, on_eof=lambda n=name: ended.append(n), rate=None))
        fds[name] = w
    os.write(fds["a"], b"first\nsecond\n")
    os.write(fds["b"], b"other")
    for w in fds.values():
        os.close(w)
    deadline = time.monotonic() + 30
    while len(ended) < 2 and time.monotonic() < deadline:  # a cap, not a verdict on speed
        time.sleep(0.01)
    pump.close()
    assert got == {"a": ["first", "second"], "b": ["other"]}
    assert sorted(ended) == ["a", "b"]


def test_a_failed_pump_closes_the_pipes_it_is_handed_instead_of_leaving_children_blocked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once the reading thread has failed nothing reads a pipe: a child writing into one it kept
    would block when it fills. Every pipe, held or handed over later, is closed (the child gets
    EPIPE) and the wake pipe is never written after it is closed."""
    pump = OutputPump()

    def fail(timeout: float | None = None) -> list[object]:
        raise RuntimeError("selector broke")

    pump._selector.select = fail  # type: ignore[method-assign]
    held_r, held_w = os.pipe()
    pump.add(held_r, LineReader(lambda _line: None, rate=None))  # wakes the thread, which fails
    pump._thread.join(30)
    assert not pump._thread.is_alive()
    assert "the child output reader failed" in caplog.text
    later_r, later_w = os.pipe()
    pump.add(later_r, LineReader(lambda _line: None, rate=None))
    for w in (held_w, later_w):
        with pytest.raises(BrokenPipeError):
            os.write(w, b"line\n")
        os.close(w)
    pump.close()  # after the thread: returns, writes nothing


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_the_log_threads_run_in_the_batch_class_and_leave_their_starter_as_it_was(tmp_path: Path) -> None:
    """The supervisor's reader of its children's output and its log writer are woken by a
    frontend's lines: in SCHED_BATCH they do not preempt it (common/scheduling.py)."""
    pump = OutputPump()
    sink = LogSink(LogSettings(tmp_path / "logs", tmp_path / "metrics", console=False))
    sink.start()
    try:
        threads = [pump._thread, sink._thread]
        assert all(t is not None and t.native_id is not None for t in threads)

        def classes() -> set[int]:
            return {os.sched_getscheduler(t.native_id) for t in threads}  # type: ignore[union-attr,arg-type]

        deadline = time.monotonic() + 30
        while classes() != {os.SCHED_BATCH} and time.monotonic() < deadline:  # each sets its own at start
            time.sleep(0.01)
        assert classes() == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the thread that started them is untouched"
    finally:
        pump.close()
        sink.close()
