"""The bounded YAML loader for archives' YAML (model-configs, workflow specifications): plain
documents load; aliases, deep nesting, size and bad text are refused before a value is built."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from mariner.server.common.archive import open_archive
from mariner.server.common.safe_yaml import MAX_DEPTH, YamlRefused, load_yaml
from mariner.server.contracts.errors import ServingError

pytestmark = pytest.mark.unit


def test_the_yaml_loader_reads_plain_documents() -> None:
    assert load_yaml(b"a: [1, 2]\nb: {c: x}\n", max_bytes=100) == {"a": [1, 2], "b": {"c": "x"}}
    assert load_yaml(b"", max_bytes=10) is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"a: &x [1]\nb: *x\n", "alias"),
        (b"a: &x {k: 1}\nb:\n  <<: *x\n", "alias"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested deeper"),
        (b"a: 1\n" * 100, "more than the limit"),
        (b"\xff\xfe", "not UTF-8"),
        (b"a: [1\n", "not valid YAML"),
    ],
)
def test_the_yaml_loader_refuses_aliases_depth_size_and_bad_text(text: bytes, why: str) -> None:
    with pytest.raises(YamlRefused, match=why):
        load_yaml(text, max_bytes=256)


def test_a_model_config_with_an_alias_is_refused_too(tmp_path: Path) -> None:
    mar = tmp_path / "toy.mar"
    manifest = {"model": {"modelName": "toy", "handler": "h.py", "configFile": "model-config.yaml"}}
    with zipfile.ZipFile(mar, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
        zf.writestr("h.py", "def handle(data, context):\n    return data\n")
        zf.writestr("model-config.yaml", "a: &x [1, 2]\nb: [*x, *x]\n")
    with pytest.raises(ServingError, match="alias"):
        open_archive(mar, tmp_path / "work")
