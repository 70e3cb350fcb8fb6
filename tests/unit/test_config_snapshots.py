"""TorchServe's config snapshots: the files written (name, format, permissions, how many kept),
which one a start restores and what it then serves."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_loading import load_config
from mariner.server.common.config_snapshots import (
    MAX_SNAPSHOTS,
    last_snapshot,
    properties_text,
    snapshot_dir,
    write_snapshot,
)
from mariner.server.common.configured_models import model_specs
from mariner.server.common.listeners import tls_listeners
from mariner.server.common.model_settings import SettingsOverrides
from mariner.server.compat.torchserve.java_properties import read_properties
from mariner.server.compat.torchserve.properties import from_torchserve_properties
from mariner.server.supervisor.snapshots import ConfigSnapshots, snapshot_properties

pytestmark = pytest.mark.unit

MODELS = {
    "digits": {
        "1.0": {"defaultVersion": False, "marName": "digits_v1.mar", "minWorkers": 2, "maxWorkers": 2,
                "batchSize": 4, "maxBatchDelay": 5, "responseTimeout": 60, "startupTimeout": 30,
                "runtimeType": "python"},
        "2.0": {"defaultVersion": True, "marName": "digits.mar", "minWorkers": 0, "maxWorkers": 0,
                "batchSize": 1, "maxBatchDelay": 100, "responseTimeout": 120, "startupTimeout": 120,
                "runtimeType": "python"},
    }
}  # fmt: skip
PROPS = {"inference_address": "https://127.0.0.1:8443", "model_store": "/srv/models", "load_models": "a.mar"}


def test_a_snapshot_is_torchserves_properties_file_written_privately(tmp_path: Path) -> None:
    directory = tmp_path / "logs" / "config"
    now = time.mktime((2026, 1, 31, 12, 0, 5, 0, 0, -1)) + 0.25
    path = write_snapshot(directory, "startup", PROPS, MODELS, now=now)
    assert path.name == "20260131120005250-startup.cfg"  # yyyyMMddHHmmssSSS-kind.cfg
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    text = path.read_text()
    assert text.startswith("#Saving snapshot\n#")
    assert "inference_address=https\\://127.0.0.1\\:8443\n" in text  # Properties.store's escapes
    props = read_properties(text)
    snapshot = json.loads(props.pop("model_snapshot"))
    assert props == PROPS
    assert snapshot == {"name": path.name, "modelCount": 2, "created": int(now * 1000), "models": MODELS}


def test_properties_text_reads_back_whatever_the_values_hold() -> None:
    tricky = {"a key": " lead:=#!\\x", "multi": "line one\nline two\ttab", "unicode": "caf\u00e9", "e": ""}
    assert read_properties(properties_text(tricky, time.time())) == tricky


def test_snapshots_are_kept_to_a_bounded_number_and_never_overwritten(tmp_path: Path) -> None:
    now = time.time()
    paths = [write_snapshot(tmp_path, "snapshot", {}, {}, now=now, keep=3) for _ in range(5)]
    assert len(set(paths)) == 5, "changes within one millisecond get their own files"
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in paths[-3:]]
    (tmp_path / "notes.txt").write_text("kept")  # not a snapshot: never removed
    write_snapshot(tmp_path, "shutdown", {}, {}, keep=3)
    assert (tmp_path / "notes.txt").exists()
    assert MAX_SNAPSHOTS >= 3
    with pytest.raises(ValueError, match="kind"):
        write_snapshot(tmp_path, "other", {}, {})


def test_the_newest_snapshot_is_restored_only_when_it_is_ours_alone(tmp_path: Path) -> None:
    directory = tmp_path / "config"
    assert last_snapshot(directory) is None
    old = write_snapshot(directory, "startup", {}, {}, now=1_000_000_000.0)
    new = write_snapshot(directory, "shutdown", {}, {}, now=1_000_000_100.0)
    (directory / "zzz.cfg").write_text("not a snapshot name")
    assert last_snapshot(directory) == new
    os.chmod(new, 0o666)  # anyone could have written what the next start serves
    assert last_snapshot(directory) is None
    os.chmod(new, 0o600)
    os.chmod(directory, 0o777)
    assert last_snapshot(directory) is None
    os.chmod(directory, 0o700)
    new.unlink()
    new.symlink_to(old)  # a symlink is not a snapshot file
    assert last_snapshot(directory) is None


def _snapshot_start(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> ServerConfig:
    env = {"LOG_LOCATION": str(tmp_path / "logs"), **(env or {})}
    props = {**PROPS, "inference_address": "http://127.0.0.1:9080", "model_store": str(tmp_path)}
    write_snapshot(snapshot_dir(env), "snapshot", props, MODELS)
    return load_config(list(argv), env=env, cwd=tmp_path)


def test_a_start_without_a_config_file_restores_the_newest_snapshot(tmp_path: Path) -> None:
    cfg = _snapshot_start(tmp_path, "--models", "other.mar")
    assert cfg.inference_address == "127.0.0.1:9080"
    assert cfg.model_store == tmp_path
    specs = model_specs(cfg)  # the snapshot's models, in place of --models (TorchServe's rule)
    assert [(s.name, s.archive, s.loaded_at_startup) for s in specs] == [
        ("digits", "digits.mar", True),  # the default version first: it becomes the default
        ("digits", "digits_v1.mar", True),
    ]
    assert specs[0].overrides == SettingsOverrides(
        min_workers=0, max_workers=0, batch_size=1, max_batch_delay_ms=100, response_timeout_s=120,
        startup_timeout_s=120,
    )  # fmt: skip
    assert specs[1].overrides.batch_size == 4


@pytest.mark.parametrize(
    "how",
    [["--ncs"], ["--no-config-snapshots"], ["--ts-config", "given.properties"], ["--config-file", "m.yaml"],
     "TS_CONFIG_FILE", "MARINER_CONFIG_SNAPSHOTS"],
)  # fmt: skip
def test_a_config_file_or_ncs_means_no_restore(tmp_path: Path, how: list[str] | str) -> None:
    (tmp_path / "given.properties").write_text("load_models=x.mar\n")
    (tmp_path / "m.yaml").write_text("models: x.mar\n")
    if isinstance(how, str):
        value = str(tmp_path / "given.properties") if how == "TS_CONFIG_FILE" else "false"
        cfg = _snapshot_start(tmp_path, env={how: value})
    else:
        cfg = _snapshot_start(
            tmp_path, *(str(tmp_path / a) if a.endswith(("ies", "yaml")) else a for a in how)
        )
    assert cfg.model_snapshot is None
    assert cfg.inference_address != "127.0.0.1:9080"


def test_the_settings_written_are_what_the_server_runs_with(tmp_path: Path) -> None:
    props = tmp_path / "config.properties"
    props.write_text(
        "inference_address=https://0.0.0.0:8443\nprivate_key_file=k.pem\ncertificate_file=c.pem\n"
        "enable_grpc_ssl=true\nmanagement_address=https://0.0.0.0:8444\nmetrics_address=https://0.0.0.0:8445\n"
        "load_models=a.mar\nasync_logging=true\nmodel_store=$$STORE$$\n"
    )
    cfg = load_config(
        ["--ts-config", str(props), "--models", "b.mar", "--enable-model-api", "--grpc-management-address",
         "127.0.0.1:9071"],
        env={"STORE": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    written = snapshot_properties(cfg, {"STORE": str(tmp_path)})
    assert written["inference_address"] == "https://0.0.0.0:8443"  # the file's, scheme and all
    assert written["async_logging"] == "true"  # a key Mariner does not use is still the file's
    assert written["model_store"] == str(tmp_path)  # $$VAR$$ substituted
    assert written["load_models"] == "b.mar"  # the flag beat the file
    assert written["enable_model_api"] == "true"
    assert (written["grpc_management_address"], written["grpc_management_port"]) == ("127.0.0.1", "9071")
    assert "model_snapshot" not in written
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plain = snapshot_properties(
        load_config(["--inference-address", "127.0.0.1:1"], env={}, cwd=elsewhere), {}
    )
    assert plain["inference_address"] == "http://127.0.0.1:1"
    assert "enable_model_api" not in plain
    assert "load_models" not in plain  # TorchServe's default: no model


def test_a_listener_is_written_with_the_tls_it_is_served_with(tmp_path: Path) -> None:
    """A restored snapshot must never serve in plain text what was encrypted: each listener's
    scheme follows the TLS in force for it (tls_listeners)."""
    cfg = ServerConfig(
        tls_cert_file=tmp_path / "c.pem",
        tls_key_file=tmp_path / "k.pem",
        tls_listeners="inference,grpc_management",
    )
    written = snapshot_properties(cfg, {})
    assert written["inference_address"].startswith("https://")
    assert written["management_address"].startswith("http://")
    assert (written["private_key_file"], written["enable_grpc_ssl"]) == (str(tmp_path / "k.pem"), "true")
    every = snapshot_properties(ServerConfig(tls_cert_file=Path("c"), tls_key_file=Path("k")), {})
    assert all(
        every[k].startswith("https://")
        for k in ("inference_address", "management_address", "metrics_address")
    )


def test_settings_the_running_server_overrode_are_written_as_it_runs(tmp_path: Path) -> None:
    """A restored snapshot must never come back with token authorization off, longer-lived keys
    or another address because the file said so while the server ran otherwise (flags, env)."""
    props = tmp_path / "config.properties"
    props.write_text(
        "disable_token_authorization=true\ntoken_expiration_min=600\ninstall_py_dep_per_model=true\n"
        "inference_address=http://0.0.0.0:8080\nmanagement_address=http://0.0.0.0:8081\n"
        "grpc_inference_port=7000\n"
    )
    env = {
        "MARINER_DISABLE_TOKEN_AUTH": "false",
        "MARINER_TOKEN_EXPIRATION_MIN": "5",
        "MARINER_INSTALL_PY_DEP_PER_MODEL": "false",
    }
    cfg = load_config(
        ["--ts-config", str(props), "--inference-address", "127.0.0.1:9080", "--grpc-inference-address",
         "127.0.0.1:9070"],
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert (cfg.disable_token_auth, cfg.token_expiration_min) == (False, 5.0)
    written = snapshot_properties(cfg, env)
    assert written["disable_token_authorization"] == "false"
    assert written["token_expiration_min"] == "5"
    assert written["install_py_dep_per_model"] == "false"
    assert written["inference_address"] == "http://127.0.0.1:9080"  # the flag beat the file
    assert written["management_address"] == "http://0.0.0.0:8081"  # the file's, as the server runs it
    assert (written["grpc_inference_address"], written["grpc_inference_port"]) == ("127.0.0.1", "9070")
    restored = from_torchserve_properties(written)
    assert (restored["disable_token_auth"], restored["token_expiration_min"]) == (False, 5.0)
    assert restored["install_py_dep_per_model"] == "false"
    assert restored["inference_address"] == "127.0.0.1:9080"
    assert restored["grpc_inference_address"] == "127.0.0.1:9070"
    off = snapshot_properties(replace(cfg, disable_token_auth=True, token_expiration_min=0.5), env)
    assert (off["disable_token_authorization"], off["token_expiration_min"]) == ("true", "0.5")


@pytest.mark.parametrize("listeners", [None, "", "inference", "grpc_inference", "metrics,grpc_management"])
def test_a_snapshots_tls_is_the_servers_tls_listeners(tmp_path: Path, listeners: str | None) -> None:
    """One rule for which listeners TLS covers: listeners.tls_listeners (an empty setting is no
    listener, not every one)."""
    cfg = ServerConfig(
        tls_cert_file=tmp_path / "c.pem", tls_key_file=tmp_path / "k.pem", tls_listeners=listeners
    )
    served = tls_listeners(cfg)
    written = snapshot_properties(cfg, {})
    for name in ("inference", "management", "metrics"):
        scheme = "https" if name in served else "http"
        assert written[f"{name}_address"].startswith(f"{scheme}://"), name
    grpc = bool({"grpc_inference", "grpc_management"} & served)
    assert written.get("enable_grpc_ssl") == ("true" if grpc else None)


def test_a_files_tls_the_server_does_not_serve_is_not_written(tmp_path: Path) -> None:
    props = tmp_path / "config.properties"
    props.write_text(
        "inference_address=https://127.0.0.1:8443\nmetrics_address=https://127.0.0.1:8445\n"
        "enable_grpc_ssl=true\nprivate_key_file=file-k.pem\ncertificate_file=file-c.pem\n"
    )
    cfg = load_config(
        ["--ts-config", str(props), "--tls-listeners", "inference", "--tls-key-file", str(tmp_path / "k.pem"),
         "--tls-cert-file", str(tmp_path / "c.pem")],
        env={}, cwd=tmp_path,
    )  # fmt: skip
    assert tls_listeners(cfg) == {"inference"}
    written = snapshot_properties(cfg, {})
    assert written["inference_address"] == "https://127.0.0.1:8443"
    assert written["metrics_address"] == "http://127.0.0.1:8445"
    assert "enable_grpc_ssl" not in written
    assert (written["private_key_file"], written["certificate_file"]) == (
        str(tmp_path / "k.pem"),
        str(tmp_path / "c.pem"),
    )


def test_a_stray_file_with_a_snapshot_like_name_stops_nothing(tmp_path: Path) -> None:
    """17 digits that are no date (month 13) are no snapshot: never parsed as a time, restored
    or pruned, and writing goes on."""
    directory = tmp_path / "config"
    directory.mkdir(mode=0o700)
    stray = [directory / "20991399000000000-snapshot.cfg", directory / "20241232250000000-startup.cfg"]
    for path in stray:
        path.write_text("not ours")
        os.chmod(path, 0o600)
    first = write_snapshot(directory, "startup", {}, {}, keep=1)
    second = write_snapshot(directory, "snapshot", {}, {}, keep=1)
    assert not first.exists()  # pruned down to one real snapshot
    assert second.exists()
    assert all(path.exists() for path in stray)
    assert last_snapshot(directory) == second


def test_a_stray_file_never_fails_the_supervisors_save(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    (log_dir / "config").mkdir(parents=True)
    (log_dir / "config" / "99991399999999999-shutdown.cfg").write_text("x")
    snapshots = ConfigSnapshots(
        ServerConfig(model_store=tmp_path), lambda: {}, {"LOG_LOCATION": str(log_dir)}
    )
    path = asyncio.run(snapshots.save("startup"))
    assert path is not None
    assert path.exists()
