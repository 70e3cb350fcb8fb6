"""One resolution of a model's serving settings: default_* < models= < archive < flags/env < register call.

The layer functions are tested alone, then through the DataPlane's real open path with a tiny
archive (nothing is loaded: the endpoint is built, its settings read back, its batcher faked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import zipfile
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from mariner.server.common.archive_settings import archive_overrides
from mariner.server.common.config import ServerConfig
from mariner.server.common.metrics import Metrics
from mariner.server.common.model_settings import ModelSettings, SettingsOverrides, resolve_model_settings
from mariner.server.common.models import ModelSpec
from mariner.server.common.register_settings import register_call_overrides
from mariner.server.common.settings_layers import ServerLayers
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.types import InferRequest, InferResult, ModelState, WireProtocol
from mariner.server.frontend.batcher import Batcher
from mariner.server.frontend.dataplane import DataPlane
from mariner.server.frontend.endpoint import ModelEndpoint
from mariner.server.supervisor.registry import ModelRegistry

pytestmark = pytest.mark.unit

# Four layers, each giving every setting a different value (ARCHIVE beats PROPERTIES).
ARCHIVE = {"batchSize": 32, "maxBatchDelay": 5, "responseTimeout": 30, "minWorkers": 1, "maxWorkers": 4}
PROPERTIES = {"batchSize": 16, "maxBatchDelay": 3, "responseTimeout": 9, "minWorkers": 2, "maxWorkers": 5}
FLAGS = {"batchSize": 8, "maxBatchDelay": 2, "responseTimeout": 7, "minWorkers": 3, "maxQueue": 50}
CALL = {"batch_size": "4", "max_batch_delay": "1", "response_timeout": "6", "initial_workers": "6"}


def layers() -> list[SettingsOverrides]:
    return [
        SettingsOverrides.parse(PROPERTIES, "properties"),
        archive_overrides(ARCHIVE, "toy.mar"),
        SettingsOverrides.parse(FLAGS, "flags"),
        register_call_overrides(**CALL),
    ]


def test_defaults_when_no_layer_says_anything() -> None:
    assert resolve_model_settings() == ModelSettings(
        batch_size=1, max_batch_delay_ms=100.0, response_timeout_s=120.0, min_workers=1, max_workers=1
    )
    assert (
        resolve_model_settings(SettingsOverrides.parse({"handler": {"topk": 3}}, "archive"))
        == ModelSettings()
    )


def test_each_layer_overrides_the_one_below() -> None:
    properties, archive, flags, call = layers()
    assert resolve_model_settings(properties) == ModelSettings(16, 3.0, 9.0, 2, 5)
    assert resolve_model_settings(properties, archive) == ModelSettings(32, 5.0, 30.0, 1, 4)
    # flags say nothing about maxWorkers: the archive's 4 stays; maxQueue only comes from flags
    assert resolve_model_settings(properties, archive, flags) == ModelSettings(
        8, 2.0, 7.0, 3, 4, max_queue=50
    )
    assert resolve_model_settings(properties, archive, flags, call) == ModelSettings(4, 1.0, 6.0, 6, 6, 50)
    # order is what decides, not which kind of layer it is
    assert resolve_model_settings(call, flags, archive, properties) == ModelSettings(16, 3.0, 9.0, 2, 5, 50)


@pytest.mark.parametrize("setting", [f.name for f in fields(ModelSettings)])
def test_a_layer_that_is_silent_on_a_setting_leaves_the_lower_value(setting: str) -> None:
    low = SettingsOverrides(
        batch_size=2,
        max_batch_delay_ms=2.0,
        response_timeout_s=2.0,
        min_workers=2,
        max_workers=2,
        max_queue=2,
        device_type="cpu",
        startup_timeout_s=2.0,
    )
    high_values = {"batch_size": 9, "max_batch_delay_ms": 9.0, "response_timeout_s": 9.0, "min_workers": 1}
    high_values |= {"max_workers": 9, "max_queue": 9, "device_type": "gpu", "startup_timeout_s": 9.0}
    del high_values[setting]
    resolved = resolve_model_settings(low, SettingsOverrides(**high_values))
    for name, value in high_values.items():
        assert getattr(resolved, name) == value
    expected_low = getattr(low, setting)
    assert getattr(resolved, setting) == expected_low


def test_max_workers_follows_a_higher_min_workers() -> None:
    archive = SettingsOverrides(min_workers=1, max_workers=2)
    assert resolve_model_settings(archive, SettingsOverrides(min_workers=4)).max_workers == 4
    assert resolve_model_settings(archive, SettingsOverrides(min_workers=2)).max_workers == 2


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"batchSize": "lots"}, "batchSize must be a positive integer, got 'lots' (from archive x.mar)"),
        ({"batchSize": 0}, "batchSize must be a positive integer, got 0 (from archive x.mar)"),
        ({"batchSize": 2.5}, "batchSize must be a positive integer, got 2.5 (from archive x.mar)"),
        ({"batchSize": True}, "batchSize must be a positive integer, got True (from archive x.mar)"),
        ({"maxBatchDelay": -1}, "maxBatchDelay must be a number >= 0, got -1 (from archive x.mar)"),
        ({"maxBatchDelay": "soon"}, "maxBatchDelay must be a number >= 0, got 'soon' (from archive x.mar)"),
        ({"responseTimeout": 0}, "responseTimeout must be a number > 0, got 0 (from archive x.mar)"),
        ({"responseTimeout": "nan"}, "responseTimeout must be a number > 0, got 'nan' (from archive x.mar)"),
        ({"minWorkers": -2}, "minWorkers must be an integer >= 0, got -2 (from archive x.mar)"),
        ({"maxWorkers": "many"}, "maxWorkers must be an integer >= 0, got 'many' (from archive x.mar)"),
        ({"deviceType": "tpu"}, "deviceType must be one of 'cpu', 'gpu', got 'tpu' (from archive x.mar)"),
        # Past what TorchServe can hold (a Java int): refused before any timer or wire field sees it.
        (
            {"batchSize": 10**12},
            "batchSize must be at most 2147483647, got 1000000000000 (from archive x.mar)",
        ),
        ({"batchSize": 1e300}, "batchSize must be at most 2147483647, got 1e+300 (from archive x.mar)"),
        ({"maxQueue": 10**18}, f"maxQueue must be at most 2147483647, got {10**18} (from archive x.mar)"),
        (
            {"maxBatchDelay": 1e308},
            "maxBatchDelay must be at most 2147483647, got 1e+308 (from archive x.mar)",
        ),
        (
            {"responseTimeout": 1e300},
            "responseTimeout must be at most 2147483647, got 1e+300 (from archive x.mar)",
        ),
        (
            {"startupTimeout": "1e300"},
            "startupTimeout must be at most 2147483647, got '1e300' (from archive x.mar)",
        ),
        ({"minWorkers": 2**31}, "minWorkers must be at most 2147483647, got 2147483648 (from archive x.mar)"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ServingError) as err:
        SettingsOverrides.parse(values, "archive x.mar")
    assert err.value.code is Code.INVALID_ARGUMENT
    assert err.value.message == message


def test_values_from_text_are_converted() -> None:
    parsed = SettingsOverrides.parse(
        {"batchSize": " 8", "maxBatchDelay": "2.5", "responseTimeout": "60", "deviceType": "GPU", "x": 1}, "t"
    )
    assert parsed == SettingsOverrides(
        batch_size=8, max_batch_delay_ms=2.5, response_timeout_s=60.0, device_type="gpu"
    )
    assert parsed.given() == {
        "batch_size": 8,
        "max_batch_delay_ms": 2.5,
        "response_timeout_s": 60.0,
        "device_type": "gpu",
    }


def test_typed_overrides_are_checked_too() -> None:
    with pytest.raises(ServingError, match=r"^maxQueue must be a positive integer, got 0$"):
        SettingsOverrides(max_queue=0)


def test_register_call_zero_or_empty_means_the_default_but_a_zero_delay_is_kept() -> None:
    given = register_call_overrides(batch_size=-1, response_timeout="", initial_workers="")
    assert given == SettingsOverrides()
    assert register_call_overrides(max_batch_delay="0") == SettingsOverrides(max_batch_delay_ms=0.0)
    assert register_call_overrides(initial_workers=3) == SettingsOverrides(min_workers=3, max_workers=3)
    # startup_timeout 0 is TorchServe's too: the workers get no time to start (and fail)
    assert register_call_overrides(startup_timeout="0") == SettingsOverrides(startup_timeout_s=0.0)
    assert register_call_overrides(startup_timeout="-1") == SettingsOverrides()  # its "not given"


def test_initial_workers_zero_is_no_worker_under_the_archives_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchServe's handleRegister: initial_workers <= 0 registers no worker, even over
    default_workers_per_model, unless the archive gives minWorkers; absent, default_workers_per_model."""
    from mariner.server.common.archive import ModelArchive
    from mariner.server.common.configured_models import server_layers
    from mariner.server.common.models import resolve_model

    layers = server_layers(ServerConfig(default_workers_per_model=3), gpus=0, cores=2)

    def workers(initial: str | None, model_config: dict[str, Any]) -> int:
        archive = ModelArchive("toy", "1.0", tmp_path / "toy.mar", "", tmp_path, {"model": {}}, model_config)
        call = register_call_overrides(initial_workers=initial)
        spec = ModelSpec(archive="toy.mar", overrides=call, loaded_at_startup=False)
        return resolve_model(archive, spec, default_max_queue=None, layers=layers)[0].min_workers

    assert workers(None, {}) == 3  # absent: default_workers_per_model
    assert workers("0", {}) == 0
    assert workers("0", {"minWorkers": 2, "maxWorkers": 2}) == 2  # the archive's count wins
    assert workers("4", {"minWorkers": 2, "maxWorkers": 2}) == 4  # a count given wins (docs)
    with caplog.at_level(logging.WARNING, logger="mariner.management"):
        assert workers("-1", {}) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "register parameter initial_workers='-1' is below 0 (TorchServe accepts it): no worker instead "
        "(unless the archive or models= give minWorkers)"
    ]


@pytest.mark.parametrize(
    ("param", "value", "instead"),
    [
        ("batch_size", "dd", "batchSize (archive, models=, else 1)"),
        ("batch_size", "0", "batchSize"),
        ("batch_size", "2.0", "batchSize"),
        ("max_batch_delay", "junk", "maxBatchDelay (archive, models=, else 100 ms)"),
        ("max_batch_delay", "-5", "maxBatchDelay"),
        ("response_timeout", "x", "responseTimeout"),
        ("response_timeout", "0", "responseTimeout"),
        ("startup_timeout", "soon", "startupTimeout"),
        (
            "initial_workers",
            "1.5",
            "minWorkers (archive, models=, default_workers_per_model, else no worker)",
        ),
    ],
)
def test_register_values_torchserve_accepts_are_ignored_with_one_warning(
    param: str, value: str, instead: str, caplog: pytest.LogCaptureFixture
) -> None:
    """TorchServe registers these (its getIntParameter reads a non-number as "not given"): so
    does Mariner, leaving the setting to the lower layers and saying so once."""
    with caplog.at_level(logging.WARNING, logger="mariner.management"):
        assert register_call_overrides(**{param: value}) == SettingsOverrides()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"register parameter {param}={value!r}" in warnings[0]
    assert instead in warnings[0]


def test_properties_entry_is_chosen_by_mar_name_then_version_then_default() -> None:
    per_model = {
        "digits": {
            "1.0": {"marName": "digits_v1.mar", "batchSize": 1},
            "2.0": {"batchSize": 2},
            "3.0": {"marName": "other.mar", "defaultVersion": True, "batchSize": 3},
        }
    }
    server = ServerLayers(per_model=per_model, flags=SettingsOverrides(max_queue=7))

    def batch(version: str, archive: str) -> int | None:
        *_, properties, _archive, flags = server.for_model("digits", version, archive)
        assert flags == SettingsOverrides(max_queue=7)
        assert properties == server.models_entry("digits", version, archive)
        return properties.batch_size

    assert batch("9.9", "digits_v1.mar") == 1  # by marName, whatever the version
    assert batch("2.0", "digits_v2.mar") == 2  # by version key
    assert batch("4.0", "digits_v4.mar") == 3  # the defaultVersion entry
    assert server.models_entry("unknown", "1.0", "unknown.mar") == SettingsOverrides()


def test_bad_properties_entry_is_refused_when_the_layers_are_built() -> None:
    with pytest.raises(
        ServingError, match=r"^responseTimeout must be a number > 0, got -1 \(from config\.properties"
    ):
        ServerLayers(per_model={"digits": {"1.0": {"responseTimeout": -1}}})
    with pytest.raises(ServingError, match="must map versions to settings"):
        ServerLayers(per_model={"digits": 3})


# -- through the supervisor's registry and a frontend's endpoint -------------------------------
class QuietMetrics(Metrics):
    """Real metrics without the CUDA sampling, which would import torch into a unit test."""

    def _sample_gpu(self) -> None:
        pass


def make_mar(path: Path, config: str) -> Path:
    manifest = {
        "model": {"modelName": "toy", "modelVersion": "1.0", "handler": "h.py", "configFile": "c.yaml"}
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr("h.py", "def handle(data, context):\n    return data\n")
        zf.writestr("c.yaml", config)
    return path


def registry(tmp_path: Path, config: str, **settings: Any) -> ModelRegistry:
    """The supervisor's registry over a store holding toy.mar, with server settings `settings`
    (ServerConfig fields: flags, env or config file; `model_overrides` is config.properties'
    `models={...}`). Opening archives starts no worker."""
    store = tmp_path / "store"
    store.mkdir(exist_ok=True)
    make_mar(store / "toy.mar", config)
    (tmp_path / "work").mkdir(exist_ok=True)

    async def changed() -> None:
        return None

    cfg = replace(ServerConfig(), model_store=store, **settings)
    return ModelRegistry(cfg, tmp_path / "work", tmp_path, QuietMetrics(), changed)


def frontend_endpoint(reg: ModelRegistry) -> ModelEndpoint:
    """The endpoint a frontend builds from the registry's model table entry."""
    (entry,) = reg.table()
    return ModelEndpoint(entry, QuietMetrics())


# deviceType cpu keeps torch (asked whether CUDA exists) out of a unit test.
ARCHIVE_YAML = "batchSize: 32\nmaxBatchDelay: 5\nresponseTimeout: 30\nmaxWorkers: 4\ndeviceType: cpu\n"


def test_the_dataplane_resolves_every_layer_for_a_model_it_opens(tmp_path: Path) -> None:
    properties = {"toy": {"1.0": {"marName": "toy.mar", "batchSize": 16, "maxBatchDelay": 3}}}
    reg = registry(
        tmp_path,
        ARCHIVE_YAML,
        model_overrides=properties,
        batch_size=8,
        max_queue=64,
        default_workers_per_model=1,
    )
    asyncio.run(reg.open_models([ModelSpec("toy.mar")]))
    (info,) = reg.describe("toy")
    # flags over the archive (batchSize), the archive over models={...} (maxBatchDelay)
    assert (info.batch_size, info.max_batch_delay_ms, info.response_timeout_s) == (8, 5.0, 30.0)
    assert (info.min_workers, info.max_workers, info.queue_size, info.device_type) == (1, 4, 64, "cpu")
    assert info.loaded_at_startup is True
    assert reg.resolve("toy").settings == ModelSettings(8, 5.0, 30.0, 1, 4, 64, "cpu")
    endpoint = frontend_endpoint(reg)  # what a frontend batches with, from the table entry
    assert endpoint.settings == ModelSettings(8, 5.0, 30.0, 1, 4, 64, "cpu")
    policy = endpoint.policy
    assert (policy.max_batch_size, policy.max_batch_delay_s, policy.max_queue) == (8, 0.005, 64)


def test_the_register_call_is_the_top_layer(tmp_path: Path) -> None:
    reg = registry(tmp_path, ARCHIVE_YAML, batch_size=8, max_queue=64)
    call = register_call_overrides(batch_size="4", initial_workers="2")
    asyncio.run(reg.open_models([ModelSpec("toy.mar", overrides=call, loaded_at_startup=False)]))
    (info,) = reg.describe("toy")
    assert (info.batch_size, info.min_workers, info.max_workers, info.loaded_at_startup) == (4, 2, 2, False)


def test_an_archive_with_a_bad_setting_is_refused_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dp = registry(tmp_path, "batchSize: lots\n")
    asyncio.run(dp.open_models([ModelSpec("toy.mar")]))
    reason = "batchSize must be a positive integer, got 'lots' (from the model-config of toy.mar)"
    assert reason in caplog.text
    # Listed and described as FAILED with the reason, not served, and the server is not ready.
    (info,) = dp.models()
    assert (info.name, info.version, info.state, info.error) == ("toy", "1.0", ModelState.FAILED, reason)
    assert dp.describe("toy") == [info]
    assert not dp.model_ready("toy")
    assert not dp.is_ready()
    assert not any((tmp_path / "work").iterdir()), "a refused archive leaves nothing unpacked"


class HeldRunner:
    """Takes one batch and holds it until released, so later requests stay queued."""

    id = "held-0"

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def run(self, requests: Sequence[InferRequest]) -> list[InferResult]:
        self.started.set()
        await self.release.wait()
        return [InferResult(body=b"ok") for _ in requests]


def test_describe_reports_the_batchers_queue_depth(tmp_path: Path) -> None:
    reg = registry(tmp_path, ARCHIVE_YAML)
    asyncio.run(reg.open_models([ModelSpec("toy.mar")]))
    dp = DataPlane(QuietMetrics())  # a frontend's plane, serving the registry's table entry
    endpoint = frontend_endpoint(reg)
    dp.install_endpoint(endpoint)

    async def body() -> tuple[int, int]:
        runner = HeldRunner()
        endpoint.batcher = Batcher([runner], endpoint.policy)
        endpoint.batcher.start()

        def submit(i: int) -> asyncio.Task[InferResult]:
            req = InferRequest("toy", None, {"body": b""}, WireProtocol.TS_HTTP, f"r{i}")
            return asyncio.create_task(endpoint.batcher.submit(req))  # type: ignore[union-attr]

        first = submit(0)
        await runner.started.wait()  # r0 is running; the next three can only queue
        queued = [submit(i) for i in (1, 2, 3)]
        for _ in range(5):
            await asyncio.sleep(0)
        (during,) = dp.describe("toy")
        runner.release.set()
        await asyncio.gather(first, *queued)
        (after,) = dp.describe("toy")
        await endpoint.batcher.close(None)
        return during.pending_requests, after.pending_requests

    assert asyncio.run(body()) == (3, 0)


@pytest.mark.parametrize(("key", "meant"), [("batch_size", "batchSize"), ("MaxBatchDelay", "maxBatchDelay")])
def test_a_misspelt_model_config_key_is_refused_naming_the_key_meant(key: str, meant: str) -> None:
    with pytest.raises(ServingError) as info:
        archive_overrides({key: 4, "handler": {"batch_size": 1}}, "toy.mar")
    assert info.value.code is Code.INVALID_ARGUMENT
    assert (
        f"model-config key {key!r} is not one the server reads; did you mean {meant!r}?" in info.value.message
    )
    assert "toy.mar" in info.value.message
    assert archive_overrides({"handler": {"batch_size": 1}, "myKey": 2}, "toy.mar") == SettingsOverrides()


def test_the_worker_count_origin_is_the_highest_layer_that_sets_it() -> None:
    """What the worker budget's refusal names: the archive's minWorkers, models=, a flag, the
    register call's initial_workers; None for the built-in count (lowered, never refused)."""
    from mariner.server.common.settings_layers import REGISTER_CALL, LayerSource, worker_count_origin

    layers = ServerLayers(startup_workers=8)
    archive = SettingsOverrides(min_workers=500)
    named = layers.named_for_model("big", "1.0", "big.mar", archive)
    assert [layer for _, layer in named] == list(layers.for_model("big", "1.0", "big.mar", archive))
    assert worker_count_origin(named) == LayerSource("minWorkers", "the model-config of big.mar")
    assert worker_count_origin(layers.named_for_model("big", "1.0", "big.mar")) is None
    call = SettingsOverrides(min_workers=1000)
    assert worker_count_origin((*named, (REGISTER_CALL, call))) == REGISTER_CALL
    flagged = ServerLayers(
        flags=SettingsOverrides(min_workers=3), per_model={"big": {"1.0": {"minWorkers": 2}}}
    )
    assert worker_count_origin(flagged.named_for_model("big", "1.0", "big.mar")).worker_key == "min_workers"
    entry = ServerLayers(per_model={"big": {"1.0": {"minWorkers": 2}}}).named_for_model(
        "big", "1.0", "big.mar"
    )
    assert worker_count_origin(entry) == LayerSource("minWorkers", "config.properties models['big']['1.0']")


@pytest.mark.parametrize(
    "ids",
    [[-1], ["x"], [True], [1.5], [0] * 1025, [99999999999999999999], {"a": 0}, "0,,1", [[0]]],
)
def test_an_archives_device_ids_are_checked_on_any_machine(ids: Any) -> None:
    with pytest.raises(ServingError) as err:
        archive_overrides({"deviceIds": ids}, "x.mar")
    assert err.value.code is Code.INVALID_ARGUMENT
    assert err.value.message.startswith("deviceIds must be a list of at most 1024 GPU ids")
    assert err.value.message.endswith("(from the model-config of x.mar)")


def test_good_device_ids_pass() -> None:
    assert archive_overrides({"deviceIds": [0, 3], "batchSize": 2}, "x.mar").batch_size == 2
    assert archive_overrides({"deviceIds": "0, 1"}, "x.mar") == archive_overrides({}, "x.mar")
