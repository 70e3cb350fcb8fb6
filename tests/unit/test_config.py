"""Config: flags > MARINER_* env > config file > defaults, and TorchServe's config.properties keys."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mariner.server.common.config import ServerConfig
from mariner.server.common.config_loading import load_config
from mariner.server.common.configured_models import model_specs, server_layers
from mariner.server.common.model_settings import ModelSettings, SettingsOverrides, resolve_model_settings
from mariner.server.compat.torchserve.java_properties import read_properties
from mariner.server.contracts.errors import Code, ServingError

pytestmark = pytest.mark.unit


def test_defaults_bind_loopback_on_torchserve_ports() -> None:
    cfg = load_config([], env={})
    assert cfg == ServerConfig()
    for address, port in (
        (cfg.inference_address, 8080),
        (cfg.management_address, 8081),
        (cfg.metrics_address, 8082),
        (cfg.grpc_inference_address, 7070),
        (cfg.grpc_management_address, 7071),
    ):
        assert address == f"127.0.0.1:{port}"
    assert cfg.enable_model_management is False


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "mariner.yaml"
    f.write_text("batch_size: 4\nmax_queue: 10\nslo_ms: 50\n")
    env = {
        "MARINER_CONFIG_FILE": str(f),
        "MARINER_MAX_QUEUE": "20",
        "MARINER_ENABLE_MODEL_MANAGEMENT": "true",
    }
    cfg = load_config(["--max-queue", "30", "--torch-threads", "1"], env=env)
    assert cfg.batch_size == 4  # file
    assert cfg.slo_ms == 50.0
    assert cfg.max_queue == 30  # flag beats env beats file
    assert cfg.enable_model_management is True  # env
    assert cfg.torch_threads == 1
    assert load_config([], env=env).max_queue == 20


def test_unknown_config_file_keys_are_an_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("batch_sise: 4\n")
    with pytest.raises(ValueError, match="batch_sise"):
        load_config(["--config-file", str(f)], env={})


def test_torchserve_config_properties_are_understood(tmp_path: Path) -> None:
    props = tmp_path / "config.properties"
    props.write_text(
        "# TorchServe config users already have\n"
        "inference_address=http://0.0.0.0:9080\n"
        "management_address=http://127.0.0.1:9081\n"
        "metrics_address=http://127.0.0.1:9082\n"
        "grpc_inference_port=9070\n"
        "grpc_management_port=9071\n"
        f"model_store={tmp_path}\n"
        "load_models=digits.mar\n"
        'models={"digits": {"1.0": {"defaultVersion": true, "marName": "digits.mar", \\\n'
        '    "minWorkers": 2, "batchSize": 16, "maxBatchDelay": 3, "responseTimeout": 9}}}\n'
    )
    cfg = load_config(["--config-file", str(props)], env={})
    assert cfg.inference_address == "0.0.0.0:9080"
    assert cfg.management_address == "127.0.0.1:9081"
    assert cfg.grpc_inference_address == "127.0.0.1:9070"
    assert cfg.grpc_management_address == "127.0.0.1:9071"
    assert cfg.model_store == tmp_path
    (spec,) = model_specs(cfg)
    assert spec.archive == "digits.mar"
    # The archive's values beat models={...}; minWorkers, which the archive leaves out, comes from it.
    archive = SettingsOverrides(batch_size=32, max_batch_delay_ms=5, response_timeout_s=30, max_workers=4)
    resolved = resolve_model_settings(*server_layers(cfg).for_model("digits", "1.0", "digits.mar", archive))
    assert resolved == ModelSettings(
        batch_size=32, max_batch_delay_ms=5.0, response_timeout_s=30.0, min_workers=2, max_workers=4
    )


def test_properties_continuations_and_comments() -> None:
    props = read_properties("# c\n! c\na=1\nb = two \\\n  parts\n\nc=x=y\n")
    assert props == {"a": "1", "b": "two parts", "c": "x=y"}


def test_model_list_forms(tmp_path: Path) -> None:
    for name in ("b.mar", "a.mar"):
        (tmp_path / name).write_bytes(b"")
    # TorchServe's default: no --models, no model at start-up; "all" (any case) loads the store.
    cfg = load_config(["--model-store", str(tmp_path)], env={}, cwd=tmp_path)
    assert cfg.models == ""
    assert model_specs(cfg) == []
    for every in ("all", "ALL", "All"):
        cfg = load_config(["--model-store", str(tmp_path), "--models", every], env={}, cwd=tmp_path)
        assert [s.archive for s in model_specs(cfg)] == ["a.mar", "b.mar"]
    cfg = load_config(["--model-store", str(tmp_path), "--models", "x=a.mar, b", "--batch-size", "8"], env={})
    specs = model_specs(cfg)
    assert [(s.name, s.archive, s.loaded_at_startup) for s in specs] == [
        ("x", "a.mar", True),
        (None, "b.mar", True),
    ]
    # --batch-size is the flags layer every model resolves over, whatever its archive says.
    for name, archive in (("x", "a.mar"), ("b", "b.mar")):
        layers = server_layers(cfg).for_model(name, "1.0", archive)
        assert resolve_model_settings(SettingsOverrides(batch_size=32), *layers).batch_size == 8


def test_bad_model_settings_in_config_stop_the_server_naming_the_field(tmp_path: Path) -> None:
    props = tmp_path / "config.properties"
    props.write_text('models={"digits": {"1.0": {"marName": "digits.mar", "batchSize": "lots"}}}\n')
    cfg = load_config(["--config-file", str(props)], env={})
    with pytest.raises(ServingError) as err:
        server_layers(cfg)
    assert err.value.code is Code.INVALID_ARGUMENT
    assert err.value.message == (
        "batchSize must be a positive integer, got 'lots' (from config.properties models['digits']['1.0'])"
    )
    cfg = load_config(["--max-batch-delay-ms", "-5"], env={})
    with pytest.raises(
        ServingError, match=r"^maxBatchDelay must be a number >= 0, got -5\.0 \(from the server's flags"
    ):
        server_layers(cfg)


TLS_EVERYWHERE = (
    "inference_address=https://127.0.0.1:8443\n"
    "management_address=https://127.0.0.1:8444\n"
    "metrics_address=https://127.0.0.1:8445\n"
    "enable_grpc_ssl=true\n"
    "private_key_file=/etc/ts/key.pem\n"
    "certificate_file=/etc/ts/cert.pem\n"
)


def _properties(tmp_path: Path, text: str) -> ServerConfig:
    props = tmp_path / "config.properties"
    props.write_text(text)
    return load_config(["--config-file", str(props)], env={})


def test_torchserve_tls_keys_turn_on_our_tls(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mariner.config"):
        cfg = _properties(tmp_path, TLS_EVERYWHERE)
    assert (cfg.tls_cert_file, cfg.tls_key_file) == (Path("/etc/ts/cert.pem"), Path("/etc/ts/key.pem"))
    assert (cfg.inference_address, cfg.management_address, cfg.metrics_address) == (
        "127.0.0.1:8443",
        "127.0.0.1:8444",
        "127.0.0.1:8445",
    )
    assert caplog.records == [], "every key of this file is honoured"


def test_tls_without_pem_files_is_refused_and_keystores_are_not_key_material(tmp_path: Path) -> None:
    no_key = TLS_EVERYWHERE.replace("private_key_file=/etc/ts/key.pem\n", "")
    with pytest.raises(ValueError, match="without private_key_file$"):
        _properties(tmp_path, no_key)
    keystore_only = (
        TLS_EVERYWHERE.replace("private_key_file=/etc/ts/key.pem\n", "").replace(
            "certificate_file=/etc/ts/cert.pem\n", ""
        )
        + "keystore=keystore.p12\nkeystore_pass=changeit\nkeystore_type=PKCS12\n"
    )
    with pytest.raises(ValueError, match="without private_key_file and certificate_file") as info:
        _properties(tmp_path, keystore_only)
    assert "Java keystores are not supported" in str(info.value)
    assert "changeit" not in str(info.value)


def test_keys_mariner_does_not_use_are_named_in_one_warning_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = (
        "inference_address=http://127.0.0.1:9080\n"
        "no_such_key=1\n"
        "vmargs=-Xmx1g\n"
        "allowed_urls=https://s3.amazonaws.com/.*\n"
        "keystore=keystore.p12\n"
        "private_key_file=key.pem\n"
        "grpc_inference_address=0.0.0.0\n"
        "enable_model_api=true\n"
        "disable_token_authorization=true\n"  # honoured: TorchServe's token authorization off
    )
    with caplog.at_level(logging.WARNING, logger="mariner.config"):
        cfg = _properties(tmp_path, text)
    warned = sorted(r.getMessage().split()[1] for r in caplog.records)
    assert warned == ["allowed_urls", "keystore", "no_such_key", "private_key_file", "vmargs"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert "never from a URL" in caplog.text, "a key that changes security says what Mariner does instead"
    assert cfg.tls_cert_file is None, "a key file with no https listener stays unused, as in TorchServe"
    assert cfg.grpc_inference_address == "0.0.0.0:7070", "a gRPC host without a port keeps the default port"
    assert cfg.enable_model_management is True
    assert cfg.disable_token_auth is True


@pytest.mark.parametrize("address", ["unix:/tmp/management.sock", "ftp://127.0.0.1:21", "https://:8443"])
def test_addresses_mariner_cannot_listen_on_are_refused(tmp_path: Path, address: str) -> None:
    with pytest.raises(ValueError, match="management_address"):
        _properties(tmp_path, f"management_address={address}\n")


def test_the_metrics_dir_goes_under_the_work_dir_from_any_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prometheus_client's multiprocess dir is made before the config is loaded (it must be set
    before prometheus_client is imported), yet follows the work dir from a flag, the environment
    or the config file, with the usual precedence."""
    from mariner.server import cli

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "unused")  # restored after the test
    monkeypatch.delenv("MARINER_WORK_DIR", raising=False)
    monkeypatch.delenv("MARINER_CONFIG_FILE", raising=False)
    config = tmp_path / "mariner.yaml"
    config.write_text(f"work_dir: {tmp_path / 'from-file'}\n")
    assert cli._private_metrics_dir(["--config-file", str(config)]).parent == tmp_path / "from-file"
    monkeypatch.setenv("MARINER_WORK_DIR", str(tmp_path / "from-env"))
    assert cli._private_metrics_dir([f"--config-file={config}"]).parent == tmp_path / "from-env"
    flag = ["--config-file", str(config), "--work-dir", str(tmp_path / "from-flag")]
    assert cli._private_metrics_dir(flag).parent == tmp_path / "from-flag"
