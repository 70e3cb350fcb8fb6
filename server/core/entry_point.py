"""Importing an archive's handler the way TorchServe does (`handler` = `file.py`,
`file.py:function` or `module:function`), apart from the runner that calls it."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from typing import Any

from mariner.server.core.archive import ModelArchive
from mariner.server.core.errors import Code, ServingError

_module_ids = itertools.count()


def load_entry_point(archive: ModelArchive) -> tuple[Any, Any]:
    """Import the archive's handler the way TorchServe does; return (handle, initialize).

    `handler` is `file.py`, `file.py:function` or `module:function`. A module must define a
    `handle` function or exactly one class (instantiated, then its `initialize`/`handle`).
    The model dir goes on sys.path so the handler can import files shipped beside it.
    """
    spec_str = archive.handler
    module_part, _, func_name = spec_str.partition(":")
    file_name = module_part if module_part.endswith(".py") else f"{module_part}.py"
    path = archive.model_dir / file_name
    if not path.is_file():
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"handler {spec_str!r} is not a file in the archive; "
            "built-in TorchServe handlers need the ts package",
        )
    if str(archive.model_dir) not in sys.path:
        sys.path.append(str(archive.model_dir))
    mod_name = f"mariner_handler_{next(_module_ids)}_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ServingError(Code.INVALID_ARGUMENT, f"cannot import handler {spec_str!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    func_name = func_name or "handle"
    if hasattr(module, func_name) and callable(getattr(module, func_name)):
        return getattr(module, func_name), getattr(module, "initialize", lambda _ctx: None)
    classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == mod_name]
    if len(classes) != 1:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"handler module {file_name} must define a 'handle' function or exactly one class, "
            f"found {len(classes)}",
        )
    instance = classes[0]()
    return instance.handle, getattr(instance, "initialize", lambda _ctx: None)
