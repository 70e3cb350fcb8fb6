"""Asking a worker's handler to describe its model (TorchServe's DESCRIBE command) over the
worker wire, from a process that holds no connection to it (the supervisor's management API).

Apart from `worker_wire` because it is a client of the wire, not part of it: one call on a
connection of its own, and the request TorchServe hands the handler for it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping

from mariner.server.contracts.errors import Code, ServingError
from mariner.server.contracts.peer import PeerRefused, check_peer
from mariner.server.contracts.types import InferRequest, InferResult, WireProtocol
from mariner.server.contracts.worker_wire import (
    CREDENTIAL_HEADERS,
    Describe,
    FrameError,
    Result,
    read_message,
    write_message,
)


async def ask_describe(
    socket_path: str, request: InferRequest, timeout_s: float, *, expected_pid: int | None = None
) -> InferResult:
    """Send one `Describe` on a connection of its own to the worker at `socket_path` and return
    the handler's result; bounded by `timeout_s` (DEADLINE_EXCEEDED beyond it). The listener must
    run as our uid (and be `expected_pid`, the worker's pid, when given). A failure the worker
    reports comes back as the ServingError it names."""

    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(socket_path)
            try:
                check_peer(
                    writer.get_extra_info("socket"),
                    what=f"worker socket {socket_path}",
                    expected_pid=expected_pid,
                )
                await write_message(writer, Describe(0, request))
                answer = await read_message(reader)
            finally:
                writer.close()
    except TimeoutError:
        raise ServingError(
            Code.DEADLINE_EXCEEDED, f"the handler did not describe the model within {timeout_s:g} s"
        ) from None
    except (OSError, asyncio.IncompleteReadError, FrameError, PeerRefused) as exc:
        raise ServingError(Code.UNAVAILABLE, f"the model's worker could not be asked: {exc}") from None
    if not isinstance(answer, Result) or answer.id != 0:
        raise ServingError(Code.INTERNAL, "the model's worker answered a describe call with something else")
    if answer.error is not None:
        codes = {c.value: c for c in Code}
        raise ServingError(codes.get(answer.error.code, Code.INTERNAL), answer.error.message)
    if len(answer.results) != 1:
        raise ServingError(Code.INTERNAL, "the handler's describe call did not return exactly one result")
    return answer.results[0]


def describe_request(
    model: str, version: str, headers: Mapping[str, str], protocol: WireProtocol
) -> InferRequest:
    """The request a describe call hands the handler, as TorchServe builds it: no data, the
    caller's headers (credentials left out, as for inference) and `describe: True`, which
    TorchServe's BaseHandler checks to call `describe_handle`."""
    kept = {k.lower(): v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}
    return InferRequest(
        model=model,
        version=version,
        data={},
        protocol=protocol,
        request_id=uuid.uuid4().hex,
        headers={**kept, "describe": "True"},
    )
