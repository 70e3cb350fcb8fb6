"""TorchServe's log line formats, as its log4j2.xml and its Java frontend write them.

- `ts_log.log`, `model_log.log` and the console: `%d{ISO8601} [%-5p] %t %c - %m%n`
  (`2024-05-01T12:00:00,123 [INFO ] W-9000-mnist_1.0-stdout MODEL_LOG - hello`);
- `access_log.log`, `ts_metrics.log`, `model_metrics.log`: `%d{ISO8601} - %m%n`;
- an access line (its `Session`): `/127.0.0.1:51234 "POST /predictions/mnist HTTP/1.1" 200 12`
  (remote address, request line, status, milliseconds);
- a metric line (its `LogMetric`): `Requests2XX.Count:1.0|#Level:Host|#hostname:h,timestamp:1714`,
  a model metric with `,requestID:<ids>` before the timestamp; values as Java prints a double.

The timestamp is local time with milliseconds after a comma, as log4j's ISO8601 pattern writes it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

# log4j's level names (Python's WARNING is log4j's WARN, CRITICAL its FATAL).
LEVEL_NAMES = {
    logging.DEBUG: "DEBUG",
    logging.INFO: "INFO",
    logging.WARNING: "WARN",
    logging.ERROR: "ERROR",
    logging.CRITICAL: "FATAL",
}
MAX_TEXT = 4096  # a client-sent string (a URL) is cut here in a log line


def level_name(levelno: int) -> str:
    """The log4j name of a Python logging level (an odd level takes the next lower name)."""
    for number in sorted(LEVEL_NAMES, reverse=True):
        if levelno >= number:
            return LEVEL_NAMES[number]
    return "TRACE"


class Clock:
    """log4j's `%d{ISO8601}` (`2024-05-01T12:00:00,123`, local time), the second's text cached:
    one writer formats thousands of lines a second. Not thread-safe: one per writer."""

    def __init__(self) -> None:
        self._second = -1
        self._text = ""

    def stamp(self, t: float) -> str:
        second, millis = divmod(round(t * 1000), 1000)
        if second != self._second:
            self._second = second
            self._text = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(second))
        return f"{self._text},{millis:03d}"


def pattern_line(stamp: str, level: str, thread: str, logger: str, message: str) -> str:
    """`%d{ISO8601} [%-5p] %t %c - %m%n`: ts_log.log, model_log.log and the console."""
    return f"{stamp} [{level:<5}] {thread} {logger} - {message}\n"


def plain_line(stamp: str, message: str) -> str:
    """`%d{ISO8601} - %m%n`: access_log.log, ts_metrics.log and model_metrics.log."""
    return f"{stamp} - {message}\n"


_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def safe_text(text: str, limit: int = MAX_TEXT) -> str:
    """A client-sent string fit for one log line: control characters (a newline would forge a
    line, an escape sequence would drive a terminal) as `\\xNN`, cut at `limit` characters."""
    if len(text) > limit:
        text = text[:limit] + "..."
    elif text.isascii() and text.isprintable():  # nearly every URL: nothing to escape
        return text
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def access_message(remote: str, method: str, uri: str, protocol: str, code: int, millis: int) -> str:
    """TorchServe's access line (`Session.toString`): `/ip:port "METHOD uri PROTOCOL" code ms`."""
    return f'{remote} "{method} {safe_text(uri)} {protocol}" {code} {millis}'


def remote_address(client: tuple[str, int] | Sequence[object] | None) -> str:
    """The peer as Java's `InetSocketAddress.toString()` writes it: `/127.0.0.1:51234`; a peer
    without an address (a Unix socket) is TorchServe's `127.0.0.1`."""
    if not client:
        return "127.0.0.1"
    return f"/{client[0]}:{client[1]}"


def java_double(value: float) -> str:
    """A double as Java's `Double.toString` writes it: `1.0`, `12.5`, `1.0E7`, `1.0E-4`."""
    if 1e-3 <= value < 1e7 or -1e7 < value <= -1e-3:  # the usual: repr is decimal here
        return repr(float(value))
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0.0" if str(value).startswith("-") else "0.0"
    magnitude = abs(value)
    if 1e-3 <= magnitude < 1e7:
        text = repr(float(value))
        if "e" in text:  # repr's shortest form is decimal here, but be safe
            text = format(Decimal(text), "f")
        return text if "." in text else text + ".0"
    sign, digits, exponent = Decimal(repr(float(value))).as_tuple()
    shown = "".join(map(str, digits)).rstrip("0") or "0"
    power = len(digits) - 1 + int(exponent)
    return f"{'-' if sign else ''}{shown[0]}.{shown[1:] or '0'}E{power}"


def metric_parts(
    name: str,
    unit: str,
    dimensions: Sequence[str],
    known: Mapping[str, str],
    *,
    request_id: str | None = None,
    with_request_id: bool = False,
) -> tuple[str, str]:
    """A `LogMetric` line around its value and its time: (`name.unit:`, `|#dims|#hostname:h,
    [requestID:ids,]timestamp:`). The declared dimensions but the last (taken to be the host
    name) with their values, then the last one's value as the host name; a model metric carries
    its request ids (`null` when unknown, as Java appends a null). Dimension values come from
    `known` by name (a custom metrics.yaml may reorder them), as `label_values` gives them to
    Prometheus. The parts depend only on the metric and its labels, so a frontend caches them."""
    values = [known.get(d, "") for d in dimensions]
    count = max(0, len(dimensions) - 1)
    pairs = ",".join(f"{d}:{v}" for d, v in zip(dimensions[:count], values[:count], strict=True))
    host = values[-1] if values else known.get("Hostname", "")
    tail = f",requestID:{'null' if request_id is None else request_id}" if with_request_id else ""
    return f"{name}.{unit}:", f"|#{pairs}|#hostname:{host}{tail},timestamp:"


def metric_message(
    name: str,
    unit: str,
    value: float,
    dimensions: Sequence[str],
    known: Mapping[str, str],
    *,
    request_id: str | None = None,
    with_request_id: bool = False,
    now: float | None = None,
) -> str:
    """One `LogMetric` line (`metric_parts` around the value and the time in seconds)."""
    head, tail = metric_parts(
        name, unit, dimensions, known, request_id=request_id, with_request_id=with_request_id
    )
    return f"{head}{java_double(value)}{tail}{int(time.time() if now is None else now)}"


# TorchServe's backend metric line (`ts.metrics.caching_metric`, parsed by its frontend's
# `Metric.parse` with this pattern): `name.unit:value|#dims|#type:GAUGE|#hostname:h,ts,reqid`.
# The name starts at a word character: TorchServe's `\s*([\w\s]+)` backtracks quadratically over
# a long run of spaces (seconds for one 16 KiB line, on the thread that reads every worker's pipe).
METRICS_PREFIX = "[METRICS]"
_BACKEND = re.compile(
    r"\s*(\w[\w\s]*)\.([\w\s]+):([0-9\-,.e]+)\|#([^|]*)(\|#type:([^|,]+))?\|#hostname:([^,]+),([^,]+)(,(.*))?",
    re.ASCII,
)


@dataclass(frozen=True)
class BackendMetric:
    """One `[METRICS]` line of a worker, parsed as TorchServe's frontend parses it."""

    name: str
    unit: str
    value: float
    dimensions: tuple[tuple[str, str], ...]
    kind: str | None  # COUNTER, GAUGE, HISTOGRAM (TorchServe's enum names), when given
    hostname: str
    request_id: str | None


def parse_backend_metric(text: str) -> BackendMetric | None:
    """`text` after `[METRICS]`, or None when it is not a metric line TorchServe would read."""
    match = _BACKEND.fullmatch(text)
    if match is None:
        return None
    try:
        value = float(match.group(3))
    except ValueError:
        return None
    dims = []
    for pair in (match.group(4) or "").split(","):
        parts = pair.split(":")
        if len(parts) == 2:
            dims.append((parts[0], parts[1]))
    return BackendMetric(
        match.group(1), match.group(2), value, tuple(dims), match.group(6), match.group(7), match.group(10)
    )


def model_metric_message(
    metric: BackendMetric, unit: str, dimension_names: Sequence[str], now: float | None = None
) -> str:
    """A backend metric as TorchServe's frontend logs it to model_metrics.log: the declared
    dimension names (the metric's own for an auto-detected one) over the line's values in order,
    the host name, the request ids (`null` when the line had none, as Java appends it), the time."""
    values = [v for _, v in metric.dimensions] + [metric.hostname]
    names = list(dimension_names)
    count = max(0, min(len(names) - 1, len(values) - 1))
    pairs = ",".join(f"{n}:{v}" for n, v in zip(names[:count], values[:count], strict=True))
    stamp = int(time.time() if now is None else now)
    return (
        f"{metric.name}.{unit}:{java_double(metric.value)}|#{pairs}|#hostname:{values[-1]}"
        f",requestID:{'null' if metric.request_id is None else metric.request_id},timestamp:{stamp}"
    )
