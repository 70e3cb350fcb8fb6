"""The benchmark's per-family pieces: answer checks, the length-blind archive copy, the CLI's
family defaults, per-model file names, the plan with the padding copy, the family targets, and the
raw ceiling driving a real (tiny) handler archive through the server's own loader.

Nothing here is timed: the ceiling test asserts what was called and counted, never how fast.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from mariner.loadtest import bench
from mariner.loadtest.bench_report import output_names, render_markdown, targets
from mariner.loadtest.ceiling import CeilingSpec, RawResult, measure_in_process, spread_order
from mariner.loadtest.closedloop import LevelResult, Percentiles
from mariner.loadtest.padding import pad_to_max, rewrite_archive
from mariner.loadtest.workloads import (
    AnswerError,
    check_answer,
    content_type,
    family_of,
    length_summary,
)
from tests.integration.fault_archive import write_handler_archive

pytestmark = pytest.mark.unit


def unit_vector(n: int = 384, scale: float = 1.0) -> list[float]:
    v = np.arange(1, n + 1, dtype=np.float64)
    return (v / np.linalg.norm(v) * scale).tolist()


def topk(probs: list[float]) -> bytes:
    return json.dumps(
        {"topk": [{"label": f"c{i}", "index": i, "probability": p} for i, p in enumerate(probs)]}
    ).encode()


# -- families and answer checks -------------------------------------------------------------------
def test_family_comes_from_the_model_name() -> None:
    assert family_of("digits_torchscript") == "digits"
    assert family_of("minilm_int8_dynamic") == "minilm"
    assert family_of("resnet18_onnx") == "resnet18"
    with pytest.raises(ValueError, match="no benchmark workload"):
        family_of("bert_base")
    with pytest.raises(ValueError, match="no benchmark workload"):
        family_of("minilmx_eager")  # a prefix is not a family
    assert content_type("minilm").startswith("text/plain")
    assert content_type("resnet18") == "image/jpeg"
    assert content_type("digits") == "application/json"


def test_minilm_answers_must_be_384_floats_of_unit_norm() -> None:
    check_answer("minilm", json.dumps({"embedding": unit_vector()}).encode())
    check_answer("minilm", json.dumps({"embeddings": [unit_vector(), unit_vector()]}).encode())
    with pytest.raises(AnswerError, match="383 values"):
        check_answer("minilm", json.dumps({"embedding": unit_vector(383)}).encode())
    with pytest.raises(AnswerError, match="norm 2.0000"):
        check_answer("minilm", json.dumps({"embedding": unit_vector(scale=2.0)}).encode())
    with pytest.raises(AnswerError, match="norm"):
        check_answer("minilm", json.dumps({"embeddings": [unit_vector(), unit_vector(scale=0.5)]}).encode())
    with pytest.raises(AnswerError, match="not an embedding"):
        check_answer("minilm", b'{"label": 3}')
    with pytest.raises(AnswerError, match="not JSON"):
        check_answer("minilm", b"Internal Server Error")


def test_resnet_answers_must_be_five_falling_probabilities() -> None:
    check_answer("resnet18", topk([0.5, 0.2, 0.1, 0.1, 0.05]))
    with pytest.raises(AnswerError, match="top-5"):
        check_answer("resnet18", topk([0.5, 0.2, 0.1, 0.1]))
    with pytest.raises(AnswerError, match="falling"):
        check_answer("resnet18", topk([0.1, 0.5, 0.1, 0.1, 0.05]))
    with pytest.raises(AnswerError, match="falling"):
        check_answer("resnet18", topk([1.5, 0.2, 0.1, 0.1, 0.05]))
    bad = json.loads(topk([0.5, 0.2, 0.1, 0.1, 0.05]))
    del bad["topk"][2]["label"]
    with pytest.raises(AnswerError, match="label, index, probability"):
        check_answer("resnet18", json.dumps(bad).encode())


def test_digits_answers_keep_the_label_check() -> None:
    check_answer("digits", b'{\n  "label": 3, "topk": []}')
    with pytest.raises(AnswerError, match="not a prediction"):
        check_answer("digits", b'{"error": "overloaded"}')


def test_length_summary_names_the_spread() -> None:
    assert length_summary([5, 200, 40, 60]) == (
        "word pieces per text: min 5, median 50, mean 76, max 200 (4 texts)"
    )


# -- the length-blind copy --------------------------------------------------------------------------
MINILM_CONFIG = {
    "batchSize": 32,
    "maxBatchDelay": 5,
    "maxBatchTokens": 4096,
    "tokenCounter": {"tokenizer": "tokenizer.json", "maxLength": 256},
    "handler": {"format": "eager", "padding": "longest", "maxLength": 256, "truncate": True},
}


def test_pad_to_max_drops_the_budget_and_pads_to_max_length_only() -> None:
    new, changes = pad_to_max(MINILM_CONFIG)
    assert "maxBatchTokens" not in new
    assert "tokenCounter" not in new
    assert new["handler"] == {**MINILM_CONFIG["handler"], "padding": "max_length"}
    assert {k: v for k, v in new.items() if k != "handler"} == {"batchSize": 32, "maxBatchDelay": 5}
    assert changes[0] == "`handler.padding: longest` -> `max_length`"
    assert changes[1] == "`maxBatchTokens: 4096` removed"
    assert changes[2].startswith("`tokenCounter: {")
    assert MINILM_CONFIG["handler"]["padding"] == "longest"  # the input is not modified
    assert pad_to_max({"handler": {"padding": "max_length"}})[1] == ()


def test_rewritten_archive_keeps_every_other_member_byte_for_byte(tmp_path: Path) -> None:
    src = write_handler_archive(
        tmp_path / "store" / "minilm_eager.mar",
        "minilm_eager",
        "minilm_handler.py",
        {
            "minilm_handler.py": "# handler\n",
            "model-config.yaml": yaml.safe_dump(MINILM_CONFIG),
            "tokenizer.json": '{"version": "1.0"}',
        },
    )
    done = rewrite_archive(src, tmp_path / "padmax")
    assert done.path == tmp_path / "padmax" / "minilm_eager.mar"
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(done.path) as b:
        assert a.namelist() == b.namelist()
        for name in a.namelist():
            if name != "model-config.yaml":
                assert a.read(name) == b.read(name), name
        assert yaml.safe_load(b.read("model-config.yaml")) == pad_to_max(MINILM_CONFIG)[0]
    assert len(done.changes) == 3


# -- CLI defaults and file names --------------------------------------------------------------------
def test_family_defaults_keep_slow_models_runs_short_and_digits_unchanged() -> None:
    d = bench.parse_args([])
    assert (d.model, d.protocols, d.warmup, d.duration_s, d.startup, d.padding_compare) == (
        "digits_torchscript",
        ("grpc", "grpc-1ch", "http", "grpc-stream", "oip-stream"),
        500,
        6.0,
        True,
        False,
    )
    assert (d.raw_seconds, d.torchserve_warmup_cap_s, d.load.min_warmup_per_client) == (4.0, 60.0, 4)
    assert bench.parse_args(["--model", "resnet18_eager"]).load.min_warmup_per_client == 1
    m = bench.parse_args(["--model", "minilm_onnx.mar"])
    assert (m.model, m.family, m.protocols, m.warmup, m.duration_s, m.startup, m.padding_compare) == (
        "minilm_onnx",
        "minilm",
        ("http",),
        0,
        12.0,
        False,
        True,
    )
    r = bench.parse_args(["--model", "resnet18_onnx", "--protocols", "http", "--startup"])
    assert (r.protocols, r.startup, r.padding_compare) == (("http",), True, False)
    assert not bench.parse_args(["--model", "minilm_eager", "--no-padding-compare"]).padding_compare
    assert not bench.parse_args(["--no-startup"]).startup
    # batchSize / maxBatchDelay are the archive's unless given (filled in by archive_settings)
    assert (m.batch_size, m.max_batch_delay_ms) == (0, -1)
    given = bench.parse_args(["--batch-size", "8", "--max-batch-delay-ms", "0"])
    assert bench.archive_settings(given) is given
    assert (given.batch_size, given.max_batch_delay_ms) == (8, 0)


def test_unknown_model_family_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--model", "bert_base"])
    assert exc.value.code == 2
    assert "no benchmark workload for model 'bert_base'" in capsys.readouterr().err


def test_archive_settings_reads_the_archives_batching(tmp_path: Path) -> None:
    write_handler_archive(
        tmp_path / "minilm_eager.mar",
        "minilm_eager",
        "h.py",
        {"h.py": "", "model-config.yaml": yaml.safe_dump(MINILM_CONFIG)},
    )
    s = bench.archive_settings(bench.parse_args(["--model", "minilm_eager", "--store", str(tmp_path)]))
    assert (s.batch_size, s.max_batch_delay_ms) == (32, 5)
    s = bench.archive_settings(
        bench.parse_args(["--model", "minilm_eager", "--store", str(tmp_path), "--batch-size", "16"])
    )
    assert (s.batch_size, s.max_batch_delay_ms) == (16, 5)


def test_each_model_gets_its_own_report_files_and_digits_keeps_its_names() -> None:
    assert output_names("digits_torchscript").markdown == "results.md"
    assert output_names("digits_torchscript").latency == "latency.png"
    n = output_names("minilm_onnx")
    assert (n.markdown, n.json, n.latency, n.throughput) == (
        "results-minilm_onnx.md",
        "results-minilm_onnx.json",
        "latency-minilm_onnx.png",
        "throughput-minilm_onnx.png",
    )
    # digits on another archive gets its own files too: reports never overwrite each other
    assert output_names("digits_onnx").markdown == "results-digits_onnx.md"


def test_padding_copy_runs_only_at_the_highest_level_interleaved() -> None:
    s = bench.parse_args(
        ["--model", "minilm_eager", "--levels", "1,64", "--repeats", "2", "--protocols", "http"]
    )
    cells = bench.plan_cells(s, ["raw", "mariner", "mariner-pad-max", "torchserve"])
    assert [(c.server, c.protocol) for c in cells if c.level == 1] == [
        ("mariner", "http"),
        ("torchserve", "http"),
    ]
    assert [(c.repeat, c.server) for c in cells if c.level == 64] == [
        (0, "raw"),
        (0, "mariner"),
        (0, "mariner-pad-max"),
        (0, "torchserve"),
        (1, "raw"),
        (1, "torchserve"),
        (1, "mariner-pad-max"),
        (1, "mariner"),
    ]


# -- the family targets -----------------------------------------------------------------------------
def cell(server: str, rps: float, p99_ms: float, repeat: int, protocol: str = "http") -> LevelResult:
    return LevelResult(
        server=server,
        protocol=protocol,
        concurrency=64,
        latency=Percentiles(100, p99_ms / 2, p99_ms, p99_ms, p99_ms),
        errors=0,
        wall_s=10.0,
        throughput_rps=rps,
        client_cores=0.2,
        server_cores=1.0,
        machine_cores=2.0,
        connections=64,
        repeat=repeat,
    )


def raw(rps: float) -> RawResult:
    return RawResult(Percentiles.of([40.0]), rps, Percentiles.of([]), math.nan, 32, 1, "cpu", 32e3 / rps)


def minilm_report(levels: list[LevelResult], raws: list[float]) -> bench.Report:
    s = replace(
        bench.parse_args(
            ["--model", "minilm_eager", "--levels", "1,64", "--protocols", "http", "--out", "/x"]
        ),
        batch_size=32,
        max_batch_delay_ms=5,
    )
    report = bench.Report(
        settings=s,
        command="python -m mariner.loadtest.bench --model minilm_eager",
        started="now",
        machine={
            "cpu": "test",
            "logical_cpus": 2,
            "memory_gib": 1,
            "os": "linux",
            "load_average_at_start": [],
        },
        versions={},
        levels=levels,
        raw_runs=[raw(x) for x in raws],
        workload="512 English texts",
        padding=["`handler.padding: longest` -> `max_length`", "`maxBatchTokens: 4096` removed"],
    )
    report.raw = report.raw_runs[0]
    return report


def test_family_targets_pair_each_repeat_with_its_own_raw_ceiling() -> None:
    levels = []
    # (mariner, torchserve, pad-max) req/s and p99 per repeat; raw ceiling 100, 50, 100
    for rep, (m, t, pm) in enumerate([(95, 70, 50), (40, 35, 30), (85, 80, 60)]):
        levels += [
            cell("mariner", m, 900, rep),
            cell("torchserve", t, 1000 if rep != 1 else 800, rep),
            cell("mariner-pad-max", pm, 2000, rep),
        ]
    report = minilm_report(levels, [100, 50, 100])
    by = {t.what: t for t in targets(report)}
    share = by["http c=64: throughput Mariner / raw batched handle() (median of 3)"]
    assert share.value == pytest.approx(0.85)  # per repeat 0.95, 0.80, 0.85
    assert share.held is False
    over = by["http c=64: throughput Mariner / TorchServe (median of 3)"]
    assert over.value == pytest.approx(40 / 35)  # per repeat 1.357, 1.143, 1.0625
    assert over.held is False
    tail = by["http c=64: p99 Mariner / TorchServe (median of 3)"]
    assert tail.value == pytest.approx(0.9)  # per repeat 0.9, 1.125, 0.9
    assert tail.held is True
    pad = by["http c=64: throughput pad to longest + token budget / pad to max_length (median of 3)"]
    assert pad.value == pytest.approx(85 / 60)  # per repeat 1.9, 1.333, 1.417
    assert pad.held is False
    assert not any("start-up" in w or "GPU" in w for w in by)  # the digits targets are not these


def test_minilm_report_has_payloads_padding_table_and_its_own_figures() -> None:
    levels = [
        cell("mariner", 90, 900, 0),
        cell("torchserve", 60, 1200, 0),
        cell("mariner-pad-max", 45, 2000, 0),
    ]
    text = render_markdown(minilm_report(levels, [100]))
    assert text.startswith("# Benchmark: raw model vs Mariner vs stock TorchServe: `minilm_eager`")
    assert "## Payloads\n\n512 English texts. Every answer was checked (384 floats of unit norm)." in text
    assert "## Length-aware batching (MiniLM)" in text
    # cell(): 1 server core, so CPU per request is 1e6 / req/s µs
    assert "| http | 64 | 90.0 | 450 | 900 | 11111 | 45.0 | 1000 | 2000 | 22222 | 2.00x | 2.00x |" in text
    assert "`handler.padding: longest` -> `max_length`; `maxBatchTokens: 4096` removed" in text
    assert "![throughput vs concurrency](throughput-minilm_eager.png)" in text
    assert "The process hop" not in text
    assert "predict_topk" not in text  # digits-only row


# -- the raw ceiling, on a real archive through the server's loader ---------------------------------
ECHO_HANDLER = """
import json, math

class Handler:
    def initialize(self, context):
        self.calls = []
        self.batch_size = context.system_properties["batch_size"]

    def handle(self, data, context):
        texts = [bytes(row["data"]).decode() for row in data]
        with open("CALLS_LOG", "a") as f:
            f.write(json.dumps(texts) + "\\n")
        n = math.sqrt(384.0)
        return [{"embedding": [1.0 / n] * 384, "label": 0} for _ in texts]  # valid for two families
"""


def test_ceiling_drives_full_batches_of_the_payloads_in_turn(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    archive = write_handler_archive(
        tmp_path / "minilm_echo.mar",
        "minilm_echo",
        "echo_handler.py",
        {
            "echo_handler.py": ECHO_HANDLER.replace("CALLS_LOG", str(log)),
            "model-config.yaml": "batchSize: 4\n",
        },
    )
    bodies = [f"text {i}".encode() for i in range(6)]
    r = measure_in_process(CeilingSpec(archive, "minilm", 4, 1, 0.01), bodies)
    assert (r.batch_size, r.torch_threads, r.device) == (4, 1, "cpu")
    assert r.batched_rps > 0
    assert r.batch_ms > 0
    assert r.batch1.n >= 3
    assert math.isnan(r.model_batched_rps)  # digits only
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    full = [c for c in calls if len(c) == 4]
    ones = [c for c in calls if len(c) == 1]
    assert len(full) + len(ones) == len(calls)
    # full batches walk the payloads in turn: the next four each time, wrapping around
    assert full[0] == ["text 0", "text 1", "text 2", "text 3"]
    assert full[1] == ["text 4", "text 5", "text 0", "text 1"]
    assert len(full) >= 3
    assert len(ones) >= 3


def test_ceiling_refuses_a_handler_whose_answers_fail_the_check(tmp_path: Path) -> None:
    archive = write_handler_archive(
        tmp_path / "minilm_bad.mar",
        "minilm_bad",
        "bad_handler.py",
        {
            "bad_handler.py": (
                "def handle(data, context):\n    return [{'embedding': [1.0] * 384} for _ in data or ()]\n"
            ),
            "model-config.yaml": "batchSize: 2\n",
        },
    )
    with pytest.raises(AnswerError, match="norm"):
        measure_in_process(CeilingSpec(archive, "minilm", 2, 1, 0.01), [b"a", b"b"])


def test_spread_order_reaches_both_ends_early_and_covers_everything() -> None:
    assert spread_order(1) == [0]
    assert spread_order(4) == [0, 2, 1, 3]
    assert spread_order(16)[:4] == [0, 8, 4, 12]
    for n in (3, 5, 16, 17):
        assert sorted(spread_order(n)) == list(range(n))


def test_minilm_ceiling_also_times_length_sorted_batches(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    archive = write_handler_archive(
        tmp_path / "minilm_echo.mar",
        "minilm_echo",
        "echo_handler.py",
        {
            "echo_handler.py": ECHO_HANDLER.replace("CALLS_LOG", str(log)),
            "model-config.yaml": "batchSize: 2\n",
        },
    )
    bodies = [b"x" * k for k in (5, 1, 4, 2, 6, 3, 8, 7)]
    r = measure_in_process(CeilingSpec(archive, "minilm", 2, 1, 0.01), bodies)
    assert r.sorted_batched_rps > 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    chunks = [["x", "xx"], ["xxx", "xxxx"], ["xxxxx", "xxxxxx"], ["xxxxxxx", "xxxxxxxx"]]
    tail = []
    for c in reversed(calls):  # the sorted batches are the last calls; arrival order never sorts so
        if c not in chunks:
            break
        tail.insert(0, c)
    # at least three batches, spread over short and long first, never one twice
    assert len(tail) in (3, 4)
    assert tail == [chunks[i] for i in (0, 2, 1, 3)][: len(tail)]
    other = measure_in_process(CeilingSpec(archive, "digits", 2, 1, 0.01), [b"x"] * 4)
    assert math.isnan(other.sorted_batched_rps)  # only for MiniLM
