"""Directories only this server's user can touch: the work dir and every dir made under it.

Why: everything the server trusts lives there (worker sockets, unpacked archives whose handler
code the workers import, prometheus' multiprocess files). A dir another user owns, or can write
to, lets that user swap a socket or a handler between our check and our use. So a dir is made
atomically with mode 0700 (`os.mkdir(path, 0o700)`, never chmod afterwards) and then checked
with `lstat`: not a symlink, a directory, owned by our effective uid, no group or other bits.
A dir that already exists is accepted only if it passes the same check; otherwise the server
refuses to start and says which dir, its owner and mode, and what it must be. One exception: a
dir we own that nobody else can write to (say 0755, the mode earlier versions made) is narrowed
to 0700 in place, through a descriptor opened without following links: nobody else can have
put anything in it, so an upgrade needs no manual chmod.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

from mariner.server.contracts.errors import Code, ServingError


def private_problem(
    path: Path,
    *,
    lstat: Callable[[Path], os.stat_result] = os.lstat,
    euid: int | None = None,
    what: str = "work dir",
) -> str | None:
    """Why `path` is not a private dir of ours (None when it is one). `lstat` and `euid` are
    injectable so the other-owner case can be tested without a second user."""
    uid = os.geteuid() if euid is None else euid
    st = lstat(path)
    required = f"it must be a directory owned by uid {uid} and not group/other accessible"
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {path} is a symbolic link; {required} (pick another --work-dir)"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is not a directory; {required} (pick another --work-dir)"
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid or mode & 0o077:
        return (
            f"{what} {path} is owned by uid {st.st_uid} with mode {mode:04o}; {required} "
            f"(chmod 700 or pick another --work-dir)"
        )
    return None


def check_private(path: Path, *, what: str = "work dir") -> Path:
    """Raise ServingError (INVALID_ARGUMENT) unless `path` is a private dir of ours."""
    problem = private_problem(path, what=what)
    if problem is not None:
        raise ServingError(Code.INVALID_ARGUMENT, problem)
    return path


def ensure_private_dir(path: Path, *, what: str = "work dir") -> Path:
    """Make `path` a private dir (its missing parents are made too, with the same mode) or check
    the one that is there. Returns `path`; raises ServingError naming what is wrong."""
    path = Path(os.path.abspath(path))
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:
            pass  # made meanwhile by someone else: the check below decides whether it is ours
        except OSError as exc:
            raise ServingError(Code.INVALID_ARGUMENT, f"cannot create {what} {made}: {exc}") from exc
        if made != path:
            # A parent we made ourselves; someone racing us to it is still refused.
            check_private(made, what=f"{what} parent")
    _narrow_if_ours(path)
    return check_private(path, what=what)


def _narrow_if_ours(path: Path) -> None:
    """Take group/other read and search bits off a dir of ours that nobody else can write to."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # a link or not a dir: check_private says why
    try:
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid == os.geteuid() and mode & 0o077 and not mode & 0o022:
            os.fchmod(fd, mode & 0o700)
    finally:
        os.close(fd)


def make_private_subdir(parent: Path, name: str, *, what: str) -> Path:
    """A dir `name` under a private `parent`, made 0700 or checked if it is there already."""
    path = parent / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return check_private(path, what=what)
