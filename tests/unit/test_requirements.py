"""Per-model requirements (install_py_dep_per_model): the pip call, its environment, and how a
failure is reported; pip itself is a fake here (the integration test runs the real one)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from mariner.server.common.archive import REQUIREMENTS_DIR, ModelArchive, requirements_dir
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.supervisor.requirement_lines import (
    MAX_FILE_BYTES,
    MAX_REQUIREMENTS,
    RequirementsRefused,
    parse_requirements,
    read_requirements,
)
from mariner.server.supervisor.requirements import (
    PipLimits,
    install_requirements,
    last_lines,
    pip_command,
    pip_environment,
    requirements_step,
)
from mariner.server.worker.main import isolate_sys_path

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
    assert argv[-1] == "text-unidecode==1.3", "the checked requirement, never the file"
    assert "-r" not in argv
    assert "--only-binary=:all:" in argv, "wheels only unless the operator allows builds"
    assert not {"-i", "--index-url", "--extra-index-url"} & set(argv), (
        "the server's pip configuration picks the index"
    )
    # An empty directory of its own, where its temporary files go too; removed afterwards.
    assert seen["cwd"] != str(a.model_dir)
    assert seen["env"]["TMPDIR"] == seen["cwd"]
    assert not Path(seen["cwd"]).exists()
    assert seen["env"]["PIP_FIND_LINKS"] == "/wheels"
    assert "MARINER_MANAGEMENT_TOKEN" not in seen["env"]


def test_pip_command_names_no_index_and_builds_only_when_allowed() -> None:
    target = Path("/w/m/.mariner-requirements")
    cmd = pip_command("/usr/bin/python3", target, ["numpy>=1"])
    assert cmd[:4] == ["/usr/bin/python3", "-m", "pip", "install"]
    assert not any("index" in part for part in cmd)
    assert cmd[-2:] == ["--only-binary=:all:", "numpy>=1"]
    assert "--only-binary=:all:" not in pip_command("p", target, ["numpy"], allow_builds=True)
    env = pip_environment({"MARINER_INFERENCE_TOKEN_FILE": "/t", "PIP_INDEX_URL": "x"})
    assert env == {"PIP_INDEX_URL": "x", "PYTHONUNBUFFERED": "1"}


def test_a_failed_install_names_what_was_asked_and_never_quotes_pip(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a = archive(tmp_path)
    noise = "".join(f"print('Collecting thing {i}')\n" for i in range(30))
    python = fake_python(
        tmp_path,
        noise + "print('ERROR: Could not find a version that satisfies nope-pkg', file=sys.stderr)\n"
        "print('root:x:0:0 from a file pip read', file=sys.stderr)\nsys.exit(1)",
    )
    with caplog.at_level("ERROR", logger="mariner.supervisor"), pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}))
    err = info.value
    assert err.code is Code.INVALID_ARGUMENT
    assert err.message.startswith("archive toy.mar: model toy version 1.0")
    assert "pip exited 1" in err.message
    assert "text-unidecode==1.3" in err.message
    assert "root:x" not in err.message, "pip's output may echo what it read: never in the answer"
    assert "root:x:0:0 from a file pip read" in caplog.text, "it is in the operator's log"
    assert "Collecting thing 0" not in caplog.text, "only pip's last lines"
    assert not requirements_dir(a.model_dir).exists()


def test_a_pip_that_hangs_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    a = archive(tmp_path)
    python = fake_python(tmp_path, "print('Downloading big.whl', flush=True)\ntime.sleep(600)")
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}, limits=PipLimits(timeout_s=1.0)))
    assert "pip was stopped after 1 s (install_py_dep_timeout_s)" in info.value.message


def test_a_pip_that_writes_past_the_disk_cap_is_stopped(tmp_path: Path) -> None:
    """pip's downloads land in its TMPDIR and its installs in the target: both are counted."""
    a = archive(tmp_path)
    python = fake_python(
        tmp_path,
        "for i in range(64):\n"
        "    with open(os.path.join(os.environ['TMPDIR'], f'chunk{i}'), 'wb') as f:\n"
        "        f.write(os.urandom(1 << 20))\n"
        "time.sleep(600)",
    )
    limits = PipLimits(timeout_s=60.0, max_bytes=4 << 20)
    t0 = time.monotonic()
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}, limits=limits))
    assert "passed 4 MiB (install_py_dep_max_mb)" in info.value.message
    assert time.monotonic() - t0 < 30, "stopped at the cap, not at the timeout"
    assert not Path(call(tmp_path)["cwd"]).exists(), "its files are removed"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("-r ../../outside/secret.txt", "is a pip option"),
        ("--requirement=/etc/passwd", "is a pip option"),
        ("-c constraints.txt", "is a pip option"),
        ("-e .", "is a pip option"),
        ("--index-url http://127.0.0.1:9/simple", "is a pip option"),
        ("--extra-index-url=http://127.0.0.1:9/simple", "is a pip option"),
        ("-f http://127.0.0.1:9/wheels", "is a pip option"),
        ("--trusted-host 127.0.0.1", "is a pip option"),
        ("numpy --hash=sha256:00", "is not a package requirement"),
        ("./local_pkg", "is not a package requirement"),
        ("../../outside/pkg", "is not a package requirement"),
        ("/abs/path/pkg-1.0.tar.gz", "is not a package requirement"),
        ("pkg-1.0-py3-none-any.whl", "names a file"),
        ("pkg.tar.gz", "names a file"),
        ("pkg @ file:///outside/pkg", "names a URL"),
        ("https://127.0.0.1:9/pkg.whl", "is not a package requirement"),
    ],
)
def test_a_line_that_is_not_a_package_requirement_is_refused_before_pip(
    tmp_path: Path, line: str, why: str
) -> None:
    a = archive(tmp_path)
    (a.model_dir / "requirements.txt").write_text(f"# ours\ntext-unidecode==1.3\n\n{line}\n")
    python = fake_python(tmp_path, "sys.exit(0)")
    with pytest.raises(ServingError) as info:
        asyncio.run(install_requirements(a, python=python, environ={}))
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "requirementsFile requirements.txt line 4:" in info.value.message
    assert why in info.value.message
    assert "no options such as -r" in info.value.message, "says what is allowed"
    assert not (tmp_path / "call.json").exists(), "pip never ran"


def test_requirements_are_read_as_pip_reads_a_plain_list() -> None:
    text = (
        "\ufeff# a comment\n"
        "numpy>=1.26,<3 ; python_version >= '3.10'   # trailing comment\n"
        "requests[socks] \\\n"
        "  ==2.34.2\n"
        "\n"
        "Text_Unidecode\n"
    )
    assert parse_requirements(text.lstrip("\ufeff"), shown_as="r.txt") == [
        'numpy<3,>=1.26; python_version >= "3.10"',
        "requests[socks]==2.34.2",
        "Text_Unidecode",
    ]


def test_a_requirements_file_too_large_or_not_utf8_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"# x\n" * (MAX_FILE_BYTES // 4 + 1))
    with pytest.raises(RequirementsRefused, match="more than the limit of 65536"):
        read_requirements(big, shown_as="big.txt")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    with pytest.raises(RequirementsRefused, match="not UTF-8"):
        read_requirements(latin, shown_as="latin.txt")
    many = "\n".join(f"pkg{i}" for i in range(MAX_REQUIREMENTS + 1))
    with pytest.raises(RequirementsRefused, match=f"line {MAX_REQUIREMENTS + 1}: more than"):
        parse_requirements(many, shown_as="many.txt")


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
    from mariner.server.common.config_loading import load_config

    props = tmp_path / "config.properties"
    props.write_text("install_py_dep_per_model=true\n")
    with caplog.at_level("WARNING", logger="mariner.config"):
        assert load_config(["--config-file", str(props)], env={}).install_py_dep_per_model is True
    assert "install_py_dep_per_model" not in caplog.text, "understood, so not warned about"
    assert load_config([], env={}).install_py_dep_per_model is False
