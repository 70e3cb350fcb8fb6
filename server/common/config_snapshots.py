"""TorchServe's config snapshots: the files, their format, and which one a start restores.

TorchServe writes `<LOG_LOCATION>/config/<yyyyMMddHHmmssSSS>-startup.cfg` once it has started,
`...-snapshot.cfg` after every management change and `...-shutdown.cfg` at a clean stop
(SnapshotManager, FSSnapshotSerializer). Each is a config.properties file (java.util.Properties'
`store` format: `#` comments, `key=value` lines with `\\`, `:`, `=`, `#`, `!` and line breaks
escaped) holding the server's settings plus `model_snapshot`: a JSON document of every model
version served, its default version, archive (`marName`), worker counts and batching settings.

A start given no config file at all (no `TS_CONFIG_FILE`, `--ts-config` or `--config-file`)
restores the newest snapshot, as TorchServe's ConfigManager does: its settings are read as a
config.properties and its models are loaded with their snapshot settings, in place of
`--models`. `--ncs` / `--no-config-snapshots` turns both off.

Differences, for safety: at most `MAX_SNAPSHOTS` files are kept (the oldest go; TorchServe keeps
every one), the directory is made 0700 and each file 0600 (the settings may name key files),
and a snapshot is restored only from a file and directory owned by this user that nobody else
can write (anyone who can plant a file there would choose what the next start serves).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mariner.server.compat.torchserve import logdirs as ts_logdirs

log = logging.getLogger("mariner.config")

KINDS = ("startup", "snapshot", "shutdown")
MAX_SNAPSHOTS = 64
# yyyyMMddHHmmssSSS-kind.cfg, TorchServe's names (SnapshotManager.getSnapshotName).
_NAME = re.compile(r"^(\d{17})-(startup|snapshot|shutdown)\.cfg$")
# java.util.Properties.store escapes these in keys and values (and a key's spaces).
_JAVA_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f"}
_JAVA_SPECIALS = "=:#!"


def snapshot_dir(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Path:
    """Where snapshots live: `<LOG_LOCATION>/config` (FSSnapshotSerializer, `ts_logdirs`), made
    absolute against `cwd` (default: the working directory, as TorchServe resolves it)."""
    directory = ts_logdirs.snapshot_dir(env)
    return directory if directory.is_absolute() else (cwd or Path.cwd()) / directory


def snapshot_name(kind: str, now: float) -> str:
    """`yyyyMMddHHmmssSSS-<kind>.cfg` in local time, as TorchServe's SimpleDateFormat names it."""
    millis = int(now * 1000) % 1000
    return f"{time.strftime('%Y%m%d%H%M%S', time.localtime(now))}{millis:03d}-{kind}.cfg"


def _java_escape(text: str, *, key: bool) -> str:
    out = []
    for i, ch in enumerate(text):
        if ch in _JAVA_ESCAPES:
            out.append(_JAVA_ESCAPES[ch])
        elif ch in _JAVA_SPECIALS or (ch == " " and (key or i == 0)):
            out.append("\\" + ch)
        elif ord(ch) < 0x20:  # store(Writer) leaves other characters as they are (UTF-8 here)
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return "".join(out)


def properties_text(props: Mapping[str, str], now: float, comment: str = "Saving snapshot") -> str:
    """`props` as java.util.Properties.store writes them: a comment, the date, `key=value`."""
    date = time.strftime("%a %b %d %H:%M:%S %Z %Y", time.localtime(now))
    lines = [f"#{comment}", f"#{date}"]
    lines += [f"{_java_escape(k, key=True)}={_java_escape(v, key=False)}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


def model_snapshot_json(name: str, models: Mapping[str, Mapping[str, Mapping[str, Any]]], now: float) -> str:
    """TorchServe's `model_snapshot` document (its Snapshot class as Gson prints it)."""
    count = sum(len(versions) for versions in models.values())
    doc = {"name": name, "modelCount": count, "created": int(now * 1000), "models": models}
    return json.dumps(doc, indent=2)


def _owned_and_private(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_dir(directory: Path) -> None:
    """Make `directory` (0700; its missing parents too) unless it exists; refuse a symlink or a
    non-directory in its place (OSError)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{directory} is not a directory")


def write_snapshot(
    directory: Path,
    kind: str,
    props: Mapping[str, str],
    models: Mapping[str, Mapping[str, Mapping[str, Any]]],
    *,
    now: float | None = None,
    keep: int = MAX_SNAPSHOTS,
) -> Path:
    """Write one snapshot file (0600, never over an existing file or through a symlink), then
    remove the oldest snapshots beyond `keep`. Blocking: call it off the event loop."""
    if kind not in KINDS:
        raise ValueError(f"snapshot kind must be one of {KINDS}, got {kind!r}")
    now = time.time() if now is None else now
    _private_dir(directory)
    existing = _snapshots(directory)
    latest = existing[-1].name[:17] if existing else ""
    for _ in range(100):  # bounded: a local time that does not round-trip (DST) cannot spin
        name = snapshot_name(kind, now)
        if name[:17] <= latest:
            # Names order the snapshots (the newest is restored): a change in the same millisecond
            # as the last one, or a clock set back, is written just after it.
            after = _time_of(latest)  # a name from _snapshots or our own: always a time
            now = max(now, now if after is None else after) + 0.0015
            continue
        text = properties_text({**props, "model_snapshot": model_snapshot_json(name, models, now)}, now)
        try:
            fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            latest = name[:17]
            continue
        break
    else:
        raise FileExistsError(f"no free snapshot name in {directory} after {snapshot_name(kind, now)}")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    _prune(directory, keep)
    return directory / name


def _time_of(name: str) -> float | None:
    """The time a snapshot's name says (local time, to the millisecond), or None when its digits
    are no date (`20241399...`): such a file is not one TorchServe or we wrote, and a stray file
    in the directory must never stop a start or a write (strptime's ValueError did)."""
    digits = name[:17]
    try:
        stamp = datetime.datetime(
            int(digits[0:4]), int(digits[4:6]), int(digits[6:8]),
            int(digits[8:10]), int(digits[10:12]), int(digits[12:14]),
        )  # fmt: skip
        whole = time.mktime(stamp.timetuple())  # tm_isdst -1: the local rule of that date
    except (ValueError, OverflowError):
        return None
    return whole + int(digits[14:17]) / 1000


def _snapshots(directory: Path) -> list[Path]:
    """The snapshot files of `directory`, oldest first (their names sort by time): names of
    TorchServe's form whose digits are a real time; any other file is left alone."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [directory / n for n in sorted(names) if _NAME.match(n) and _time_of(n) is not None]


def _prune(directory: Path, keep: int) -> None:
    """Remove the oldest snapshots beyond `keep` (the directory listed once: a second listing
    could differ from the first and cut the wrong ones)."""
    found = _snapshots(directory)
    for old in found[: max(0, len(found) - keep)]:
        try:
            os.unlink(old)
        except OSError as exc:
            log.warning("cannot remove old config snapshot %s: %s", old, exc.strerror)


def last_snapshot(directory: Path) -> Path | None:
    """The newest snapshot a start may restore (TorchServe's getLastSnapshot), or None: only a
    regular file owned by this user in a directory owned by it, neither writable by others; a
    newest file that fails this is named in a warning and nothing is restored."""
    try:
        dir_st = os.lstat(directory)
    except OSError:
        return None
    found = [p for p in _snapshots(directory) if not p.is_dir()]
    if not found:
        return None
    newest = found[-1]
    try:
        st = os.lstat(newest)
    except OSError:
        return None
    if not (stat.S_ISDIR(dir_st.st_mode) and _owned_and_private(dir_st)):
        log.warning("not restoring config snapshot %s: its directory is not this user's alone", newest)
        return None
    if not (stat.S_ISREG(st.st_mode) and _owned_and_private(st)):
        log.warning("not restoring config snapshot %s: not a regular file of this user's alone", newest)
        return None
    return newest


def snapshot_specs(model_snapshot: Mapping[str, Any]) -> list[tuple[str, str, dict[str, Any], bool]]:
    """(model name, archive, TorchServe settings, default version?) per version of a snapshot's
    `model_snapshot`, the default version of each model first (it becomes the default); ValueError
    naming what is malformed."""
    models = model_snapshot.get("models")
    if not isinstance(models, Mapping):
        raise ValueError('model_snapshot has no "models" object')
    out = []
    for name, versions in models.items():
        if not isinstance(versions, Mapping):
            raise ValueError(f"model_snapshot models[{name!r}] must map versions to settings")
        entries = []
        for version, entry in versions.items():
            if not isinstance(entry, Mapping) or not isinstance(entry.get("marName"), str):
                raise ValueError(f"model_snapshot models[{name!r}][{version!r}] names no marName")
            entries.append((str(name), entry["marName"], dict(entry), bool(entry.get("defaultVersion"))))
        out += sorted(entries, key=lambda e: not e[3])
    return out
