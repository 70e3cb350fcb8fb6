"""Per-model requirements (install_py_dep_per_model): the pip call, its environment, and how a
failure is reported; pip itself is a fake here (the integration test runs the real one)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from mariner.server.core.archive import REQUIREMENTS_DIR, ModelArchive, requirements_dir
from mariner.server.core.errors import Code, ServingError
from mariner.server.supervisor.requirements import (
    install_requirements,
    last_lines,
    pip_command,
    pip_environment,
    requirements_step,
)
from mariner.server.workers.main import isolate_sys_path

pytestmark = pytest.mark.unit


def archive(tmp_path: Path, requirements: str | None = "requirements.txt") -> ModelArchive:
    model_dir = tmp_path / "model"
    model_dir.mkdir(parents=True)
    (model_dir / "requirements.txt").write_text("text-unidecode==1.3\n")
    model = {"modelName": "toy", "modelVersion": "1.0", "handler": "h.py"}
    if requirements is not None:
        model["requirementsFile"] = requirements
    return ModelArchive("toy", "1.0", tmp_path / "toy.mar", "0" * 64, model_dir, {"model": model})


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for `python -m pip`: records its argv and cwd, then runs `body`."""
    script = tmp_path / "fake-python"
    record = tmp_path / "call.json"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys, time\n"
        "seen = {'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': dict(os.environ)}\n"
        f"json.dump(seen, open({str(record)!r}, 'w'))\n"
        f"{body}\n"
    )
    script.chmod(0o755)
    return str(script)


def call(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "call.json").read_text())


def test_pip_installs_into_the_models_own_directory_with_the_servers_interpreter(tmp_path: Path) -> None:
    a = archive(tmp_path)
    python = fake_python(tmp_path, "sys.exit(0)")
    env = {"PIP_FIND_LINKS": "/wheels", "MARINER_MANAGEMENT_TOKEN": "secret", "HOME": "/root"}
    target = asyncio.run(install_requirements(a, python=python, environ=env))
    assert target == a.model_dir / REQUIREMENTS_DIR == requirements_dir(a.model_dir)
    seen = call(tmp_path)
    assert seen["argv"][:3] == ["-m", "pip", "install"]
    argv = seen["argv"]
    assert argv[argv.index("--target") + 1] == str(target)
    assert argv[argv.index("-r") + 1] == str((a.model_dir / "requirements.txt").resolve())
    assert not {"-i", "--index-url", "--extra-index-url"} & set(argv), (
        "pip's own configuration picks the index"
    )
    assert seen["cwd"] == str(a.model_dir)
    assert seen["env"]["PIP_FIND_LINKS"] == "/wheels"
    assert "MARINER_MANAGEMENT_TOKEN" not in seen["env"]


def test_pip_command_names_no_index() -> None:
    cmd = pip_command("/usr/bin/python3", Path("/w/m/.mariner-requirements"), Path("/w/m/r.txt"))
    assert cmd[:4] == ["/usr/bin/python3", "-m", "pip", "install"]
    assert not any("index" in part for part in cmd)
    env = pip_environment({"MARINER_INFERENCE_TOKEN_FILE": "/t", "PIP_INDEX_URL": "x"})
    assert env == {"PIP_INDEX_URL": "x", "PYTHONUNBUFFERED": "1"}


def test_a_failed_install_says_pips_reason(tmp_path: Path) -> None:
    a = archive(tmp_path)
    noise = "".join(f"print('Collecting thing {i}')\n" for i in range(30))
    python = fake_python(
        tmp_path,
        noise + "print('ERROR: Could not find a version that satisfies nope-pkg', file=sys.stderr)\n"
        "print('ERROR: No matching distribution found for nope-pkg', file=sys.stderr)\nsys.exit(1)",
    )
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}))
    err = info.value
    assert err.code is Code.INVALID_ARGUMENT
    assert err.message.startswith("archive toy.mar: model toy version 1.0")
    assert "pip exited 1" in err.message
    assert "No matching distribution found for nope-pkg" in err.message
    assert "Collecting thing 0" not in err.message, "only pip's last lines"


def test_a_pip_that_hangs_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    a = archive(tmp_path)
    python = fake_python(tmp_path, "print('Downloading big.whl', flush=True)\ntime.sleep(600)")
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}, timeout_s=1.0))
    assert "pip was stopped after 1 s" in info.value.message
    assert "Downloading big.whl" in info.value.message


def test_no_requirements_file_runs_no_pip_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    never = str(tmp_path / "no-such-python")
    assert asyncio.run(install_requirements(archive(tmp_path / "a", None), python=never)) is None
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(archive(tmp_path / "b", "../outside.txt"), python=never))
    assert "not a file inside the archive" in info.value.message


def test_with_the_setting_off_nothing_is_installed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a = archive(tmp_path)
    with caplog.at_level("INFO", logger="mariner.supervisor"):
        asyncio.run(requirements_step(a, install=False))
    assert not requirements_dir(a.model_dir).exists()
    assert "install_py_dep_per_model is off" in caplog.text


def test_the_worker_imports_installed_requirements_after_the_archive_before_site_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    monkeypatch.setattr(sys, "path", ["", "/site-packages"])
    isolate_sys_path(str(model_dir))
    assert sys.path == [str(model_dir), "/site-packages"], "no requirements installed: nothing added"
    requirements_dir(model_dir).mkdir()
    isolate_sys_path(str(model_dir))
    assert sys.path == [str(model_dir), str(requirements_dir(model_dir)), "/site-packages"]


def test_last_lines_keeps_the_end() -> None:
    assert last_lines("a\n\nb\nc\n", 2) == "b\nc"
    assert os.linesep not in last_lines("")


def test_the_torchserve_key_turns_it_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mariner.server.config import load_config

    props = tmp_path / "config.properties"
    props.write_text("install_py_dep_per_model=true\n")
    with caplog.at_level("WARNING", logger="mariner.config"):
        assert load_config(["--config-file", str(props)], env={}).install_py_dep_per_model is True
    assert "install_py_dep_per_model" not in caplog.text, "understood, so not warned about"
    assert load_config([], env={}).install_py_dep_per_model is False
