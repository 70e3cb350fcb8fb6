"""Config: flags > MARINER_* env > config file > defaults, and TorchServe's config.properties keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from mariner.server.config import ServerConfig, load_config, model_specs, read_properties

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
    assert (spec.batch_size, spec.max_batch_delay_ms, spec.min_workers, spec.response_timeout_s) == (
        16,
        3,
        2,
        9,
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
    assert [(s.name, s.archive, s.batch_size) for s in specs] == [("x", "a.mar", 8), (None, "b.mar", 8)]
