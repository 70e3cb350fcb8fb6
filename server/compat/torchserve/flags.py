"""The `torchserve` command line a user already types, accepted by `mariner serve`.

TorchServe 0.12's flags (ts/arg_parser.py) and what each does here:

- `--ts-config FILE`: the config.properties to read (TorchServe's order: the `TS_CONFIG_FILE`
  variable, then this flag, then `./config.properties` when it exists),
- `--model-store DIR`, `--models M ...` (`name=file.mar`, `file.mar`, `all`; space- or
  comma-separated): Mariner's own flags of the same names,
- `--enable-model-api`: `--enable-model-management`,
- `--start`, `--foreground`: accepted; `mariner serve` always runs in the foreground,
- `--ncs` / `--no-config-snapshots`: no config snapshots written or restored (Mariner's
  `config_snapshots` setting, see config_snapshots),
- `--disable-token-auth` / `--dt`: turns TorchServe's token authorization off (Mariner's
  `disable_token_auth` setting; without it key_file.json is written and every API needs its key,
  as on TorchServe),
- `--workflow-store DIR`: Mariner's own flag of the same name (where `POST /workflows` finds
  `.war` archives; the model store when not given),
- refused with the reason: `--stop`, `--version`, `--log-config`, `--cpp-log-config`,
  `--plugins-path`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("mariner.config")

# Accepted with nothing to do: (flags, help).
_NO_OPS = (
    (("--start",), "accepted for torchserve habits: mariner serve starts the server"),
    (("--foreground",), "accepted for torchserve habits: mariner serve always runs in the foreground"),
)
# Refused: flag -> why, and what to do instead.
REFUSED = {
    "--stop": "mariner serve runs in the foreground: stop it with SIGTERM (Ctrl-C), which drains it",
    "--version": "run `pip show mariner` for Mariner's version",
    "--log-config": "Mariner does not use log4j: set --log-level (and --access-log)",
    "--cpp-log-config": "Mariner has no C++ backend",
    "--plugins-path": "Mariner loads no Java plugins",
    "--ppath": "Mariner loads no Java plugins",
}
_TS_DESTS = ("ts_config", "enable_model_api", *(f[0][2:].replace("-", "_") for f, _ in _NO_OPS))


def add_torchserve_flags(parser: argparse.ArgumentParser) -> None:
    """Add torchserve's own flags that `mariner serve` has no field of its own for."""
    parser.add_argument(
        "--ts-config",
        default=None,
        help="TorchServe config.properties to read (env TS_CONFIG_FILE wins, as in torchserve)",
    )
    parser.add_argument(
        "--enable-model-api",
        action="store_true",
        default=None,
        help="torchserve's name for --enable-model-management",
    )
    # torchserve's short name of --disable-token-auth (ServerConfig.disable_token_auth's own flag).
    parser.add_argument(
        "--dt", dest="disable_token_auth", action="store_const", const=True, default=None,
        help="torchserve's name for --disable-token-auth",
    )  # fmt: skip
    # torchserve's short name of --no-config-snapshots (ServerConfig.config_snapshots' own flag).
    parser.add_argument(
        "--ncs", dest="config_snapshots", action="store_const", const=False, default=None,
        help="torchserve's name for --no-config-snapshots",
    )  # fmt: skip
    for flags, text in _NO_OPS:
        parser.add_argument(*flags, dest=flags[0][2:].replace("-", "_"), action="store_true", help=text)
    for flag in REFUSED:
        parser.add_argument(
            flag, *(("-v",) if flag == "--version" else ()), nargs="?", const=True, default=None,
            help=argparse.SUPPRESS,
        )  # fmt: skip


@dataclass(frozen=True)
class TorchServeFlags:
    """What torchserve's own flags asked for, taken out of the parsed arguments."""

    ts_config: str | None = None
    enable_model_api: bool = False


def take_torchserve_flags(args: dict[str, Any]) -> TorchServeFlags:
    """Pop torchserve's flags from `args` (argparse's dict); ValueError for a refused one."""
    for flag, why in REFUSED.items():
        if args.pop(flag[2:].replace("-", "_"), None) is not None:
            raise ValueError(f"torchserve's {flag} is not supported by mariner serve: {why}")
    taken = {dest: args.pop(dest, None) for dest in _TS_DESTS}
    models = args.get("models")
    if isinstance(models, list):  # torchserve's `--models a=a.mar b.mar` (nargs="+")
        args["models"] = ",".join(models)
    return TorchServeFlags(ts_config=taken["ts_config"], enable_model_api=bool(taken["enable_model_api"]))


def torchserve_config_path(
    flag: str | None, env: Mapping[str, str], cwd: Path | None = None, *, others: bool = False
) -> Path | None:
    """The config.properties TorchServe would read: `TS_CONFIG_FILE`, else `--ts-config`, else
    `./config.properties` if it exists and no other config file (`others`) was given."""
    chosen = env.get("TS_CONFIG_FILE") or flag
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            source = "TS_CONFIG_FILE" if env.get("TS_CONFIG_FILE") else "--ts-config"
            raise ValueError(f"{source} {chosen}: no such file")
        return path
    here = (cwd or Path.cwd()) / "config.properties"
    if not others and here.is_file():
        log.info("reading %s, as torchserve does when no config file is given", here)
        return here
    return None
