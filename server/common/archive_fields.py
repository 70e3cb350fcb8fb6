"""The fields of an unpacked archive, checked one by one: `MAR-INF/MANIFEST.json` and the
model-config YAML it names.

An archive is written by someone else and read by the server before anything else about it is
known, so each field is checked for its type and, for every file it names, for where that file
resolves: inside the archive's own unpacked directory (symlinks followed), never beside or above
it. A failure is one ServingError(INVALID_ARGUMENT) whose message names the archive, the field,
what it holds and what is allowed, so a store with one broken archive logs one clear line.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from mariner.server.common.safe_yaml import YamlRefused, load_yaml
from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.names import model_name_problem

MANIFEST = "MAR-INF/MANIFEST.json"
# A model-config holds settings, never data: far below what a real one needs.
MAX_MODEL_CONFIG_BYTES = 4 << 20

# Manifest fields that name one file of the archive (TorchServe's manifest keys).
_FILE_FIELDS = ("serializedFile", "modelFile", "configFile", "requirementsFile")


def _refuse(archive_file: str, what: str) -> ServingError:
    return ServingError(Code.INVALID_ARGUMENT, f"archive {archive_file}: {what}")


def handler_file(handler: str) -> str:
    """The file a handler spec names, as the runtime imports it: `h.py`, `h.py:fn`, `module`,
    `module:fn` (a module name is the file `module.py` in the archive)."""
    module_part = handler.partition(":")[0]
    return module_part if module_part.endswith(".py") else f"{module_part}.py"


def inside(model_dir: Path, relative: str) -> Path | None:
    """`relative` resolved (symlinks followed) under `model_dir`, or None when it points outside."""
    if not relative or PurePosixPath(relative).is_absolute() or relative.startswith(("/", "\\")):
        return None
    root = model_dir.resolve()
    resolved = (root / relative).resolve()
    return resolved if resolved.is_relative_to(root) else None


def _string(archive_file: str, model: dict[str, Any], key: str, *, numbers: bool = False) -> str | None:
    value = model.get(key)
    if value is None or value == "":
        return None
    if numbers and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        allowed = "a string or a number" if numbers else "a string"
        raise _refuse(archive_file, f"manifest field model.{key} must be {allowed}, got {value!r}")
    return value


def _check_inside(archive_file: str, model_dir: Path, key: str, relative: str) -> None:
    if inside(model_dir, relative) is None:
        raise _refuse(
            archive_file,
            f"manifest field model.{key} {relative!r} points outside the archive; every file an "
            "archive names must be a relative path inside it (no '..', no absolute path, no symlink "
            "out)",
        )


def _extra_files(archive_file: str, model: dict[str, Any]) -> list[str]:
    value = model.get("extraFiles")
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [f.strip() for f in value.split(",") if f.strip()]
    if isinstance(value, list) and all(isinstance(f, str) for f in value):
        return [f for f in value if f]
    raise _refuse(
        archive_file,
        f"manifest field model.extraFiles must be a comma-separated string or a list of strings, "
        f"got {value!r}",
    )


def check_handler(archive_file: str, model_dir: Path, handler: str) -> None:
    """A handler spec (the manifest's, or a register call's `handler=`) names a module or a file
    that resolves inside the archive: never `../x.py` or `/elsewhere/h.py`, whose code the sha256
    pin never covered. It need not exist: a module is also looked up among installed packages
    and TorchServe's built-in handlers when the worker loads it."""
    _check_inside(archive_file, model_dir, "handler", handler_file(handler))


def read_manifest(model_dir: Path, archive_file: str) -> dict[str, Any]:
    """The checked manifest of the archive unpacked at `model_dir` (as written, not rewritten)."""
    path = model_dir / MANIFEST
    if not path.is_file():
        raise _refuse(archive_file, f"has no {MANIFEST}; a .mar must carry one (torch-model-archiver)")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _refuse(archive_file, f"{MANIFEST} is not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise _refuse(
            archive_file,
            f"{MANIFEST} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            'it must be a JSON object whose "model" object names at least a handler',
        ) from None
    if not isinstance(manifest, dict):
        raise _refuse(archive_file, f"{MANIFEST} must be a JSON object, got {type(manifest).__name__}")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise _refuse(archive_file, f'{MANIFEST} must have a "model" object, got {model!r}')
    handler = _string(archive_file, model, "handler")
    if handler is None:
        raise _refuse(
            archive_file, "manifest names no handler (model.handler: a .py file in the archive or a module)"
        )
    check_handler(archive_file, model_dir, handler)
    for key, numbers in (("modelName", False), ("modelVersion", True)):
        value = _string(archive_file, model, key, numbers=numbers)
        # TorchServe's model-archiver rule for names; a version also lands in URLs and log lines.
        if value is not None and model_name_problem(value) is not None:
            raise _refuse(
                archive_file,
                f"manifest field model.{key} {value!r} is not allowed: use letters, digits, '_', '-' "
                "and '.', starting with a letter or digit (at most 128 characters)",
            )
    for key in _FILE_FIELDS:
        relative = _string(archive_file, model, key)
        if relative is not None:
            _check_inside(archive_file, model_dir, key, relative)
    for relative in _extra_files(archive_file, model):
        _check_inside(archive_file, model_dir, "extraFiles", relative)
    return manifest


def read_model_config(model_dir: Path, archive_file: str, config_file: Any) -> dict[str, Any]:
    """The archive's model-config YAML (empty when the manifest names none), checked to be a
    mapping with string keys; the serving settings in it are checked by `model_settings`."""
    if not config_file:
        return {}
    path = inside(model_dir, str(config_file))
    if path is None or not path.is_file():
        raise _refuse(
            archive_file, f"configFile {config_file!r} missing: the manifest names a file the archive lacks"
        )
    if path.stat().st_size > MAX_MODEL_CONFIG_BYTES:
        raise _refuse(archive_file, f"model-config {config_file} is over {MAX_MODEL_CONFIG_BYTES} bytes")
    try:  # the bounded loader: no aliases, depth and size capped (an archive's YAML is hostile)
        config = load_yaml(path.read_bytes(), max_bytes=MAX_MODEL_CONFIG_BYTES)
    except YamlRefused as exc:
        raise _refuse(
            archive_file, f"model-config {config_file} {exc}; it must be a mapping such as 'batchSize: 8'"
        ) from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise _refuse(
            archive_file,
            f"model-config is not a mapping (got {type(config).__name__}); it must map TorchServe keys "
            "(batchSize, maxBatchDelay, responseTimeout, minWorkers, ...) to values",
        )
    bad_keys = [k for k in config if not isinstance(k, str)]
    if bad_keys:
        raise _refuse(archive_file, f"model-config keys must be strings, got {bad_keys[0]!r}")
    return config
