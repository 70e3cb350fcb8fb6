"""The HTTP inference call: who the caller is, and the call run unless the client goes away first.

Shared by TorchServe's, the Open Inference Protocol's and KServe v1's REST adapters; kept out of
`common.http_common`, which the supervisor's management app also runs and which knows no call
path."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mariner.server.common.batch_policy import CALLER
from mariner.server.common.http_common import ClientGone
from mariner.server.common.http_limits import DISCONNECT_HOOK
from mariner.server.contracts.types import InferRequest, InferResult
from mariner.server.frontend.protocols.call import CallPlane


def note_caller(scope: Mapping[str, Any]) -> None:
    """Set this call's caller for the batcher's fair order (`batching.CALLER`): the HTTP
    connection, by its client address pair."""
    CALLER.set(scope.get("client"))


async def infer_unless_client_gone(
    dataplane: CallPlane,
    req: InferRequest,
    scope: Mapping[str, Any],
    receive: Callable[[], Awaitable[Mapping[str, Any]]],
) -> InferResult:
    """`dataplane.infer`, cancelled if the client disconnects first; the batcher then skips the
    request, so no answer is computed that nobody will read.

    Under Mariner's listeners the protocol calls back when the connection is lost
    (`http_limits.DISCONNECT_HOOK` in the scope): nothing runs per request but a registration.
    Elsewhere a watcher task waits on the ASGI `receive` (the body is already read, so the next
    message is `http.disconnect`), which costs a task per request.
    """
    note_caller(scope)
    task = asyncio.current_task()
    assert task is not None
    gone = False

    def client_gone() -> None:
        nonlocal gone
        gone = True
        task.cancel()

    hook = scope.get("extensions", {}).get(DISCONNECT_HOOK)
    if hook is not None:
        stop_watching: Callable[[], Any] = hook(client_gone)
    else:

        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # a server that cannot report disconnects: just stop watching
                return
            client_gone()

        stop_watching = asyncio.get_running_loop().create_task(watch()).cancel
    try:
        return await dataplane.infer(req)
    except asyncio.CancelledError:
        if not gone:
            raise
        raise ClientGone from None
    finally:
        stop_watching()
        if gone:  # our own cancel, not the server's: take it back so this task can still answer
            task.uncancel()
