"""A test archive whose handler records its own metrics through `context.metrics`, and a reader of
the Prometheus text exposition that keeps what dashboards depend on (names, types, label names).

The handler runs unchanged on stock TorchServe and on Mariner: it uses only the `context.metrics`
calls both offer and never imports `ts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.fault_archive import write_handler_archive

NAME = "metered"

HANDLER = """
import json


class MeteredHandler:
    def initialize(self, context):
        self.batches = context.metrics.add_metric_to_cache("MeteredBatches", "count", ["ModelName", "Stage"])

    def handle(self, data, context):
        context.metrics.add_counter("MeteredItems", len(data))
        context.metrics.add_time("HandlerTime", 1.25)
        self.batches.add_or_update(1, [context.model_name, "handle"])
        return [json.dumps({"items": len(data)}) for _ in data]
"""

CONFIG = """\
minWorkers: 1
maxWorkers: 1
batchSize: 1
maxBatchDelay: 0
responseTimeout: 60
"""

# The handler's own metrics: on TorchServe they must be declared to appear (or auto-detected).
METRICS_YAML_EXTRA = """
  counter:
    - name: MeteredItems
      unit: count
      dimensions: [*model_name, *level]
    - name: MeteredBatches
      unit: count
      dimensions: [*model_name, "Stage"]
"""


def build_metered_archive(store: Path) -> Path:
    files = {"metered_handler.py": HANDLER, "model-config.yaml": CONFIG}
    return write_handler_archive(store / f"{NAME}.mar", NAME, "metered_handler.py", files)


def metrics_yaml_with_handler_metrics(default_yaml: str) -> str:
    """TorchServe's default metrics.yaml plus the handler's counters under model_metrics."""
    head, sep, tail = default_yaml.partition("model_metrics:")
    assert sep, "the default metrics.yaml has a model_metrics section"
    return head + sep + METRICS_YAML_EXTRA + tail


@dataclass
class Family:
    """One metric family as exposed: its TYPE, and the label-name sets of its samples."""

    type: str
    label_sets: set[frozenset[str]] = field(default_factory=set)
    sample_names: set[str] = field(default_factory=set)


_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def parse_exposition(text: str) -> dict[str, Family]:
    """Families by name from the Prometheus text format (TorchServe writes `{a="b",}`)."""
    families: dict[str, Family] = {}
    current: str | None = None
    for line in text.splitlines():
        typed = _TYPE.match(line)
        if typed:
            current = typed.group(1)
            families[current] = Family(typed.group(2))
            continue
        if not line or line.startswith("#"):
            continue
        sample = _SAMPLE.match(line)
        assert sample, f"not a sample line: {line!r}"
        name = sample.group(1)
        family = families.get(name) if name in families else families.get(current or "")
        assert family is not None, f"sample {name} before any TYPE line"
        family.sample_names.add(name)
        family.label_sets.add(frozenset(_LABEL.findall(sample.group(3) or "")))
    return families
