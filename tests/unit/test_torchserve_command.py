"""TorchServe's launcher command line (`torchserve --start/--stop`) split from the server's flags."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mariner.server.compat.torchserve import command as tc


def test_start_runs_in_the_background_unless_asked_or_pid_one() -> None:
    flags = ["--start", "--model-store", "store", "--ncs"]
    assert tc.parse(flags) == tc.Launch("start", False, tuple(flags))
    assert tc.parse([*flags, "--foreground"]).foreground
    # The first process of a container has no background to go to.
    assert tc.parse(flags, pid1=True).foreground


def test_launcher_flags_are_not_passed_to_the_server() -> None:
    launch = tc.parse(["--stop", "--foreground"])
    assert launch.action == "stop"
    assert launch.foreground
    assert "--stop" not in launch.serve_args
    assert tc.parse(["-v"]).action == "version"
    assert tc.parse(["--start", "--version"]).action == "version"


def test_a_kserve_runtime_gets_the_inference_api_where_kserve_routes() -> None:
    """KServe's TorchServe ServingRuntime routes to 8080, where TorchServe's KServe image runs its
    wrapper; its config.properties moves TorchServe's own listeners to 8085."""
    launch = tc.parse(["--start", "--ts-config=/mnt/models/config/config.properties"], kserve=True)
    assert launch.foreground
    assert launch.serve_args[-3:] == ("--inference-address", "0.0.0.0:8080", "--kserve-runtime")


def test_the_server_runs_under_this_interpreter() -> None:
    argv = tc.server_argv(["--ncs"])
    assert argv == [sys.executable, "-m", "mariner.server.cli", "serve", "--ncs"]


def test_a_pid_file_of_another_process_is_an_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tc.tempfile, "tempdir", None)
    path = tc.pid_file()
    assert path == tmp_path / ".model_server.pid"
    path.write_text(str(os.getpid()))  # pytest, not `mariner serve`
    assert tc.running_server(path) is None
    assert not path.exists()
    assert "Removing orphan pid file." in capsys.readouterr().out


def test_stop_with_nothing_running_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tc.tempfile, "tempdir", None)
    assert tc.main(["--stop"]) == 0
    assert capsys.readouterr().out == "TorchServe is not currently running.\n"


def test_foreground_start_becomes_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tc.tempfile, "tempdir", None)
    execs: list[list[str]] = []
    launch = tc.parse(["--start", "--foreground", "--model-store", "s"])
    assert tc.start(launch, exec_server=execs.append) == 0
    assert execs == [tc.server_argv(["--start", "--foreground", "--model-store", "s"])]
    # The pid file names this process, which exec turns into the server.
    assert tc.pid_file().read_text() == str(os.getpid())


def test_a_kserve_runtime_runs_on_torchserves_configuration_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The images bake MARINER_CONFIG_FILE for the Deployment; under a TorchServe runtime's args
    the server reads the runtime's config.properties, not that file over it."""
    monkeypatch.setenv("MARINER_CONFIG_FILE", "/etc/mariner/mariner.yaml")
    seen: list[str | None] = []

    def start(launch: object) -> int:
        seen.append(os.environ.get("MARINER_CONFIG_FILE"))
        return 0

    monkeypatch.setattr(tc, "start", start)
    assert tc.main(["--start", "--ts-config=/mnt/models/config/config.properties"]) == 0
    assert tc.main(["--start", "--ts-config=/mnt/models/config/config.properties"], kserve=True) == 0
    assert seen == ["/etc/mariner/mariner.yaml", None]


def test_the_pid_file_replaces_a_planted_link_and_is_ours_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$TMPDIR is shared: a link planted at the pid file's name must not send the write elsewhere."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tc.tempfile, "tempdir", None)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    tc.pid_file().symlink_to(victim)
    assert tc.start(tc.parse(["--start", "--foreground"]), exec_server=lambda argv: None) == 0
    assert victim.read_text() == "keep"
    assert not tc.pid_file().is_symlink()
    assert tc.pid_file().read_text() == str(os.getpid())
    assert tc.pid_file().stat().st_mode & 0o777 == 0o600


def test_stop_names_a_server_it_may_not_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tc.tempfile, "tempdir", None)
    monkeypatch.setattr(tc, "running_server", lambda path: 4242)

    def refuse(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tc.os, "kill", refuse)
    assert tc.main(["--stop"]) == 1
    assert capsys.readouterr().out == "TorchServe (pid 4242) runs as another user: it was not stopped.\n"
