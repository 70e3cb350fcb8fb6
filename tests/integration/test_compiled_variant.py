"""The compiled variant warms every batch-size bucket at load, so no request pays a compile."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from mariner.server.worker.context import Context
from mariner.training.verify import load_handler_class

pytestmark = pytest.mark.integration


def test_no_batch_size_up_to_the_max_triggers_a_compile_after_warm_up(
    model_store: Path, tmp_path: Path
) -> None:
    import json

    from torch._dynamo.utils import counters

    with zipfile.ZipFile(model_store / "digits_compiled.mar") as zf:
        zf.extractall(tmp_path)
    manifest = json.loads((tmp_path / "MAR-INF" / "MANIFEST.json").read_text())
    config = yaml.safe_load((tmp_path / "model-config.yaml").read_text())
    assert config["handler"]["format"] == "compiled"
    batch_size = int(config["batchSize"])
    ctx = Context("digits_compiled", str(tmp_path), manifest, batch_size=batch_size, gpu_id=None,
                  model_yaml_config=config)  # fmt: skip
    handler = load_handler_class()()
    handler.initialize(ctx)  # compiles and warms the buckets
    graphs_after_warm_up = counters["stats"]["unique_graphs"]
    assert graphs_after_warm_up >= 1, "initialize() should have compiled the model"
    rng = np.random.default_rng(0)
    for n in range(1, batch_size + 1):
        logits = handler.logits(handler.normalise(rng.uniform(0, 16, size=(n, 64)).astype(np.float32)))
        assert logits.shape == (n, 10)
    assert counters["stats"]["unique_graphs"] == graphs_after_warm_up, "a request size triggered a compile"
