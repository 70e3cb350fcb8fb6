"""Stock TorchServe and Mariner side by side, started from one config.properties.

TorchServe's file is the one `StockTorchServe` writes (ports it picked, `load_models`,
`models={...}`, token auth off) plus the pair's keys (`enable_model_api`, `service_envelope`).
Mariner gets that same file with only the listener addresses changed to port 0 (it reports the
ports it bound), started with the oracle's own command line: `mariner serve --start --foreground
--ncs --disable-token-auth --model-store <store> --ts-config config.properties`.
A server that does not start is kept as a reason, so every call still gets a row in the report.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from mariner.loadtest.servers import ServerError, StockTorchServe
from tests.integration.ts_examples import oracle_env
from tests.integration.ts_examples.calls import (
    REGISTER_TIMEOUT_S,
    TIMEOUT_S,
    UNLOADABLE_TIMEOUT_S,
    Answer,
    http,
)
from tests.integration.ts_examples.examples import Example
from tests.mariner_serve import MarinerServe, ServeFailed

_PORT0 = {
    "inference_address": "http://127.0.0.1:0",
    "management_address": "http://127.0.0.1:0",
    "metrics_address": "http://127.0.0.1:0",
    "grpc_inference_port": "0",
    "grpc_management_port": "0",
}


@dataclass(frozen=True)
class Endpoint:
    """Where one server answers, or why it does not (`failure`)."""

    title: str
    http: str = ""
    management: str = ""
    grpc: str = ""
    grpc_management: str = ""
    failure: str | None = None


def _last_lines(text: str, n: int = 6) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])


class OracleTorchServe(StockTorchServe):
    """Stock TorchServe, its Python processes given Mariner's torchvision shim (oracle_env)."""

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env["PYTHONPATH"] = oracle_env.pythonpath(env.get("PYTHONPATH"))
        return env


class Pair:
    """One stock TorchServe and one Mariner serving the same store with the same config."""

    def __init__(self, store: Path, examples: Sequence[Example], envelope: str | None) -> None:
        self.store = store
        self.examples = tuple(examples)
        self.envelope = envelope
        self.startup = [e for e in self.examples if e.at_startup]
        self.late = [e for e in self.examples if not e.at_startup]
        self._ts: StockTorchServe | None = None
        self._mariner: MarinerServe | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="dropin-")
        self.torchserve = Endpoint("TorchServe", failure="not started")
        self.mariner = Endpoint("Mariner", failure="not started")
        self.registrations: dict[str, tuple[Answer, Answer]] = {}
        self.mariner_command = ""
        self.timings = ""
        self.config_keys: list[str] = []

    def pair_config(self) -> dict[str, str]:
        extra = {"enable_model_api": "true"}
        if self.envelope:
            extra["service_envelope"] = self.envelope
        return extra

    def start(self) -> None:
        """TorchServe first (its config.properties is the one both read), then Mariner, then
        the archives not loaded at start-up are registered on both (answers kept)."""
        t0 = time.monotonic()
        ts = OracleTorchServe(
            self.store, [e.url for e in self.startup], extra_config=self.pair_config(), max_worker_restarts=3
        )
        try:
            ts.start(timeout=240)
        except ServerError as exc:
            self.torchserve = Endpoint("TorchServe", failure=f"did not start: {_last_lines(str(exc))}")
            ts.stop()
        else:
            self._ts = ts
            self.torchserve = Endpoint(
                "TorchServe", ts.http_url, ts.management_url, ts.grpc_target, ts.grpc_management_target
            )
        t1 = time.monotonic()
        self._start_mariner(self._properties(ts))
        t2 = time.monotonic()
        self._register_late()
        t3 = time.monotonic()
        self.timings = (
            f"TorchServe start {t1 - t0:.0f} s, Mariner start {t2 - t1:.0f} s, registrations {t3 - t2:.0f} s"
        )

    def _register_late(self) -> None:
        """All at once, on both servers: each waits for a worker to load (seconds of torch import)."""

        def params(e: Example) -> dict[str, str]:
            sync = "false" if e.missing() else "true"  # a handler that cannot import never gets READY
            return {"url": e.url, "initial_workers": "1", "synchronous": sync}

        with ThreadPoolExecutor(max_workers=2 * len(self.late) or 1) as pool:
            futures = {
                e.name: (
                    pool.submit(self.register, self.torchserve, params(e)),
                    pool.submit(self.register, self.mariner, params(e)),
                )
                for e in self.late
            }
            for name, (ts, mariner) in futures.items():
                self.registrations[name] = (ts.result(), mariner.result())

    def _properties(self, ts: StockTorchServe) -> Path:
        """TorchServe's config.properties with the listeners on port 0."""
        props = ts.config_properties() if ts.workdir is not None else {}
        if not props:  # TorchServe is gone: rebuild what it would have read
            props = {
                "model_store": str(self.store),
                "load_models": ",".join(e.url for e in self.startup),
                "disable_token_authorization": "true",
                **self.pair_config(),
            }
        props.update(_PORT0)
        self.config_keys = sorted(k for k in props if k not in _PORT0 and "address" not in k)
        path = Path(self._tmp.name) / "config.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def _start_mariner(self, properties: Path) -> None:
        """`mariner serve` with the command line the oracle got (TorchServe's flags), plus a
        config file holding only the test harness's drain knobs (no refusal window)."""
        flags = ["--start", "--foreground", "--ncs", "--disable-token-auth", "--model-store", str(self.store)]
        flags += ["--ts-config", str(properties)]
        srv = MarinerServe(self.store, "", args=tuple(flags))
        srv.config_file.write_text(yaml.safe_dump({"refuse_seconds": 0.0, "grace_seconds": 20.0}))
        self.mariner_command = "mariner serve " + " ".join(
            f.replace(str(self.store), "<store>").replace(str(properties), "config.properties") for f in flags
        )
        try:
            srv.start(require_ready=False, timeout=240)
        except ServeFailed as exc:
            self.mariner = Endpoint("Mariner", failure=f"did not start: {_last_lines(str(exc))}")
            srv.stop()
            return
        self._mariner = srv
        self.mariner = Endpoint(
            "Mariner", srv.http, srv.management, srv.grpc_target, srv.grpc_management_target
        )

    @staticmethod
    def register(server: Endpoint, params: dict[str, str]) -> Answer:
        if server.failure:
            return Answer("no server", server.failure.encode())
        return http("POST", f"{server.management}/models", params=params, timeout=REGISTER_TIMEOUT_S)

    def timeout_for(self, model: str) -> float:
        """How long to wait for an inference answer from `model`: short when it cannot load."""
        unloadable = {e.name for e in self.examples if e.missing()}
        return UNLOADABLE_TIMEOUT_S if model in unloadable else TIMEOUT_S

    def stop(self) -> None:
        if self._ts is not None:
            self._ts.stop()
            self._ts = None
        if self._mariner is not None:
            with contextlib.suppress(Exception):
                self._mariner.__exit__(None, None, None)  # stop, and remove its temp dir
            self._mariner = None
        self._tmp.cleanup()
