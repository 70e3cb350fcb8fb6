"""Importing an archive's handler the way TorchServe's model loader (`ts/model_loader.py`) does,
apart from the runner that calls it.

The manifest's `handler` is resolved exactly as there:

1. `name`, `name.py` or `path/name.py`, optionally `:function`: the module `name` is imported
   with the model dir first on sys.path (a file shipped in the archive, or an installed module);
2. if that import fails, `ts.torch_handler.<handler>`: TorchServe's built-in handlers by name
   (`base_handler`, `image_classifier`, `text_classifier`, `object_detector`, ...), which
   needs the `ts` package (the serving install carries it);
3. in the module, `function` (default `handle`) when it exists: a function entry point,
   initialised by calling it once as `handle(None, context)`, as TorchServe does;
4. otherwise exactly one class defined in the module (not imported into it): instantiated,
   then its `initialize(context)` and, per batch, `handle(data, context)`.

One deliberate difference: when the archive ships the handler file but importing it fails (it
imports a package that is missing, it has a syntax error), that error is reported, not
TorchServe's misleading "No module named ts.torch_handler.<name>".

`service_envelope` (config.properties; recorded as the manifest's `model.envelope` at
registration, as TorchServe's frontend does) wraps the entry point in TorchServe's envelope
class of that name (`ts.torch_handler.request_envelope.json`, `kserve`, `kservev2`, `body`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from mariner.server.common.archive import ModelArchive
from mariner.server.contracts.errors import Code, ServingError

_BUILTINS = "ts.torch_handler"
_ENVELOPES = "ts.torch_handler.request_envelope"


def _module_name(handler: str) -> tuple[str, str | None]:
    """TorchServe's `_load_handler_file` split: module name and optional function name."""
    module_part, sep, function = handler.partition(":")
    if module_part.endswith(".py"):
        module_part = module_part[:-3]
    return module_part.split("/")[-1], (function if sep else None)


def _import_fresh(name: str, model_dir: Path) -> ModuleType:
    """Import `name` with `model_dir` first on sys.path. A module of that name imported earlier
    from elsewhere (another archive's `handler.py` in this process) is not reused."""
    here = str(model_dir)
    if here in sys.path:
        sys.path.remove(here)
    sys.path.insert(0, here)
    old = sys.modules.get(name)
    if old is not None:
        origin = getattr(old, "__file__", None) or ""
        if origin and not Path(origin).resolve().is_relative_to(model_dir.resolve()):
            del sys.modules[name]
    importlib.invalidate_caches()
    return importlib.import_module(name)


def _ships(model_dir: Path, name: str) -> bool:
    """Whether the archive itself holds module `name` (a file or a package)."""
    first = name.split(".")[0]
    return (model_dir / f"{first}.py").is_file() or (model_dir / first / "__init__.py").is_file()


def load_handler_module(archive: ModelArchive) -> tuple[ModuleType, str | None]:
    """The handler's module and the function name the manifest names (None: `handle`)."""
    handler = archive.handler
    if not handler:
        raise ServingError(Code.INVALID_ARGUMENT, f"archive of model {archive.name} names no handler")
    name, function = _module_name(handler)
    try:
        return _import_fresh(name, archive.model_dir), function
    except ImportError as exc:
        if _ships(archive.model_dir, name):
            raise ServingError(
                Code.INVALID_ARGUMENT, f"handler {handler!r} of model {archive.name} failed to import: {exc}"
            ) from exc
        first_error = exc
    try:
        return importlib.import_module(f".{name}", _BUILTINS), function
    except ImportError as exc:
        if exc.name == "ts" or (exc.name or "").startswith(f"{_BUILTINS}.{name}") or exc.name == _BUILTINS:
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"handler {handler!r} of model {archive.name} is neither a module in the archive or "
                f"installed ({first_error}) nor a TorchServe built-in handler ({_BUILTINS}.{name}); "
                "built-ins: base_handler, image_classifier, image_segmenter, object_detector, "
                "text_classifier, text_handler, vision_handler, dali_image_classifier",
            ) from exc
        raise ServingError(
            Code.INVALID_ARGUMENT, f"built-in handler {_BUILTINS}.{name} failed to import: {exc}"
        ) from exc


def _classes(module: ModuleType) -> list[type]:
    """Classes defined in `module` itself (TorchServe's `list_classes_from_module`)."""
    return [
        member
        for _, member in inspect.getmembers(module, inspect.isclass)
        if member.__module__ == module.__name__
    ]


def _envelope(archive: ModelArchive, handle: Any) -> Any:
    name = archive.manifest.get("model", {}).get("envelope")
    if not name:
        return handle
    try:
        module = importlib.import_module(f".{name}", _ENVELOPES)
    except ImportError as exc:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"service_envelope {name!r} is not one of TorchServe's envelopes ({_ENVELOPES}: "
            f"json, kserve, kservev2, body): {exc}",
        ) from exc
    classes = _classes(module)
    if not classes:
        raise ServingError(Code.INVALID_ARGUMENT, f"envelope module {module.__name__} defines no class")
    return classes[0](handle).handle


def load_entry_point(archive: ModelArchive) -> tuple[Any, Any]:
    """Import the archive's handler the way TorchServe does; return (handle, initialize)."""
    module, function = load_handler_module(archive)
    function = function or "handle"
    if hasattr(module, function):
        entry = getattr(module, function)
        if not callable(entry):
            raise ServingError(
                Code.INVALID_ARGUMENT,
                f"handler {archive.handler!r}: {module.__name__}.{function} is not callable",
            )

        def initialize(context: Any) -> Any:
            # TorchServe initialises a function entry point this way; what a coroutine function
            # returns is awaited by the runner (TorchServe drops it unawaited).
            return entry(None, context)

        return _envelope(archive, entry), initialize
    classes = _classes(module)
    if len(classes) != 1:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"handler module {module.__name__} must define a '{function}' function or exactly one "
            f"class, found {len(classes)} classes ({', '.join(c.__name__ for c in classes) or 'none'})",
        )
    instance = classes[0]()
    if not hasattr(instance, "handle"):
        raise ServingError(
            Code.INVALID_ARGUMENT, f"handler class {classes[0].__name__} has no 'handle' method"
        )
    init: Any = getattr(instance, "initialize", None) or (lambda _context: None)
    return _envelope(archive, instance.handle), init
