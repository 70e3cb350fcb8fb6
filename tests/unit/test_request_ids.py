"""Request ids: 32 hex digits like uuid4().hex, unique in a process and across a fork."""

from __future__ import annotations

import os
import re

import pytest

from mariner.server.common.request_ids import new_request_id

pytestmark = pytest.mark.unit


def test_ids_look_like_uuid4_hex_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_its_own_prefix() -> None:
    parent = new_request_id()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(w, new_request_id().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 64).decode()
    os.waitpid(pid, 0)
    assert child[:20] != parent[:20]
