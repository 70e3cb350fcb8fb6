"""The work dir and the dirs made under it are ours alone, or the server refuses to start."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mariner.server.contracts.errors import ServingError
from mariner.server.supervisor.private_dir import ensure_private_dir, make_private_subdir, private_problem


def test_a_new_work_dir_and_its_missing_parents_are_made_private(tmp_path: Path) -> None:
    work = tmp_path / "a" / "b" / "work"
    old = os.umask(0)  # even a permissive umask gets no group/other bits: the mode is given at mkdir
    try:
        assert ensure_private_dir(work) == work
    finally:
        os.umask(old)
    for made in (work, work.parent, work.parent.parent):
        st = os.lstat(made)
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
    assert ensure_private_dir(work) == work  # an existing private dir of ours is accepted


def test_a_world_writable_work_dir_is_refused_naming_owner_and_mode(tmp_path: Path) -> None:
    work = tmp_path / "shared"
    work.mkdir()
    work.chmod(0o777)
    with pytest.raises(ServingError) as err:
        ensure_private_dir(work)
    message = err.value.message
    assert str(work) in message
    assert f"owned by uid {os.geteuid()} with mode 0777" in message
    assert "chmod 700" in message
    assert stat.S_IMODE(os.lstat(work).st_mode) == 0o777  # refused, not silently changed


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o710])
def test_any_group_or_other_bit_is_refused(tmp_path: Path, mode: int) -> None:
    work = tmp_path / "w"
    work.mkdir(mode=0o700)
    work.chmod(mode)
    assert private_problem(work) is not None


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o711])
def test_a_dir_of_ours_nobody_else_can_write_is_narrowed_to_0700(tmp_path: Path, mode: int) -> None:
    work = tmp_path / "w"
    work.mkdir(mode=0o700)
    work.chmod(mode)  # what an earlier version (or a plain mkdir) left behind
    assert ensure_private_dir(work) == work
    assert stat.S_IMODE(os.lstat(work).st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o1777])
def test_a_dir_of_ours_others_could_write_is_refused_unchanged(tmp_path: Path, mode: int) -> None:
    work = tmp_path / "w"
    work.mkdir(mode=0o700)
    work.chmod(mode)
    with pytest.raises(ServingError, match="chmod 700"):
        ensure_private_dir(work)
    assert stat.S_IMODE(os.lstat(work).st_mode) == mode


def test_a_symlinked_work_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ServingError, match="symbolic link"):
        ensure_private_dir(link)


def test_a_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "theirs"
    work.mkdir(mode=0o700)
    real = os.lstat(work)
    other = real.st_uid + 1001

    def lstat(path: Path) -> os.stat_result:
        fields = list(real)
        fields[stat.ST_UID] = other
        return os.stat_result(fields)

    problem = private_problem(work, lstat=lstat)
    assert problem is not None
    assert f"owned by uid {other} with mode 0700" in problem
    assert f"must be a directory owned by uid {os.geteuid()}" in problem


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_dir_really_owned_by_nobody_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "nobody"
    work.mkdir(mode=0o700)
    os.chown(work, 65534, 65534)
    with pytest.raises(ServingError, match="owned by uid 65534"):
        ensure_private_dir(work)


def test_a_subdir_planted_by_someone_else_is_refused(tmp_path: Path) -> None:
    work = ensure_private_dir(tmp_path / "work")
    planted = work / "sockets"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(ServingError, match="worker socket dir"):
        make_private_subdir(work, "sockets", what="worker socket dir")
