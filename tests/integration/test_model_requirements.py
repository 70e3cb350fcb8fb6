"""install_py_dep_per_model=true: an archive's requirements file is pip-installed for that model
alone before its workers start, from the index pip is configured with; a requirement pip
cannot install fails only that model, with pip's reason, at start-up and on register.

The archive's handler imports `text_unidecode`, a small pure-Python package that is not in the
server's environment (checked below), so it loads only when its requirements were installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.integration.rearchive import rearchive
from tests.mariner_serve import MarinerServe

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PACKAGE = "text_unidecode"  # PyPI text-unidecode, pure Python
BODY = json.dumps([4.0] * 64)
HDR = {"Content-Type": "application/json"}
HANDLER = f'''"""The digits handler, importing a package only the archive's requirements provide."""
import logging

import {PACKAGE}
from digits_handler import DigitsHandler as _Digits

logging.getLogger(__name__).info("requirement imported from %s", {PACKAGE}.__file__)


class RequiringDigitsHandler(_Digits):
    """Serves as the digits handler; loading it needs {PACKAGE}."""
'''


SECRET = "TOP-SECRET-LINE-outside-the-store"
# name -> the line after a good one (so the refusal names line 2); {secret} is a file outside.
ATTACKS = {
    "reads_outside": "-r {secret}",
    "reads_relative": "-r ../../../../outside/secret.txt",
    "own_index": "--index-url http://127.0.0.1:{port}/simple",
    "local_path": "{secret}",
}


@pytest.fixture(scope="module")
def decoy_index() -> Iterator[socket.socket]:
    """A listener standing in for the index an archive names: a pip sent there would connect."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        sock.settimeout(0.2)
        yield sock


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory, decoy_index: socket.socket) -> Path:
    assert importlib.util.find_spec(PACKAGE) is None, f"{PACKAGE} must not be in the server's environment"
    d = tmp_path_factory.mktemp("requirements")
    work = tmp_path_factory.mktemp("requirements-src")
    handler = work / "requiring_handler.py"
    handler.write_text(HANDLER)
    good, bad = work / "good" / "requirements.txt", work / "bad" / "requirements.txt"
    good.parent.mkdir()
    bad.parent.mkdir()
    good.write_text("text-unidecode==1.3\n")
    bad.write_text("mariner-no-such-package-anywhere==0.0.1\n")
    mar = model_store / "digits_torchscript.mar"
    shutil.copy(mar, d / "plain.mar")
    for name, req in (("needs_pkg", good), ("needs_missing", bad)):
        rearchive(mar, d, name, "default", handler=handler, requirements_file=req)
    # The review's attacks: a file outside the archive, an index of the archive's choosing, a path.
    (outside := tmp_path_factory.mktemp("outside")).joinpath("secret.txt").write_text(SECRET + "\n")
    for name, line in ATTACKS.items():
        req = work / name / "requirements.txt"
        req.parent.mkdir()
        req.write_text(
            "text-unidecode==1.3\n"
            + line.format(secret=outside / "secret.txt", port=decoy_index.getsockname()[1])
            + "\n"
        )
        rearchive(mar, d, name, "default", handler=handler, requirements_file=req)
    return d


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[MarinerServe]:
    srv = MarinerServe(
        store,
        "plain=plain.mar,needs_pkg=needs_pkg.mar,needs_missing=needs_missing.mar",
        enable_model_management=True,
        install_py_dep_per_model=True,
    ).start(require_ready=False)
    try:
        yield srv
    finally:
        srv.stop()


def _entry(srv: MarinerServe, model: str) -> dict:
    (entry,) = srv.describe(model)
    return entry


def test_requirements_are_installed_for_the_model_before_its_workers_start(server: MarinerServe) -> None:
    r = requests.post(f"{server.http}/predictions/needs_pkg", data=BODY, headers=HDR, timeout=60)
    assert r.status_code == 200, server.log_tail()
    plain = requests.post(f"{server.http}/predictions/plain", data=BODY, headers=HDR, timeout=60)
    assert r.json() == plain.json()
    # Imported from the model's own directory, never from the server's environment.
    assert f".mariner-requirements/{PACKAGE}" in server.log_text()


def test_a_requirement_pip_cannot_install_fails_only_that_model(server: MarinerServe) -> None:
    failed = _entry(server, "needs_missing")
    assert failed["mariner"]["state"] == "FAILED"
    assert failed["modelVersion"] == "1.0", "the archive was read: its version is known"
    assert "mariner-no-such-package-anywhere" in failed["mariner"]["error"]
    assert "pip exited" in failed["mariner"]["error"]
    assert _entry(server, "plain")["mariner"]["state"] == "READY"
    assert _entry(server, "needs_pkg")["mariner"]["state"] == "READY"
    assert "No matching distribution found for mariner-no-such-package-anywhere" in server.log_text()


def test_register_installs_requirements_and_refuses_naming_the_requirement(server: MarinerServe) -> None:
    mgmt = f"{server.management}/models"
    ok = requests.post(
        mgmt, params={"url": "needs_pkg.mar", "model_name": "again", "synchronous": "true"}, timeout=300
    )
    assert ok.status_code == 200, ok.text
    r = requests.post(f"{server.http}/predictions/again", data=BODY, headers=HDR, timeout=60)
    assert r.status_code == 200, r.text
    bad = requests.post(mgmt, params={"url": "needs_missing.mar", "model_name": "bad_reg"}, timeout=300)
    assert bad.status_code == 400, bad.text
    assert "mariner-no-such-package-anywhere" in bad.json()["message"]
    assert "bad_reg" not in server.served_models()


def test_with_the_setting_off_requirements_are_not_installed(store: Path) -> None:
    """The default, as TorchServe's: the handler then cannot import its requirement."""
    srv = MarinerServe(store, "plain=plain.mar,needs_pkg=needs_pkg.mar")
    with srv.start(require_ready=False):
        assert _entry(srv, "plain")["mariner"]["state"] == "READY"
        assert _entry(srv, "needs_pkg")["mariner"]["state"] == "FAILED"
        assert "install_py_dep_per_model is off" in srv.log_text()
        assert f"No module named '{PACKAGE}'" in srv.log_text()


def test_requirements_that_reach_beyond_packages_are_refused_before_pip(
    server: MarinerServe, decoy_index: socket.socket
) -> None:
    """Replays the review's attacks: each register is a 400 naming the line, pip never runs (the
    index the archive names is never contacted), and nothing of the outside file is quoted."""
    for name in ATTACKS:
        r = requests.post(
            f"{server.management}/models",
            params={"url": f"{name}.mar", "model_name": name, "synchronous": "true"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert "requirementsFile requirements.txt line 2:" in message
        assert "no options such as -r" in message
        assert SECRET not in message
        assert name not in server.served_models()
    with pytest.raises(TimeoutError):
        decoy_index.accept()  # nobody came: no pip ran with the archive's index
    assert SECRET not in server.log_text()
