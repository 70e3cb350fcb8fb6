"""A TorchServe user's configuration, served by `mariner serve` from a torchserve-style command
line, settles every model's settings exactly as stock TorchServe 0.12 does.

One store, three copies of digits_torchscript that differ only in what their model-config says,
and one config.properties whose `models={...}` and `default_workers_per_model` conflict with it:

- digits_yaml: the archive says minWorkers/maxWorkers 1, batchSize 32, maxBatchDelay 5, and
  `models=` says 2 workers, batchSize 8, delay 20: the archive wins everything,
- digits_bare: the archive says batchSize 32 only; `models=` says 2 workers and delay 20: those
  come from `models=`, batchSize from the archive,
- digits_default: the archive says batchSize 32 only and `models=` has no entry: workers from
  `default_workers_per_model`, maxBatchDelay TorchServe's built-in 100 ms.

Both servers read the same file; Mariner is started as `mariner serve --ts-config FILE
--model-store DIR --models name=file.mar ...`, and its `default_workers_per_model` comes from a
`TS_DEFAULT_WORKERS_PER_MODEL` variable (the file enables them), overriding the file's value.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mariner.loadtest.servers import StockTorchServe
from tests.mariner_serve import MarinerServe

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODELS = ("digits_yaml", "digits_bare", "digits_default")
# What stock TorchServe's describe has to agree on with ours.
COMPARED = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout")
EXPECTED = {  # (minWorkers, maxWorkers, batchSize, maxBatchDelay, responseTimeout)
    "digits_yaml": (1, 1, 32, 5, 30),
    "digits_bare": (2, 2, 32, 20, 30),
    "digits_default": (1, 1, 32, 100, 30),
}
MODELS_KEY = {
    "digits_yaml": {"1.0": {"minWorkers": 2, "maxWorkers": 2, "batchSize": 8, "maxBatchDelay": 20}},
    "digits_bare": {"1.0": {"minWorkers": 2, "maxWorkers": 2, "maxBatchDelay": 20}},
}


def _variant(source: Path, target: Path, name: str, keep: tuple[str, ...]) -> None:
    """`source` as model `name`, its model-config reduced to the top-level keys in `keep`
    (the handler's own section always stays)."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "MAR-INF/MANIFEST.json":
                manifest = json.loads(data)
                manifest["model"]["modelName"] = name
                data = json.dumps(manifest).encode()
            elif item.filename == "model-config.yaml":
                lines = data.decode().splitlines(keepends=True)
                top = [line.split(":")[0] for line in lines]
                data = "".join(
                    line
                    for line, key in zip(lines, top, strict=True)
                    if line[:1].isspace()
                    or key not in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay")
                    or key in keep
                ).encode()
            dst.writestr(item, data)


@pytest.fixture(scope="module")
def store(model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ts-config-store")
    source = model_store / "digits_torchscript.mar"
    _variant(
        source,
        root / "digits_yaml.mar",
        "digits_yaml",
        ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay"),
    )
    _variant(source, root / "digits_bare.mar", "digits_bare", ("batchSize",))
    _variant(source, root / "digits_default.mar", "digits_default", ("batchSize",))
    return root


def _properties(default_workers: int, envvars: bool) -> dict[str, str]:
    props = {"models": json.dumps(MODELS_KEY), "default_workers_per_model": str(default_workers)}
    if envvars:
        props["enable_envvars_config"] = "true"
    return props


@pytest.fixture(scope="module")
def stock(store: Path) -> dict[str, list[dict[str, Any]]]:
    """Stock TorchServe's describe of each model; it is stopped before Mariner starts."""
    if shutil.which("java") is None:
        pytest.fail("stock TorchServe needs Java 17 on PATH: run `make java`")
    with StockTorchServe(store, list(MODELS), extra_config=_properties(1, envvars=False)) as ts:
        return {name: ts.describe(name) for name in MODELS}


@pytest.fixture(scope="module")
def ours(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MarinerServe]:
    props = tmp_path_factory.mktemp("ts-config") / "config.properties"
    # The file says 3 workers by default; TS_DEFAULT_WORKERS_PER_MODEL says 1, and wins.
    props.write_text("".join(f"{k}={v}\n" for k, v in _properties(3, envvars=True).items()))
    argv = (
        "--ts-config",
        str(props),
        "--model-store",
        str(store),
        "--models",
        *(f"{m}={m}.mar" for m in MODELS),
    )
    # default_workers_per_model / job_queue_size None: the harness pins neither, the file, the
    # TS_* variable and TorchServe's defaults decide.
    srv = MarinerServe(
        store,
        "none.mar",
        args=argv,
        env={"TS_DEFAULT_WORKERS_PER_MODEL": "1"},
        default_workers_per_model=None,
        job_queue_size=None,
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("model", MODELS)
def test_mariner_settles_each_models_settings_as_stock_torchserve(
    stock: dict[str, list[dict[str, Any]]], ours: MarinerServe, model: str
) -> None:
    (theirs,) = stock[model]
    (mine,) = ours.describe(model)
    assert tuple(theirs[k] for k in COMPARED) == EXPECTED[model], "the oracle's own answer moved"
    assert {k: mine[k] for k in COMPARED} == {k: theirs[k] for k in COMPARED}
    assert len(mine["workers"]) == len(theirs["workers"]) == EXPECTED[model][0]
    # TorchServe's default job_queue_size (100), on both
    assert mine["jobQueueStatus"]["remainingCapacity"] == theirs["jobQueueStatus"]["remainingCapacity"] == 100
