"""TorchServe's configuration as TorchServe reads it: the per-model precedence (every layer
against every other), its built-in defaults, `TS_*` variables, `TS_CONFIG_FILE` and the
`torchserve` command line, all through `load_config` and `server_layers` as the server uses them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from mariner.server.common.archive_settings import archive_overrides
from mariner.server.common.config_loading import load_config
from mariner.server.common.configured_models import model_specs, server_layers
from mariner.server.common.model_settings import ModelSettings, resolve_model_settings
from mariner.server.common.register_settings import register_call_overrides
from mariner.server.compat.torchserve.properties_env import TS_ENV_KEYS, substitute_env, ts_env_props
from mariner.server.contracts.errors import ServingError

pytestmark = pytest.mark.unit

CORES = 6  # the machine's core count, injected: the built-in worker default must not be this host's

# The layers, lowest first, and how each spells each setting (absent: the layer cannot set it).
LAYERS = ("default", "models", "archive", "flags", "call")
SPELLING: dict[str, dict[str, str]] = {
    "default": {
        "min_workers": "default_workers_per_model",
        "response_timeout_s": "default_response_timeout",
        "max_queue": "job_queue_size",
    },
    "models": {
        "batch_size": "batchSize",
        "max_batch_delay_ms": "maxBatchDelay",
        "response_timeout_s": "responseTimeout",
        "min_workers": "minWorkers",
        "max_queue": "maxQueue",
    },
    "archive": {
        "batch_size": "batchSize",
        "max_batch_delay_ms": "maxBatchDelay",
        "response_timeout_s": "responseTimeout",
        "min_workers": "minWorkers",
        "max_queue": "jobQueueSize",  # TorchServe's model-config key for the queue
    },
    "flags": {
        "batch_size": "--batch-size",
        "max_batch_delay_ms": "--max-batch-delay-ms",
        "response_timeout_s": "--response-timeout-s",
        "min_workers": "--min-workers",
        "max_queue": "--max-queue",
    },
    "call": {
        "batch_size": "batch_size",
        "max_batch_delay_ms": "max_batch_delay",
        "response_timeout_s": "response_timeout",
        "min_workers": "initial_workers",
    },
}
BUILT_IN = ModelSettings(
    batch_size=1, max_batch_delay_ms=100.0, response_timeout_s=120.0, min_workers=CORES, max_workers=CORES
)


def resolve(tmp_path: Path, given: dict[str, dict[str, int]], *, startup: bool = True) -> ModelSettings:
    """The settings of model toy 1.0 (toy.mar) when each layer of `given` sets its settings,
    through a config.properties (`--ts-config`), flags, the archive's model-config and a
    register call, exactly as the server resolves them."""
    lines = [f"{SPELLING['default'][k]}={v}" for k, v in given.get("default", {}).items()]
    entry = {SPELLING["models"][k]: v for k, v in given.get("models", {}).items()}
    if "minWorkers" in entry:
        entry["maxWorkers"] = entry["minWorkers"]
    if entry:
        lines.append('models={"toy": {"1.0": ' + str(entry).replace("'", '"') + "}}")
    props = tmp_path / "ts.properties"
    props.write_text("\n".join(lines) + "\n")
    argv = ["--ts-config", str(props)]
    for k, v in given.get("flags", {}).items():
        argv += [SPELLING["flags"][k], str(v)]
    cfg = load_config(argv, env={}, cwd=tmp_path)
    yaml_config = {SPELLING["archive"][k]: v for k, v in given.get("archive", {}).items()}
    if "minWorkers" in yaml_config:
        yaml_config["maxWorkers"] = yaml_config["minWorkers"]
    archive = archive_overrides(yaml_config, "toy.mar")
    call = register_call_overrides(**{SPELLING["call"][k]: v for k, v in given.get("call", {}).items()})
    layers = server_layers(cfg, gpus=0, cores=CORES).for_model(
        "toy", "1.0", "toy.mar", archive, startup=startup
    )
    return resolve_model_settings(*layers, call)


def test_torchserves_built_in_defaults_when_nothing_is_set(tmp_path: Path) -> None:
    assert resolve(tmp_path, {}) == BUILT_IN
    assert BUILT_IN.max_queue == 100  # job_queue_size's default


PAIRS = [
    (setting, low, high)
    for setting in ("batch_size", "max_batch_delay_ms", "response_timeout_s", "min_workers", "max_queue")
    for low, high in itertools.combinations(LAYERS, 2)
    if setting in SPELLING[low] and setting in SPELLING[high]
]


@pytest.mark.parametrize(("setting", "low", "high"), PAIRS, ids=[f"{s}-{h}-over-{lo}" for s, lo, h in PAIRS])
def test_each_layer_beats_every_layer_below_it(tmp_path: Path, setting: str, low: str, high: str) -> None:
    values = {low: 3, high: 7}
    resolved = resolve(tmp_path, {layer: {setting: value} for layer, value in values.items()})
    assert getattr(resolved, setting) == 7
    # and the low layer alone beats the built-in default
    alone = resolve(tmp_path, {low: {setting: 3}})
    assert getattr(alone, setting) == 3
    assert getattr(BUILT_IN, setting) != 3


def test_the_conflict_users_hit_archive_over_models_over_default_workers(tmp_path: Path) -> None:
    # TorchServe's order: the archive's model-config beats models={...}, which beats
    # default_workers_per_model (which no longer overrides every model's minWorkers).
    given = {
        "default": {"min_workers": 4},
        "models": {"min_workers": 3, "batch_size": 16, "max_batch_delay_ms": 50},
        "archive": {"batch_size": 8},
    }
    resolved = resolve(tmp_path, given)
    assert (resolved.min_workers, resolved.batch_size, resolved.max_batch_delay_ms) == (3, 8, 50.0)
    only_default = resolve(tmp_path, {"default": {"min_workers": 4}, "archive": {"batch_size": 8}})
    assert (only_default.min_workers, only_default.max_workers) == (4, 4)


def test_workers_default_to_gpus_else_cores_and_zero_means_unset(tmp_path: Path) -> None:
    cfg = load_config([], env={}, cwd=tmp_path)
    for gpus, cores, expected in ((0, 6, 6), (2, 6, 2), (0, 1, 1)):
        layers = server_layers(cfg, gpus=gpus, cores=cores).for_model("toy", "1.0", "toy.mar")
        assert resolve_model_settings(*layers).min_workers == expected
    props = tmp_path / "config.properties"
    props.write_text("default_workers_per_model=0\n")  # TorchServe: 0 is "not set"
    cfg = load_config(["--ts-config", str(props)], env={}, cwd=tmp_path)
    layers = server_layers(cfg, gpus=0, cores=5).for_model("toy", "1.0", "toy.mar")
    assert resolve_model_settings(*layers).min_workers == 5


def test_a_registered_model_starts_no_worker_unless_something_says_some(tmp_path: Path) -> None:
    # TorchServe's register without initial_workers: default_workers_per_model, else no worker.
    assert resolve(tmp_path, {}, startup=False).min_workers == 0
    assert resolve(tmp_path, {"default": {"min_workers": 3}}, startup=False).min_workers == 3
    assert resolve(tmp_path, {"call": {"min_workers": 2}}, startup=False).min_workers == 2


def test_bad_default_values_name_the_key(tmp_path: Path) -> None:
    props = tmp_path / "config.properties"
    props.write_text("default_response_timeout=soon\n")
    with pytest.raises(ValueError, match=r"^default_response_timeout must be float, got 'soon'$"):
        load_config(["--ts-config", str(props)], env={}, cwd=tmp_path)
    props.write_text("default_response_timeout=-1\n")
    cfg = load_config(["--ts-config", str(props)], env={}, cwd=tmp_path)
    with pytest.raises(
        ServingError, match=r"^responseTimeout must be a number > 0, got -1.0 \(from default_resp"
    ):
        server_layers(cfg)


# -- TS_* variables and $$VAR$$ ---------------------------------------------------------------
ENVVARS_ON = "enable_envvars_config=true\n"


def _ts(tmp_path: Path, text: str, env: dict[str, str], *argv: str) -> Any:
    props = tmp_path / "config.properties"
    props.write_text(text)
    return load_config(["--ts-config", str(props), *argv], env=env, cwd=tmp_path)


def test_ts_variables_set_their_keys_when_the_file_enables_them(tmp_path: Path) -> None:
    env = {
        "TS_INFERENCE_ADDRESS": "http://127.0.0.1:9080",
        "TS_DEFAULT_WORKERS_PER_MODEL": "3",
        "TS_JOB_QUEUE_SIZE": "7",
        "TS_MODEL_STORE": str(tmp_path),
        "TS_LOAD_MODELS": "a=a.mar,b.mar",
        "TS_DEFAULT_RESPONSE_TIMEOUT": "30",
        "TS_ENABLE_MODEL_API": "true",
        "TS_GRPC_INFERENCE_PORT": "9070",
    }
    cfg = _ts(tmp_path, ENVVARS_ON + "inference_address=http://127.0.0.1:1\njob_queue_size=5\n", env)
    assert cfg.inference_address == "127.0.0.1:9080"  # over the file's key
    assert cfg.grpc_inference_address == "127.0.0.1:9070"
    assert (cfg.default_workers_per_model, cfg.job_queue_size, cfg.default_response_timeout) == (3, 7, 30.0)
    assert cfg.model_store == tmp_path
    assert cfg.enable_model_management is True
    assert [(s.name, s.archive) for s in model_specs(cfg)] == [("a", "a.mar"), (None, "b.mar")]


def test_ts_variables_are_ignored_unless_the_file_enables_them(tmp_path: Path) -> None:
    env = {"TS_JOB_QUEUE_SIZE": "7", "TS_ENABLE_ENVVARS_CONFIG": "true"}  # the switch is the file's only
    assert _ts(tmp_path, "job_queue_size=5\n", env).job_queue_size == 5
    assert load_config([], env=env, cwd=tmp_path / "elsewhere").job_queue_size is None


def test_ts_variables_beat_the_torchserve_command_line_as_in_torchserve(tmp_path: Path) -> None:
    store = tmp_path / "from_env"
    env = {"TS_MODEL_STORE": str(store), "TS_LOAD_MODELS": "env.mar"}
    cfg = _ts(tmp_path, ENVVARS_ON, env, "--model-store", str(tmp_path / "flag"), "--models", "flag.mar")
    assert cfg.model_store == store
    assert cfg.models == "env.mar"
    # without the switch, the command line beats the file as usual
    cfg = _ts(tmp_path, f"model_store={store}\n", env, "--model-store", str(tmp_path / "flag"))
    assert cfg.model_store == tmp_path / "flag"


def test_only_the_variables_torchserve_defines_count() -> None:
    props = {"enable_envvars_config": "true"}
    env = {
        "TS_MODELS": '{"x": {}}',  # `models` has no TS_ constant in TorchServe
        "TS_DEBUG": "true",
        "TS_OPEN_INFERENCE_PROTOCOL": "grpc",
        "TS_TOKEN_EXPIRATION_TIME_MIN": "5",
        "TS_ALLOWED_URLS": "https://x",
        "TS_NUMBER_OF_GPU": "1",
    }
    assert ts_env_props(props, env) == {
        "debug": "true",
        "ts_open_inference_protocol": "grpc",
        "token_expiration_min": "5",
        "number_of_gpu": "1",
    }
    # TS_ALLOWED_URLS only with use_env_allowed_urls=true, as TorchServe guards it
    assert ts_env_props({**props, "use_env_allowed_urls": "true"}, env)["allowed_urls"] == "https://x"
    assert TS_ENV_KEYS["TS_DEFAULT_WORKERS_PER_MODEL"] == "default_workers_per_model"
    assert TS_ENV_KEYS["TS_HEADER_KEY_SEQUENCE_ID"] == "ts_header_key_sequence_id"


def test_dollar_dollar_values_come_from_the_environment(tmp_path: Path) -> None:
    cfg = _ts(
        tmp_path, "model_store=$$STORE$$/models\njob_queue_size=$$QUEUE$$\n", {"STORE": "/srv", "QUEUE": "9"}
    )
    assert (cfg.model_store, cfg.job_queue_size) == (Path("/srv/models"), 9)
    assert substitute_env({"k": "$$Q$$"}, {"Q": "x"}) == {"k": "$$Q$$"}  # TorchServe's pattern: 2+ chars
    with pytest.raises(
        ValueError, match=r"model_store: environment variable NOPE \(from \$\$NOPE\$\$\) is not set"
    ):
        substitute_env({"model_store": "$$NOPE$$"}, {})


# -- which config file -----------------------------------------------------------------------
def test_ts_config_file_variable_beats_the_flag_and_cwd_config_properties_is_the_fallback(
    tmp_path: Path,
) -> None:
    flag_file, env_file, cwd_file = (
        tmp_path / n for n in ("flag.properties", "env.properties", "config.properties")
    )
    flag_file.write_text("job_queue_size=1\n")
    env_file.write_text("job_queue_size=2\n")
    cwd_file.write_text("job_queue_size=3\n")
    env = {"TS_CONFIG_FILE": str(env_file)}
    assert load_config(["--ts-config", str(flag_file)], env=env, cwd=tmp_path).job_queue_size == 2
    assert load_config(["--ts-config", str(flag_file)], env={}, cwd=tmp_path).job_queue_size == 1
    assert load_config([], env=env, cwd=tmp_path).job_queue_size == 2
    assert load_config([], env={}, cwd=tmp_path).job_queue_size == 3  # ./config.properties
    ours = tmp_path / "mariner.yaml"
    ours.write_text("slo_ms: 40\n")
    # our own config file given: ./config.properties is not read behind the user's back
    assert load_config(["--config-file", str(ours)], env={}, cwd=tmp_path).job_queue_size is None
    with pytest.raises(ValueError, match="TS_CONFIG_FILE .*missing.properties: no such file"):
        load_config([], env={"TS_CONFIG_FILE": str(tmp_path / "missing.properties")}, cwd=tmp_path)


def test_our_config_file_is_read_over_the_torchserve_one(tmp_path: Path) -> None:
    props = tmp_path / "ts.properties"
    props.write_text("job_queue_size=5\ndefault_workers_per_model=2\ninference_address=http://127.0.0.1:9\n")
    ours = tmp_path / "mariner.yaml"
    ours.write_text("job_queue_size: 6\ndefault_workers_per_model: null\n")  # null: not set here
    cfg = load_config(["--ts-config", str(props), "--config-file", str(ours)], env={}, cwd=tmp_path)
    assert (cfg.job_queue_size, cfg.default_workers_per_model, cfg.inference_address) == (6, 2, "127.0.0.1:9")
    other = tmp_path / "other.properties"
    other.write_text("")
    with pytest.raises(ValueError, match="two TorchServe config files"):
        load_config(["--ts-config", str(props), "--config-file", str(other)], env={}, cwd=tmp_path)


# -- the torchserve command line ----------------------------------------------------------------
def test_torchserves_flags_are_accepted(tmp_path: Path) -> None:
    argv = [
        "--start",
        "--foreground",
        "--ncs",
        "--no-config-snapshots",
        "--disable-token-auth",
        "--dt",
        "--enable-model-api",
        "--model-store",
        str(tmp_path),
        "--models",
        "x=a.mar",
        "b.mar",
    ]
    cfg = load_config(argv, env={}, cwd=tmp_path)
    assert cfg.enable_model_management is True
    assert [(s.name, s.archive) for s in model_specs(cfg)] == [("x", "a.mar"), (None, "b.mar")]
    (tmp_path / "c.mar").write_bytes(b"")
    cfg = load_config(["--model-store", str(tmp_path), "--models", "all"], env={}, cwd=tmp_path)
    assert [s.archive for s in model_specs(cfg)] == ["c.mar"]
    assert load_config(["--models", "a.mar,b.mar"], env={}, cwd=tmp_path).models == "a.mar,b.mar"


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--stop"], "stop it with SIGTERM"),
        (["--log-config", "log4j2.xml"], "Mariner does not use log4j"),
        (["--plugins-path", "p"], "Mariner loads no Java plugins"),
        (["-v"], "Mariner's version"),
    ],
)
def test_torchserve_flags_mariner_cannot_honour_are_refused_with_the_reason(
    tmp_path: Path, argv: list[str], why: str
) -> None:
    with pytest.raises(ValueError, match=f"is not supported by mariner serve: .*{why}"):
        load_config(argv, env={}, cwd=tmp_path)


def test_the_workflow_store_comes_from_the_flag_or_config_properties_else_is_the_model_store(
    tmp_path: Path,
) -> None:
    assert load_config(["--workflow-store", "wf"], env={}, cwd=tmp_path).workflow_store == Path("wf")
    props = tmp_path / "config.properties"
    props.write_text("workflow_store=../resources/workflow\nmodel_store=models\n")
    cfg = load_config(["--ts-config", str(props)], env={}, cwd=tmp_path)
    assert cfg.workflow_store == Path("../resources/workflow")
    # torchserve's --workflow-store beats the file, as in TorchServe
    cfg = load_config(["--ts-config", str(props), "--workflow-store", "cli"], env={}, cwd=tmp_path)
    assert cfg.workflow_store == Path("cli")
    props.unlink()
    assert load_config([], env={}, cwd=tmp_path).workflow_store is None  # the supervisor uses the model store


def test_an_address_with_port_0_keeps_it(tmp_path: Path) -> None:
    """`http://127.0.0.1:0` is an ephemeral port, as TorchServe's bind reads it, not the default
    port (a test harness binding port 0 must never take 8080-8082 from another server)."""
    cfg = _ts(tmp_path, "inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n", {})
    assert (cfg.inference_address, cfg.management_address) == ("127.0.0.1:0", "127.0.0.1:0")
    assert _ts(tmp_path, "metrics_address=http://127.0.0.1\n", {}).metrics_address == "127.0.0.1:8082"
