"""Connection-level limits for every HTTP listener, enforced before auth and before routing.

uvicorn's httptools parser accepts request heads of any size (it buffers a header value until it
ends), waits forever for a head or a body that trickles in, and caps nothing per connection:
uvicorn's `limit_concurrency` counts tasks, and only once a head is complete. A few clients could
so grow the process by hundreds of MiB, or hold sockets until the file-descriptor limit, after
which nothing in the process (HTTP health, gRPC ServerLive) answers. nginx's answers are the model:

- the request head (request line and headers) is capped (`max_header_bytes`, nginx's 4 x 8 KiB):
  over it the client gets 431 and the connection closes;
- the head must arrive within `header_timeout_s` of the connection opening or of its first byte,
  the body within `body_timeout_s` of the head: else 408 and close (a connection that sent
  nothing at all is closed without an answer, as nginx does, so a browser's unused preconnect is
  not shown an error);
- an idle keep-alive connection closes after `keep_alive_s` (uvicorn's setting). uvicorn arms a
  timer for it after every answer and cancels it on the next request's first read; here one timer
  per connection checks, when it fires, how long the connection has been idle and waits out the
  rest if it has not been idle long enough, so an answer only notes when it ended (a timer per
  answer cost the prediction path ~4 us in-process, ~1/12 of its work);
- at most `max_connections` connections per listener (per process): one beyond it is answered
  503 and closed, so sockets never pile up towards the descriptor limit. Slots go to clients
  that use them: when the listener is full, the connection that has waited longest without
  completing its first request head, if that is `STALE_HEAD_S` or more, is closed (408 if it
  sent anything) to make room for the new one, so a flood of connections that trickle their
  heads cannot keep a real client out for the whole header timeout.

The same protocol tells a request that its connection is gone without a task per request: it
puts a registration function in the ASGI scope (`scope["extensions"][DISCONNECT_HOOK]`); a callback
registered there runs once the connection is lost (`http_common.infer_unless_client_gone` cancels
the inference with it). Under another server the scope has no such entry and a task waits for
`http.disconnect` instead.

With a frontend's budget of held request bytes (`held`, see held_bytes), a request holds the body
bytes that have arrived from their arrival until its answer is complete or the connection ends
(what arrived, not what the Content-Length promises: a client trickling a large body holds only
what it sent). A request whose Content-Length would not fit is answered 503 with Retry-After before
its body is read, and one whose body stops fitting as it arrives is answered so then; either way
the connection closes (the unread body cannot be skipped).

At shutdown (the frontend's drain closing its listeners) uvicorn closes every idle keep-alive
connection at once; a request the client had just sent on one was then lost to a connection reset
(11 of 4,631 requests in a review's SIGTERM under keep-alive load). Here an idle connection
lingers `SHUTDOWN_LINGER_S` first: a request that arrives meanwhile is answered (while draining,
503 with `Connection: close`) and the connection then closes after its answer.

The layer is a subclass of uvicorn's HttpToolsProtocol (written against uvicorn 0.54) that sees
every byte before the parser and the parser's callbacks before uvicorn starts the ASGI app. It adds
no timer to a request that arrives in one read: timers are armed only while a head or a body is
incomplete at the end of a read (plus, per connection, one for the first request and the
keep-alive timer, re-armed at most once per `keep_alive_s`).
"""

from __future__ import annotations

import asyncio
import functools
import json
from asyncio import TimerHandle
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mariner.server.common.held_bytes import HeldBytes
from mariner.server.common.raw_headers import first_header
from mariner.server.contracts.errors import RETRY_AFTER_SECONDS

# The ASGI scope extension through which a request learns that its connection is gone: a function
# taking a callback (run once, on the loop, when the connection is lost) and returning its remover.
DISCONNECT_HOOK = "mariner.on_disconnect"

# How long a connection beyond the cap may take to send its request before it is closed. Its
# answer (503) is written at once; reading what the client sent before closing lets the kernel
# end the connection with FIN rather than RST, which would discard the answer. Short, so that
# connections beyond the cap never accumulate.
OVER_CAPACITY_WAIT_S = 1.0
# How long a connection may go without completing its first request head before, on a full
# listener, it gives its slot to a new connection (module docstring). Far longer than a real
# client takes to send a head on any network that serves it.
STALE_HEAD_S = 1.0
# How long an idle keep-alive connection stays open at shutdown for a request already on its way
# (module docstring): requests sent before the listener closed arrive within a round trip.
SHUTDOWN_LINGER_S = 0.5
# Bytes a header line costs beyond its name and value (": " and CRLF).
_HEADER_OVERHEAD = 4


@dataclass(frozen=True)
class HttpLimits:
    """Per-listener limits (see the module docstring); ServerConfig's http_* settings."""

    max_header_bytes: int = 32 * 1024
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 1000

    def __post_init__(self) -> None:
        for f in fields(self):
            name = f.name
            if not getattr(self, name) > 0:
                raise ValueError(f"http_{name} must be positive, got {getattr(self, name)!r}")


def raw_response(status: int, reason: str, kind: str, message: str, extra: bytes = b"") -> bytes:
    """A complete `connection: close` response in TorchServe's error shape, for answers written
    to the transport directly (no ASGI cycle exists, or it is being abandoned)."""
    body = (json.dumps({"code": status, "type": kind, "message": message}, indent=2) + "\n").encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    ).encode()
    return head + extra + b"\r\n" + body


class _Refuse(Exception):
    """Raised from a parser callback to stop parsing; httptools wraps it in HttpParserCallbackError."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `limits` (set by `limited_protocol`)."""

    limits: ClassVar[HttpLimits] = HttpLimits()
    held: ClassVar[HeldBytes | None] = None
    # The listener's connections that have not completed a first request head, oldest first,
    # with when each opened (one dict per listener: `limited_protocol`).
    unproven: ClassVar[OrderedDict[LimitedHttpToolsProtocol, float]] = OrderedDict()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn logs each answer when the "uvicorn.access" logger has a handler, whatever
        # `access_log` says: a logging setup that gives it one would turn `--access-log` on.
        self.access_log = self.access_log and self.config.access_log
        self._in_head = True  # waiting for or reading a request head (else reading or past a body)
        self._in_body = False  # the head is complete, the body is not
        self._begun = False  # the parser has seen a first byte of the current request
        self._read_bytes = 0  # bytes read while in the head: bounds what httptools buffers
        self._head_bytes = 0  # request target + header lines, counted by the parser callbacks
        self._timer: TimerHandle | None = None
        self._over_capacity = False
        self._refusal: bytes | None = None
        self._on_lost: set[Callable[[], None]] = set()  # DISCONNECT_HOOK callbacks of this connection
        self._lost = False
        # Bytes held in `held` per request whose answer is not complete, oldest first (HTTP/1.1
        # answers in order); the last is the request being read, counted as its body arrives.
        self._holding: deque[int] = deque()
        self._shutting = False  # uvicorn's shutdown began: answer what arrives, then close
        # The keep-alive timer (module docstring): when the connection last became idle (its
        # answer complete, nothing read since), or None while a request is being read or answered.
        self._idle_since: float | None = None
        self._keep_alive_timer: TimerHandle | None = None

    # -- connection --------------------------------------------------------------------------
    # asyncio types the argument BaseTransport; uvicorn hands its HTTP protocols a socket Transport.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._evict_stale():
            # Not counted, not handed to uvicorn: answer, then close once the request is read.
            self._over_capacity = True
            self.transport = transport
            transport.write(
                raw_response(
                    503,
                    "Service Unavailable",
                    "UNAVAILABLE",
                    f"too many connections (http_max_connections={self.limits.max_connections}); retry later",
                    f"retry-after: {RETRY_AFTER_SECONDS}\r\n".encode(),
                )
            )
            self._timer = self.loop.call_later(OVER_CAPACITY_WAIT_S, transport.close)
            return
        super().connection_made(transport)
        self.unproven[self] = self.loop.time()
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def _evict_stale(self) -> bool:
        """Close the listener's oldest connection without a complete first head, if it has had
        STALE_HEAD_S; True when one was closed (its slot is this connection's)."""
        if not self.unproven:
            return False
        oldest, since = next(iter(self.unproven.items()))
        if self.loop.time() - since < STALE_HEAD_S:
            return False
        del self.unproven[oldest]
        oldest._disarm()
        if oldest._begun:
            oldest._answer_and_close(
                oldest._timeout_answer("request headers not received; the connection's slot went to another")
            )
        else:
            oldest.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None
        if self._over_capacity:
            return
        super().connection_lost(exc)
        self.unproven.pop(self, None)
        self._lost = True
        if self.held is not None and self._holding:
            self.held.release(sum(self._holding))
            self._holding.clear()
        callbacks, self._on_lost = list(self._on_lost), set()  # a callback may remove itself
        for callback in callbacks:
            callback()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown of this connection: one with an answer in progress closes
        after it (as uvicorn's); an idle one lingers for a request already sent (module docstring)."""
        self._shutting = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
        elif not self._begun:  # a head already arriving keeps its header timer, then is answered
            self._arm(SHUTDOWN_LINGER_S, self.transport.close)

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """DISCONNECT_HOOK: run `callback` when this connection is lost (soon, if it already is)."""
        if self._lost:
            self.loop.call_soon(callback)
            return nothing_to_stop
        self._on_lost.add(callback)
        return functools.partial(self._on_lost.discard, callback)

    def data_received(self, data: bytes) -> None:
        if self._over_capacity:
            self.transport.close()  # what the client sent is read; its 503 is already written
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            self._read_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()  # no WebSocket routes: answered as a plain request
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._answer_and_close(self._refusal)
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head:
            if self._read_bytes > self.limits.max_header_bytes:
                self._answer_and_close(self._head_too_large())
            elif self._begun and self._timer is None:
                self._arm(self.limits.header_timeout_s, self._head_timed_out)
        elif self._in_body and self._timer is None:
            self._arm(self.limits.body_timeout_s, self._body_timed_out)

    # -- parser callbacks --------------------------------------------------------------------
    # The three callbacks before a head is complete do uvicorn's work (0.54) themselves rather
    # than call it: they run for every request and header, and a call each way was ~1 us a request.
    def on_message_begin(self) -> None:
        self._begun = True
        if self._shutting:
            self._disarm()  # a request came while lingering: it gets the header timer instead
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._head_too_large())
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + _HEADER_OVERHEAD
        if self._head_bytes > self.limits.max_header_bytes:
            self._refuse(self._head_too_large())
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_complete()
        super().on_headers_complete()  # the app's task starts on the loop's next turn, after this
        if self._shutting:
            self.cycle.keep_alive = False  # answered, then closed
        extensions = cast(dict[str, Any], self.scope.setdefault("extensions", {}))  # ASGI types it narrowly
        extensions[DISCONNECT_HOOK] = self.on_disconnect

    def on_body(self, body: bytes) -> None:
        self._body_arrived(body)
        super().on_body(body)

    def on_response_complete(self) -> None:
        """uvicorn's, but the keep-alive timer is the connection's (module docstring)."""
        if self._holding:
            assert self.held is not None
            self.held.release(self._holding.popleft())
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request starts
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        # uvicorn's hook, called before every read: the connection is no longer idle.
        self._idle_since = None

    def _keep_alive_due(self) -> None:
        """Close the connection if it has been idle for `timeout_keep_alive`; else wait out the
        rest of that time, or, while a request is in progress, leave it to its answer to re-arm."""
        self._keep_alive_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self._keep_alive_timer = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def on_message_complete(self) -> None:
        self._message_complete()
        super().on_message_complete()

    # The limits' part of the last three callbacks, for a subclass that answers a request without
    # uvicorn's part (`frontend.protocols.prediction_path`).
    def _head_complete(self) -> None:
        """The head is in: the connection is proven, the body's bytes are held, the timers reset."""
        self.unproven.pop(self, None)
        if self.held is not None:
            self._hold_body()
        self._in_head, self._in_body = False, True
        self._read_bytes = self._head_bytes = 0
        self._disarm()

    def _body_arrived(self, body: bytes) -> None:
        # Counted as uvicorn keeps it: not once the answer is complete (the rest is dropped).
        if self.held is not None and self._holding and not self.cycle.response_complete:
            if not self.held.take(len(body)):
                self._refuse(self._over_budget(len(body)))
            self._holding[-1] += len(body)

    def _message_complete(self) -> None:
        self._in_head, self._in_body, self._begun = True, False, False
        self._disarm()

    # -- limits ------------------------------------------------------------------------------
    def _hold_body(self) -> None:
        """Refuse this request unread when its Content-Length cannot fit the frontend's budget;
        else start counting its body (`on_body`)."""
        assert self.held is not None
        length = first_header(self.headers, b"content-length") or b""
        # A body larger than the whole budget is larger than any the server takes: the app
        # answers it 413, unread, whatever the load. Without a Content-Length, nothing to check.
        size = int(length) if length.isdigit() else None
        if size is not None and size <= self.held.limits.limit and not self.held.fits(size):
            self.held.refused += 1
            self._refuse(self._over_budget(size))
        self._holding.append(0)

    def _over_budget(self, size: int) -> bytes:
        assert self.held is not None
        return raw_response(
            503,
            "Service Unavailable",
            "ServiceUnavailableException",
            self.held.refusal(size).message,
            f"retry-after: {RETRY_AFTER_SECONDS}\r\n".encode(),
        )

    def _head_too_large(self) -> bytes:
        return raw_response(
            431,
            "Request Header Fields Too Large",
            "HEADERS_TOO_LARGE",
            f"request line and headers exceed {self.limits.max_header_bytes} bytes (http_max_header_bytes)",
        )

    def _refuse(self, answer: bytes) -> None:
        self._refusal = answer
        raise _Refuse

    def _arm(self, delay: float, handler: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, handler)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if not self._begun:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._answer_and_close(
            self._timeout_answer(f"request headers not received within {self.limits.header_timeout_s:g} s")
        )

    def _body_timed_out(self) -> None:
        self._timer = None
        self._answer_and_close(
            self._timeout_answer(f"request body not received within {self.limits.body_timeout_s:g} s")
        )

    def _timeout_answer(self, what: str) -> bytes:
        return raw_response(408, "Request Timeout", "REQUEST_TIMEOUT", f"{what} (http_*_timeout_s)")

    def _answer_and_close(self, answer: bytes) -> None:
        """Write `answer` unless a response has started on this connection, then close it.

        A request whose app is still running sees a disconnect (its later sends are dropped);
        a response already started or sent is left as it is and only the connection ends.
        """
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if not started and not self.transport.is_closing():
                self.transport.write(answer)
        elif not self.transport.is_closing() and (cycle is None or self._in_head):
            self.transport.write(answer)
        self.transport.close()


def nothing_to_stop() -> None:
    """What `on_disconnect` returns when there is nothing to stop watching."""


def limited_protocol(
    limits: HttpLimits,
    held: HeldBytes | None = None,
    base: type[LimitedHttpToolsProtocol] = LimitedHttpToolsProtocol,
) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for one listener: uvicorn instantiates it per connection; the cap
    counts that listener's connections (its ServerState); `held` is its process's budget of
    request bytes (the inference listener's; None elsewhere); `base` is the listener's own
    subclass, if it has one (a frontend's inference listener)."""
    return type(
        "LimitedHttpToolsProtocol",
        (base,),
        {"limits": limits, "held": held, "unproven": OrderedDict()},
    )
