"""What a management caller sends is checked before it reaches a path, a process or a log line,
against a real `mariner serve` (REST 8081 and gRPC 7071 on port 0).

* Control characters (a NUL once answered 500 with a traceback, a newline forged worker log
  lines) in any register parameter or management path parameter: 400 naming the parameter.
* Model names that torch-model-archiver would not write (`../../etc/x`, `a/b`, a newline, 5,000
  characters): 400 with TorchServe's BadRequestException body; a good name still registers and
  unregisters.
* Zip and gzip bombs are refused on what they declare (or on their first megabytes) in
  milliseconds, leaving nothing in the work dir, while another model keeps serving.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
import requests

from tests.integration.fault_archive import build_fault_archive
from tests.integration.test_versions_and_management import grpc_management
from tests.mariner_serve import MarinerServe
from tests.unit.test_archive_bombs import patch_declared_sizes, tgz_bomb, zip_bomb

pytestmark = pytest.mark.integration

HDR = {"Content-Type": "application/json"}
OK = json.dumps({"op": "ok", "value": 7})
INJECTED = "INJECTED-LINE"
BAD_NAMES = ["../../etc/x", "a/b", f"a\n{INJECTED} fake", "x" * 5000, "a\x00b", "-x", "a b"]
RULE = r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("register-input")
    store = root / "store"
    build_fault_archive(store, name="good")
    zip_bomb(store / "zipbomb.mar", zeros=64 * (1 << 20))
    liar = zip_bomb(store / "zip64lie.mar", zeros=1 << 20, members=2)
    patch_declared_sizes(liar, "zeros", 0xFFFFFFF0)  # 2 x 4 GiB declared from ~2 KiB
    tgz_bomb(store / "tgzbomb.tar.gz", zeros=64 * (1 << 20))
    return store


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[MarinerServe]:
    # `bad!name=good.mar`: a models= entry whose name the archiver's rule refuses.
    srv = MarinerServe(
        store, "good.mar,bad!name=good.mar", enable_model_management=True, work_dir=store.parent / "work"
    ).start(require_ready=False)
    try:
        yield srv
    finally:
        srv.stop()


def _no_injected_line(srv: MarinerServe) -> None:
    lines = srv.log_text().splitlines()
    assert not [line for line in lines if line.startswith(INJECTED)], "a name forged a log line"


def _grpc_refusal(srv: MarinerServe, call: str, **fields: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        grpc_management(srv, call, **fields)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (call, fields, info.value.details())
    return info.value.details()


def test_a_models_entry_with_a_bad_name_is_refused_at_start_up(server: MarinerServe) -> None:
    (entry,) = requests.get(f"{server.management}/models/bad!name", timeout=30).json()
    assert entry["mariner"]["state"] == "FAILED"
    assert "model name 'bad!name' contains special characters" in entry["mariner"]["error"]
    assert RULE in entry["mariner"]["error"]


def test_bad_model_names_are_refused_over_rest_and_grpc(server: MarinerServe) -> None:
    t0 = time.perf_counter()
    for name in BAD_NAMES:
        r = requests.post(f"{server.management}/models?url=good.mar&model_name={quote(name)}", timeout=60)
        assert r.status_code == 400, (name[:20], r.text)
        body = r.json()
        assert body["type"] == "BadRequestException", body
        assert body["code"] == 400
        assert RULE in body["message"] or "control character" in body["message"], body
        r = requests.post(
            f"{server.management}/models",
            data=json.dumps({"url": "good.mar", "model_name": name}),
            headers=HDR,
            timeout=60,
        )
        assert r.status_code == 400, (name[:20], r.text)
        details = _grpc_refusal(server, "RegisterModel", url="good.mar", model_name=name)
        assert "model_name" in details
    print(f"{3 * len(BAD_NAMES)} bad-name registers refused in {time.perf_counter() - t0:.2f} s")
    assert sorted(server.served_models()) == ["bad!name", "good"]
    _no_injected_line(server)


def test_control_characters_in_any_parameter_are_a_400_naming_it(server: MarinerServe) -> None:
    m = server.management
    for param in ("url", "model_name", "runtime", "batch_size", "max_batch_delay", "initial_workers"):
        for bad in ("\x00", "\n", "\x7f", "\x1b[31m"):
            value = "good.mar" if param != "url" else ""
            query = {"url": "good.mar", param: value + bad}
            r = requests.post(
                f"{m}/models?" + "&".join(f"{k}={quote(v)}" for k, v in query.items()), timeout=60
            )
            assert r.status_code == 400, (param, bad, r.text)
            assert f"parameter {param} " in r.json()["message"], r.text
            message = r.json()["message"]
            assert "printable characters only" in message or RULE in message, message
    for field in ("url", "model_name", "handler", "runtime"):
        fields = {"url": "good.mar", field: "x\x00y"}
        assert f"parameter {field} " in _grpc_refusal(server, "RegisterModel", **fields)
    for method, path in (
        ("DELETE", "good%00"),
        ("GET", "go%0Aod"),
        ("PUT", "good%7F"),
        ("DELETE", "good/1.0%00"),
        ("GET", "good/1%0A0"),
        ("PUT", "good/1.0%00/set-default"),
    ):
        r = requests.request(method, f"{m}/models/{path}", timeout=60)
        assert r.status_code == 400, (method, path, r.text)
        assert "control character" in r.json()["message"]
    for call, fields in (
        ("DescribeModel", {"model_name": "good\x00"}),
        ("UnregisterModel", {"model_name": "good", "model_version": "1.0\n"}),
        ("ScaleWorker", {"model_name": "go\x1bod", "min_worker": 1}),
        ("SetDefault", {"model_name": "good", "model_version": "1\x00"}),
    ):
        assert "control character" in _grpc_refusal(server, call, **fields)
    assert sorted(server.served_models()) == ["bad!name", "good"]
    r = requests.post(f"{server.http}/predictions/good", data=OK, headers=HDR, timeout=30)
    assert r.status_code == 200, r.text


def test_a_good_name_registers_and_unregisters(server: MarinerServe) -> None:
    m = server.management
    r = requests.post(f"{m}/models?url=good.mar&model_name=alias-1.x_y", timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(f"{server.http}/predictions/alias-1.x_y", data=OK, headers=HDR, timeout=30)
    assert r.status_code == 200, r.text
    assert requests.delete(f"{m}/models/alias-1.x_y", timeout=60).status_code == 200
    grpc_management(server, "RegisterModel", url="good.mar", model_name="alias2", initial_workers=1)
    assert "alias2" in server.served_models()
    grpc_management(server, "UnregisterModel", model_name="alias2")
    assert sorted(server.served_models()) == ["bad!name", "good"]


class _Victim:
    """Predictions on `good` from one thread, counted per window, while bombs are registered."""

    def __init__(self, srv: MarinerServe) -> None:
        self._url = f"{srv.http}/predictions/good"
        self.ok = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with requests.Session() as s:
            while not self._stop.is_set():
                r = s.post(self._url, data=OK, headers=HDR, timeout=30)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1

    def __enter__(self) -> _Victim:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def rate(self, seconds: float, during: threading.Thread | None = None) -> float:
        start, t0 = self.ok, time.perf_counter()
        if during is not None:
            during.start()
            during.join(seconds * 4)
        else:
            time.sleep(seconds)
        return (self.ok - start) / (time.perf_counter() - t0)


def test_bombs_are_refused_in_milliseconds_and_a_victim_keeps_serving(
    server: MarinerServe, store: Path
) -> None:
    work = store.parent / "work"
    expected = {
        "zipbomb.mar": "more than the limit of 100:1",
        "zip64lie.mar": "declares 4294967280 bytes",
        "tgzbomb.tar.gz": "(a gzip bomb?)",
    }
    timings: dict[str, list[float]] = {name: [] for name in expected}

    def register_bombs(rounds: int = 3) -> None:
        for _ in range(rounds):
            for name, says in expected.items():
                t0 = time.perf_counter()
                r = requests.post(f"{server.management}/models?url={name}", timeout=60)
                timings[name].append(time.perf_counter() - t0)
                assert r.status_code == 400, r.text
                assert says in r.json()["message"], r.text

    def register_missing(rounds: int = 30) -> None:  # the same client load, nothing to unpack
        for _ in range(rounds):
            requests.post(f"{server.management}/models?url=missing.mar", timeout=60)

    with _Victim(server) as victim:
        before = victim.rate(1.5)
        baseline = victim.rate(1.5, threading.Thread(target=register_missing))
        errors: list[BaseException] = []

        def guarded() -> None:
            try:
                register_bombs()
            except BaseException as exc:  # surfaced below, on the test's thread
                errors.append(exc)

        during = victim.rate(1.5, threading.Thread(target=guarded))
        assert not errors, errors[0]
    for name, seconds in timings.items():
        span = f"{min(seconds) * 1000:.0f}-{max(seconds) * 1000:.0f} ms"
        print(f"{name}: refused in {span} ({len(seconds)} registers)")
    print(
        f"victim throughput: {before:.0f} req/s alone, {baseline:.0f} req/s beside registers of a missing "
        f"archive, {during:.0f} req/s while bombs were registered"
    )
    assert victim.failed == 0
    stems = ("zipbomb", "zip64lie", "tgzbomb")
    assert [p.name for p in work.iterdir() if p.name.startswith(stems)] == [], "nothing left unpacked"
    assert sorted(server.served_models()) == ["bad!name", "good"]
