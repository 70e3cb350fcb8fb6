"""The environment our children start with: the supervisor's, less every secret.

Why: a worker runs the archive's handler, arbitrary code that can read `os.environ` and
/proc/self/environ; a frontend needs no secret in its environment either (its tokens arrive in
the config over its control channel). So the supervisor, once it has read its config, drops
the variables that carry secrets from its own environment (`forget_secrets`), and every child
is started with `child_env()`: an explicit copy without those names and without any variable
whose value holds a secret it loaded (a `$$VAR$$` in a config.properties may name any variable).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# The variables that carry secrets: bearer tokens (MARINER_* as for every setting) and
# TorchServe's keystore password (refused as key material, never to be handed on either).
SECRET_ENV_NAMES = frozenset({"MARINER_INFERENCE_TOKEN", "MARINER_MANAGEMENT_TOKEN", "TS_KEYSTORE_PASS"})
MIN_MATCHED_SECRET = 8
# Secret values loaded by this process; no child's variable may hold one. Set once at start-up.
_secret_values: set[str] = set()


def forget_secrets(values: Iterable[str | None] = ()) -> None:
    """Drop the secret variables from this process's environment (children inherit it) and
    remember `values` (comma-separated token lists are split) so `child_env` drops any other
    variable that carries one."""
    for value in values:
        # Only values long enough to be told apart from ordinary text: a one-letter "token"
        # would strip every variable holding that letter (its variable is dropped by name).
        for token in (value or "", *(value or "").split(",")):
            if len(token.strip()) >= MIN_MATCHED_SECRET:
                _secret_values.add(token.strip())
    for name in list(os.environ):
        if _is_secret(name, os.environ[name]):
            del os.environ[name]


def _is_secret(name: str, value: str) -> bool:
    return name in SECRET_ENV_NAMES or any(secret in value for secret in _secret_values)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An explicit environment for a child: `base` (default: ours) without any secret."""
    source = os.environ if base is None else base
    return {k: v for k, v in source.items() if not _is_secret(k, v)}
