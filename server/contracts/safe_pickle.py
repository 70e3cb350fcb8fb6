"""Unpickling that builds values, never runs code: what the server's processes send each other.

Why: a pickle names callables (`find_class`) and calls them, so `pickle.loads` of a frame from
a peer that is not ours (a swapped socket, a compromised worker answering its frontend) runs
whatever that peer chose. Every frame between our processes (worker sockets, the control
channel) is loaded here instead: only the classes the protocols carry resolve, and anything
else raises `UnsafePickle` (a `pickle.UnpicklingError`), which fails that message, not the
process.

What resolves: our own value types (dataclasses and enums defined in `mariner.server`), the
builtins and stdlib containers handler results are made of, and numpy's array and scalar
reconstruction (handlers return numpy arrays and scalars; TorchServe's JSON-like results
carry them). Calling a dataclass or an enum only builds a value; none of them act on load.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import pickle
from collections.abc import Iterable
from typing import Any

# Builtins a frame may construct: values, no callables that act on the system.
_BUILTINS = frozenset(
    {
        "bytes",
        "bytearray",
        "complex",
        "set",
        "frozenset",
        "slice",
        "range",
        "tuple",
        "list",
        "dict",
        "int",
        "float",
        "str",
        "bool",
    }
)
# module -> names: the stdlib and numpy pieces the protocol's values are pickled with.
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": _BUILTINS,
    "collections": frozenset({"OrderedDict", "deque", "defaultdict"}),
    "datetime": frozenset({"datetime", "date", "time", "timedelta", "timezone"}),
    "decimal": frozenset({"Decimal"}),
    "uuid": frozenset({"UUID"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "Path"}),
    "numpy": frozenset(
        {
            "ndarray",
            "dtype",
            "bool_",
            "float16",
            "float32",
            "float64",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "complex64",
            "complex128",
            "str_",
            "bytes_",
        }
    ),  # fmt: skip
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy.core.numeric": frozenset({"_frombuffer"}),
    "numpy._core.numeric": frozenset({"_frombuffer"}),
    "numpy.dtypes": frozenset(
        {
            "Float16DType",
            "Float32DType",
            "Float64DType",
            "Int8DType",
            "Int16DType",
            "Int32DType",
            "Int64DType",
            "UInt8DType",
            "UInt16DType",
            "UInt32DType",
            "UInt64DType",
            "BoolDType",
            "StrDType",
            "BytesDType",
            "Complex64DType",
            "Complex128DType",
            "ObjectDType",
        }
    ),  # fmt: skip
}
_OURS = "mariner.server."


class UnsafePickle(pickle.UnpicklingError):
    """A frame named something the protocols never carry: refused before anything is called."""


def _is_our_value_type(obj: Any) -> bool:
    """A class defined in mariner.server that only holds values: a dataclass or an enum."""
    return (
        isinstance(obj, type)
        and str(getattr(obj, "__module__", "")).startswith(_OURS)
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    )


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in a frame: name a member of one of our enums. Some
    Python builds (Debian's 3.11.2, 3.12+) pickle an enum member as `getattr(cls, name)`."""
    ours = isinstance(cls, type) and issubclass(cls, enum.Enum) and _is_our_value_type(cls)
    if ours and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafePickle(
        f"refused getattr({cls!r}, {name!r}) in a peer's frame: only a member of Mariner's enums may be named"
    )


class SafeUnpickler(pickle.Unpickler):
    """A `pickle.Unpickler` whose `find_class` resolves only the allowlist above."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module.startswith(_OURS) and "." not in name:
            try:
                obj = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                obj = None
            if _is_our_value_type(obj):
                return obj
        raise UnsafePickle(
            f"refused to load {module}.{name} from a peer's frame: only the protocol's value types "
            "(Mariner's dataclasses and enums, builtin containers and numbers, numpy arrays) may travel"
        )


def loads(data: bytes | bytearray | memoryview, *, buffers: Iterable[Any] | None = None) -> Any:
    """`pickle.loads` restricted to the allowlist; raises UnsafePickle for anything else."""
    return SafeUnpickler(io.BytesIO(data), buffers=buffers).load()
