"""TorchServe's metric families as TorchServe exposes them, from what prometheus_client collected.

prometheus_client writes every counter sample as `<name>_total` (and its text encoder the
HELP/TYPE lines too) and, in multiprocess mode, merges only what some process wrote. TorchServe
serves `Requests2XX` as `# TYPE Requests2XX counter` / `Requests2XX{...,} 13.0` (its Java client
ends every label set with a comma) and lists every declared metric before its first sample.
`expose` renames the internal `<name>:ts` counters back, adds the declared families, keeps the
TorchServe families its metrics_mode serves on /metrics (all in `prometheus`, three in `legacy`,
none in `log`; Mariner's `mariner_*` families always), applies TorchServe's `name[]=` filter;
`text_exposition` writes the Prometheus text format with those counters under their own names
and TorchServe's label sets as TorchServe writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mariner.server.compat.torchserve.metrics import (
    COUNTER_SUFFIX,
    TsMetricsSpec,
    metrics_mode,
    on_prometheus,
)

OURS = "mariner_"  # Mariner's own families: served in every metrics mode


def served(name: str, mode: str) -> bool:
    """Whether a family is on /metrics in TorchServe's metrics `mode`: every `mariner_*` one;
    TorchServe's (any other name: frontend, host and handler metrics) as the mode says."""
    return name.startswith(OURS) or on_prometheus(name, mode)


def expose(
    families: Iterable[Any],
    spec: TsMetricsSpec,
    *,
    openmetrics: bool,
    names: Sequence[str] = (),
    mode: str | None = None,
) -> list[Any]:
    """Collected families as TorchServe names them, plus its declared families not yet written,
    filtered to `names` (TorchServe's `name[]=`; a `mariner_*` counter matches with or without
    `_total`) when any are given.

    In OpenMetrics a counter's sample must end in `_total`, so a TorchServe counter whose name does
    not (`Requests2XX`) is typed `unknown` there: the series keeps its exact name, which is what
    dashboards query; in the text format it stays a `counter`, as TorchServe serves it.
    """
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample

    out: list[Any] = []
    seen: dict[str, Any] = {}
    for family in families:
        if family.type == "counter" and family.name.endswith(COUNTER_SUFFIX):
            name = family.name[: -len(COUNTER_SUFFIX)]
            fixed = _ts_counter(name, family.documentation, openmetrics)
            fixed.samples = [
                Sample(name, s.labels, s.value, s.timestamp, s.exemplar)
                for s in family.samples
                if s.name.endswith("_total")
            ]
            family = fixed
        first = seen.get(family.name)
        if first is not None:  # declared in two registries (ours and the handlers'): one family
            first.samples.extend(family.samples)
            continue
        seen[family.name] = family
        out.append(family)
    for m in (*spec.frontend, *spec.model):
        if m.name not in seen and not (openmetrics and m.name.endswith("_total") and m.name[:-6] in seen):
            out.append(
                _ts_counter(m.name, m.help, openmetrics)
                if m.kind == "counter"
                else Metric(m.name, m.help, m.kind)
            )
    mode = mode or metrics_mode()
    out = [f for f in out if served(f.name, mode)]
    orders = _label_orders(spec)
    for family in out:
        if not family.name.startswith(OURS) and family.samples:
            order = orders.get(family.name)
            family.samples = [s._replace(labels=_ordered(s.labels, order)) for s in family.samples]
    if names:
        wanted = set(names)
        out = [
            f for f in out if f.name in wanted or f"{f.name}_total" in wanted or _exposed_name(f) in wanted
        ]
    return out


# Where TorchServe puts the dimensions it adds to a handler's metric: after the handler's own.
_ADDED_LAST = ("ModelName", "Level", "Hostname")


def _label_orders(spec: TsMetricsSpec) -> dict[str, tuple[str, ...]]:
    """The label order TorchServe writes each declared metric with: its dimensions as metrics.yaml
    lists them (a model metric's with Hostname last, as TorchServe adds it)."""
    orders = {m.name: m.dimensions for m in spec.frontend}
    orders.update({m.name: (*m.dimensions, "Hostname") for m in spec.model})
    return orders


def _ordered(labels: dict[str, str], order: Sequence[str] | None) -> dict[str, str]:
    """`labels` in TorchServe's order. prometheus_client's multiprocess files keep label sets
    sorted by name, and TorchServe's users match its order (`{Level="Host",Hostname="h",}`):
    a declared metric's labels follow metrics.yaml; another (a handler's auto-detected metric)
    has its own dimensions first, then ModelName, Level and Hostname, as TorchServe adds them."""
    if order is None:
        order = (*(k for k in labels if k not in _ADDED_LAST), *_ADDED_LAST)
    out = {k: labels[k] for k in order if k in labels}
    out.update({k: v for k, v in labels.items() if k not in out})
    return out


def _ts_counter(name: str, documentation: str, openmetrics: bool) -> Any:
    from prometheus_client.metrics_core import Metric

    if not openmetrics:
        # prometheus_client's text encoder writes a counter's HELP/TYPE as `<name>_total`;
        # `text_exposition` writes these under their own name (see there).
        family = Metric(name, documentation, "unknown")
        family.ts_counter = True  # type: ignore[attr-defined]  # our mark on prometheus_client's Metric
        return family
    if name.endswith("_total"):
        return Metric(name[: -len("_total")], documentation, "counter")
    return Metric(name, documentation, "unknown")


def _exposed_name(family: Any) -> str:
    return family.samples[0].name if family.samples else family.name


def text_exposition(families: Sequence[Any]) -> bytes:
    """The Prometheus text format (0.0.4): Mariner's families as prometheus_client writes them,
    TorchServe's as TorchServe's Java client does: counters typed `counter` under their exact
    names (`# TYPE Requests2XX counter` then `Requests2XX{...} 13.0`, which prometheus_client's
    encoder never writes), labels in TorchServe's order (prometheus_client sorts them), each label
    set ending with a comma (`{Level="Host",Hostname="h",}`)."""
    from prometheus_client.exposition import generate_latest

    out: list[bytes] = []
    plain: list[Any] = []
    for family in families:
        if family.name.startswith(OURS):
            plain.append(family)
            continue
        if plain:
            out.append(generate_latest(Families(plain)))
            plain = []
        out.append(_torchserve_text(family))
    if plain:
        out.append(generate_latest(Families(plain)))
    return b"".join(out)


_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}


def _torchserve_text(family: Any) -> bytes:
    from prometheus_client.utils import floatToGoString

    kind = "counter" if getattr(family, "ts_counter", False) else _TYPES.get(family.type, family.type)
    doc = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    lines = [f"# HELP {family.name} {doc}", f"# TYPE {family.name} {kind}"]
    for sample in family.samples:
        if sample.name.endswith("_created"):  # prometheus_client's; TorchServe's text has none
            continue
        labels = "".join(f'{k}="{_escape(v)}",' for k, v in sample.labels.items())
        head = f"{sample.name}{{{labels}}}" if labels else sample.name
        lines.append(f"{head} {floatToGoString(sample.value)}")
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Families:
    """A registry-shaped holder of already-collected families, for prometheus_client's encoders."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families
