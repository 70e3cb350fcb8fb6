"""YAML from an archive, read so that a small document stays small.

PyYAML's `safe_load` builds only plain values, but it expands anchors and aliases: a 1 KB
document of nested aliases ("billion laughs") becomes gigabytes once something walks it, and a
deeply nested one exhausts the recursion limit. An archive's YAML (a model-config, a workflow's
specification) is written by someone else, so it is read here instead:

* at most `max_bytes` of UTF-8 text;
* no aliases at all (`*name`, and so no `<<: *name` merge keys): an anchor alone is harmless,
  a reference to it is refused;
* at most `MAX_DEPTH` levels of nesting and `MAX_NODES` nodes, counted while the document is
  composed, before any Python value is built.

A refusal is a `YamlRefused` (a ValueError) whose message says what was wrong, where, and what
is allowed, worded to follow the file's name ("spec.yaml is not valid YAML (...)"); callers name
the archive and the file in front of it.
"""

from __future__ import annotations

from typing import Any

import yaml

from mariner.server.contracts.capped_text import TextRefused, capped_text

__all__ = ["MAX_DEPTH", "MAX_NODES", "YamlRefused", "load_yaml"]

MAX_DEPTH = 64
MAX_NODES = 100_000


class YamlRefused(ValueError):
    """The text is not a YAML document this server reads (see the module docstring)."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and counts depth and nodes while composing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise YamlRefused(
                f"holds an alias (*name) at line {mark.line + 1} column {mark.column + 1}: aliases and merge "
                "keys (<<: *name) are not allowed; write the value out"
            )
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_DEPTH:
            raise YamlRefused(f"is nested deeper than {MAX_DEPTH} levels")
        if self._nodes > MAX_NODES:
            raise YamlRefused(f"holds more than {MAX_NODES} values")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(data: bytes, *, max_bytes: int) -> Any:
    """The one YAML document in `data` as plain values (None when it is empty).

    Raises YamlRefused for text over `max_bytes`, text that is not UTF-8, an alias, nesting or
    size past the caps, and YAML that does not parse (with its line and column)."""
    try:
        text = capped_text(data, max_bytes)
    except TextRefused as exc:
        raise YamlRefused(str(exc)) from None
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise YamlRefused(f"is not valid YAML ({problem}{where})") from None
    finally:
        loader.dispose()
