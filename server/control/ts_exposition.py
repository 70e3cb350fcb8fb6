"""TorchServe's metric families as TorchServe exposes them, from what prometheus_client collected.

prometheus_client writes every counter sample as `<name>_total` (and its text encoder the
HELP/TYPE lines too) and, in multiprocess mode, merges only what some process wrote. TorchServe
serves `Requests2XX` as `# TYPE Requests2XX counter` / `Requests2XX{...} 13.0` and lists every
declared metric before its first sample. `expose` renames the internal `<name>:ts` counters back,
adds the declared families, applies TorchServe's `name[]=` filter; `text_exposition` writes the
Prometheus text format with those counters under their own names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mariner.server.control.ts_metrics import COUNTER_SUFFIX, TsMetricsSpec


def expose(
    families: Iterable[Any], spec: TsMetricsSpec, *, openmetrics: bool, names: Sequence[str] = ()
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
        if first is not None:  # declared in two registries (the single-process server): one family
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
    if names:
        wanted = set(names)
        out = [
            f for f in out if f.name in wanted or f"{f.name}_total" in wanted or _exposed_name(f) in wanted
        ]
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
    """The Prometheus text format (0.0.4), with TorchServe's counters typed `counter` under
    their exact names, as TorchServe serves them (`# TYPE Requests2XX counter` then
    `Requests2XX{...} 13.0`), which prometheus_client's encoder never writes."""
    from prometheus_client.exposition import generate_latest

    out: list[bytes] = []
    plain: list[Any] = []
    for family in families:
        if not getattr(family, "ts_counter", False):
            plain.append(family)
            continue
        if plain:
            out.append(generate_latest(Families(plain)))
            plain = []
        text = generate_latest(Families([family]))
        untyped = f"# TYPE {family.name} untyped\n".encode()
        out.append(text.replace(untyped, f"# TYPE {family.name} counter\n".encode(), 1))
    if plain:
        out.append(generate_latest(Families(plain)))
    return b"".join(out)


class Families:
    """A registry-shaped holder of already-collected families, for prometheus_client's encoders."""

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families
