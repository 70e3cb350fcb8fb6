"""The control channel loads values only: a message that would run code is refused and skipped,
and the next message still arrives."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
from pathlib import Path

from mariner.server.common import control_channel as channel


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_message_that_would_run_code_is_skipped_and_the_channel_goes_on(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = pickle.dumps(_Payload(marker), protocol=5)

    async def scenario() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("!I", len(bad)) + bad)
        reader.feed_data(channel.encode(channel.TableApplied(7)))
        reader.feed_eof()
        first = await channel.receive(reader)
        assert await channel.receive(reader) is None  # then EOF
        return first

    assert asyncio.run(scenario()) == channel.TableApplied(7)
    assert not marker.exists()
