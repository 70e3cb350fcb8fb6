"""What a management caller's strings may hold before they reach a path, a process or a log line.

A model name becomes part of worker ids, log prefixes (the workers log plain text), metric
labels and the management URLs `/models/{name}/{version}`; a register `url` becomes a path in
the model store. So every string a caller gives is checked here, once, before it is used:

* no control characters anywhere (C0, DEL and C1, plus the Unicode line and paragraph
  separators): a NUL made `pathlib` raise (a 500 with a traceback) and a newline forged log
  lines;
* a model name follows torch-model-archiver's rule (`check_model_name_regex_or_exit` in the
  torchserve wheel: `^[A-Za-z0-9][A-Za-z0-9_\\-.]*$`), so `a/b` (which no URL can address)
  and `../../etc/x` are refused. TorchServe's own frontend checks only that a name is present;
  Mariner applies the archiver's rule to every source of a name (register parameter, manifest,
  `models=` entry, archive file name) and caps it at 128 characters, which TorchServe does not.

A refusal is ServingError(INVALID_ARGUMENT): 400 with TorchServe's `BadRequestException` body
on REST. Messages quote the rejected text with `repr()`, so it never reaches a log or an
answer with its control characters intact.
"""

from __future__ import annotations

import re

from mariner.server.contracts.errors import Code, ServingError

__all__ = [
    "MAX_MODEL_NAME_CHARS",
    "MAX_PARAM_CHARS",
    "MODEL_NAME_RULE",
    "check_model_name",
    "check_param",
    "check_params",
    "model_name_problem",
]

MODEL_NAME_RULE = r"^[A-Za-z0-9][A-Za-z0-9_\-.]*$"  # torch-model-archiver's filter, verbatim
MAX_MODEL_NAME_CHARS = 128
# A store file name or a setting's value; PATH_MAX on Linux is 4096 bytes.
MAX_PARAM_CHARS = 4096
_MODEL_NAME = re.compile(MODEL_NAME_RULE)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _shown(value: str, limit: int = 80) -> str:
    """`value` quoted and escaped for a message, cut to `limit` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def control_problem(value: str) -> str | None:
    """What is wrong with `value` if it holds a control character, else None."""
    found = _CONTROL.search(value)
    if found is None:
        return None
    return f"holds the control character U+{ord(found.group()):04X} at position {found.start()}"


def check_param(param: str, value: object, *, max_chars: int = MAX_PARAM_CHARS) -> None:
    """Refuse a caller's string parameter with a control character or over `max_chars`; other
    types (a JSON body's numbers and booleans) are left to the parameter's own check."""
    if not isinstance(value, str):
        return
    problem = control_problem(value)
    if problem is None and len(value) > max_chars:
        problem = f"is {len(value)} characters long"
    if problem is not None:
        raise ServingError(
            Code.INVALID_ARGUMENT,
            f"parameter {param} {_shown(value)} {problem}; allowed: printable characters only, "
            f"at most {max_chars}",
        )


def check_params(params: dict[str, object]) -> None:
    """`check_param` for each (name, value) pair, in name order so the answer is stable."""
    for param in sorted(params):
        check_param(param, params[param])


def model_name_problem(name: str) -> str | None:
    """Why `name` is not a model name TorchServe's archiver would write, or None when it is."""
    problem = control_problem(name)
    if problem is not None:
        return problem
    if len(name) > MAX_MODEL_NAME_CHARS:
        return f"is {len(name)} characters long"
    if not _MODEL_NAME.match(name):
        return "contains special characters"
    return None


def check_model_name(name: str, where: str = "parameter model_name") -> str:
    """`name` when it is an allowed model name, else ServingError(INVALID_ARGUMENT) naming
    `where` it came from (a parameter, a manifest field, a file name) and the rule."""
    problem = model_name_problem(name)
    if problem is None:
        return name
    raise ServingError(
        Code.INVALID_ARGUMENT,
        f"{where} {_shown(name)} {problem}; a model name must match {MODEL_NAME_RULE} "
        f"(letters, digits, '_', '-' and '.', starting with a letter or digit) and be at most "
        f"{MAX_MODEL_NAME_CHARS} characters",
    )
