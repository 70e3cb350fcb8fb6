"""Config: flags > MARINER_* env > config file > defaults, and TorchServe's config.properties keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from mariner.server.config import ServerConfig, load_config, model_specs, read_properties, server_layers
from mariner.server.core.errors import Code, ServingError
from mariner.server.core.model_settings import ModelSettings, SettingsOverrides, resolve_model_settings

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
    archive = SettingsOverrides(batch_size=32, max_batch_delay_ms=5, response_timeout_s=30, max_workers=4)
    resolved = resolve_model_settings(archive, *server_layers(cfg).for_model("digits", "1.0", "digits.mar"))
    assert resolved == ModelSettings(
        batch_size=16, max_batch_delay_ms=3.0, response_timeout_s=9.0, min_workers=2, max_workers=4
    )


def test_properties_continuations_and_comments() -> None:
    props = read_properties("# c\n! c\na=1\nb = two \\\n  parts\n\nc=x=y\n")
    assert props == {"a": "1", "b": "two parts", "c": "x=y"}


def test_model_list_forms(tmp_path: Path) -> None:
    for name in ("b.mar", "a.mar"):
        (tmp_path / name).write_bytes(b"")
    cfg = load_config(["--model-store", str(tmp_path)], env={})
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
