"""Servers shared by the integration modules that only send requests.

Every `mariner serve` started here is the one several modules each started for themselves with
the same store, the same models and the same settings; the modules now ask for it instead, and it
lives for the whole session (started on first use, stopped at the end). A module may use a
shared server only if nothing it does changes what the next module sees: it registers,
unregisters or scales nothing, kills no process, counts metrics only as a difference it measures
itself, and reads no log it needs fresh. A module that does any of these keeps its own server.

Each module still has its own fixture (usually `mariner`), which now hands out the shared server
after checking it is alive (`MarinerServe.alive()`), so a server killed by an earlier module fails
with its log instead of a connection error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.mariner_serve import MarinerServe

if TYPE_CHECKING:
    from mariner.loadtest.servers import MarinerProcess

CURRENT_DIGITS = ("digits_torchscript", "digits_onnx")


@pytest.fixture(scope="session")
def shared_digits_torchscript(model_store: Path) -> Iterator[MarinerServe]:
    """The built store's digits_torchscript alone, the harness's default settings.

    Used by test_client, test_decode_limits, test_grpc_reflection, test_perf_analyzer and
    test_torchserve_oip_grpc (each started exactly this before)."""
    from mariner.server import protogen

    protogen.generate()
    srv = MarinerServe(model_store, "digits_torchscript.mar").start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def current_digits_store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits_torchscript and digits_onnx from the built store with this tree's digits handler
    inside (`current_digits_archive`), in a store of their own."""
    from tests.integration.test_explanations import current_digits_archive

    out = tmp_path_factory.mktemp("current-digits")
    for name in CURRENT_DIGITS:
        current_digits_archive(model_store, f"{name}.mar", out)
    return out


@pytest.fixture(scope="session")
def shared_current_digits(current_digits_store: Path) -> Iterator[MarinerServe]:
    """Both archives of `current_digits_store`, the harness's default settings.

    Used by test_kserve_v1 and test_oracle_explanations (each built this store and started
    exactly this before)."""
    srv = MarinerServe(current_digits_store, ",".join(f"{m}.mar" for m in CURRENT_DIGITS)).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def shared_loadtest_mariner(model_store: Path) -> Iterator[MarinerProcess]:
    """The product benchmark's `mariner serve` (mariner.loadtest.servers.MarinerProcess) on the
    built store's digits_torchscript with one torch thread.

    Used by test_loadtest and test_stream_bench (each started exactly this before)."""
    from mariner.loadtest.servers import MarinerProcess

    with MarinerProcess(model_store, "digits_torchscript.mar", torch_threads=1) as server:
        yield server
