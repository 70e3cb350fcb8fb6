"""Model names and management parameters: TorchServe's archiver rule, no control characters,
checked before anything is unpacked (contracts/names.py, common/archive.py)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from mariner.server.common.archive import open_archive, resolve_in_store
from mariner.server.contracts.errors import Code, ServingError, torchserve_answer
from mariner.server.contracts.names import (
    MAX_MODEL_NAME_CHARS,
    MODEL_NAME_RULE,
    check_model_name,
    check_param,
)

pytestmark = pytest.mark.unit

BAD_NAMES = [
    "../../etc/x",
    "a/b",
    "a\nINJECTED",
    "a\x00b",
    "x" * 5000,
    "",
    "-lead",
    ".hidden",
    "a b",
    "a\\b",
    "caf\u00e9",
    "a\u2028b",
]


def test_the_rule_is_torch_model_archivers() -> None:
    import model_archiver.model_packaging_utils as archiver

    source = Path(archiver.__file__).read_text()
    assert f'r"{MODEL_NAME_RULE}"' in source, "the archiver's regular expression changed"


@pytest.mark.parametrize("name", ["digits", "a", "R2-d2_v1.0", "x" * MAX_MODEL_NAME_CHARS, "9lives"])
def test_good_names_pass(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_refused_with_the_rule_and_escaped(name: str) -> None:
    with pytest.raises(ServingError) as info:
        check_model_name(name)
    err = info.value
    assert err.code is Code.INVALID_ARGUMENT
    answer = torchserve_answer(err)
    assert (answer.status, answer.type) == (400, "BadRequestException")
    assert err.message.startswith("parameter model_name ")
    assert MODEL_NAME_RULE in err.message
    assert "at most 128 characters" in err.message
    assert not any(ch in err.message for ch in "\x00\n\u2028"), "the name is quoted escaped"
    assert len(err.message) < 400, "a long name is cut in the message"


@pytest.mark.parametrize(("value", "says"), [("a\x00b", "U+0000"), ("x\x7f", "U+007F"), ("\tx", "U+0009")])
def test_control_characters_in_a_parameter_are_refused(value: str, says: str) -> None:
    with pytest.raises(ServingError) as info:
        check_param("url", value)
    assert info.value.code is Code.INVALID_ARGUMENT
    assert info.value.message.startswith("parameter url ")
    assert says in info.value.message
    assert "printable characters only" in info.value.message
    check_param("batch_size", 8)  # a JSON number is the parameter's own check's
    check_param("url", "digits.mar")


def test_a_url_with_a_nul_or_too_long_is_a_400_not_a_traceback(tmp_path: Path) -> None:
    for url in ("good\x00.mar", "x" * 5000, ("a" * 300) + ".mar"):
        with pytest.raises(ServingError) as info:
            resolve_in_store(tmp_path, url)
        assert info.value.code in (Code.INVALID_ARGUMENT, Code.NOT_FOUND), url[:20]
    with pytest.raises(ServingError) as info:
        resolve_in_store(tmp_path, ("a" * 300) + ".mar")  # one component over NAME_MAX
    assert info.value.code is Code.INVALID_ARGUMENT
    assert "cannot be a file in the model store" in info.value.message


def _mar(path: Path, model: dict) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": model}))
        zf.writestr("h.py", "def handle(data, context):\n    return data\n")
    return path


def test_every_source_of_a_name_is_checked(tmp_path: Path) -> None:
    work = tmp_path / "work"
    good = _mar(tmp_path / "good.mar", {"modelName": "good", "handler": "h.py"})
    with pytest.raises(ServingError, match="good.mar: model name 'a/b' contains special"):
        open_archive(good, work, name_override="a/b")  # register's model_name, a models= entry
    assert not work.exists() or list(work.iterdir()) == [], "refused before unpacking"
    bad_manifest = _mar(tmp_path / "m.mar", {"modelName": "a\nb", "handler": "h.py"})
    with pytest.raises(ServingError, match="manifest field model.modelName 'a\\\\nb' is not allowed"):
        open_archive(bad_manifest, work)
    unnamed = _mar(tmp_path / "my model.mar", {"handler": "h.py"})
    with pytest.raises(ServingError, match="the model name from its file name 'my model'"):
        open_archive(unnamed, work)
    assert open_archive(good, work, name_override="other").name == "other"
    assert list(p.name for p in work.iterdir() if p.name.startswith("my model")) == []
