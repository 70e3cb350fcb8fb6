"""Listener plumbing shared by every process that serves HTTP: the frontends and the supervisor.

Here live the embedded uvicorn server (the caller, not uvicorn, owns SIGTERM), the uvicorn
config built from the server's settings (TLS, access log, graceful-shutdown bound, and the
connection limits of common.http_limits, which every HTTP listener gets here), the
host:port split, the sockets we bind ourselves (so a port in use is an error that names the
address, where uvicorn would `sys.exit`), which listeners TLS covers (`tls_listeners`: all of
them with `--tls-cert-file`, or those a TorchServe config.properties makes `https://` /
`enable_grpc_ssl`), how each listener checks its callers (`listener_auth`), and the exposure
check every process runs before it listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn

from mariner.server.common.config import ServerConfig
from mariner.server.common.held_bytes import HeldBytes
from mariner.server.common.http_limits import HttpLimits, LimitedHttpToolsProtocol, limited_protocol
from mariner.server.common.security import (
    MARINER_REFUSAL,
    TORCHSERVE_REFUSAL,
    AnyCredential,
    Credential,
    GrpcTokenAuth,
    HttpTokenAuth,
    Refusal,
    Tokens,
    exposure_problems,
    grpc_credentials,
    http_ssl_context,
    is_loopback,
    load_tokens,
)
from mariner.server.contracts.errors import Code, ServingError

log = logging.getLogger("mariner")


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the process owns SIGTERM for an ordered drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drop idle TLS connections at once, serve the connections the kernel had already
        accepted, then uvicorn's own graceful shutdown.

        uvicorn closes an idle keep-alive connection politely; over TLS that sends close_notify
        and waits for the peer's, which a client that has simply stopped using the connection
        never sends. asyncio then waits its 30 s TLS shutdown timeout and uvicorn its whole grace
        period, although no request is in flight. An idle connection has nothing left to send,
        so aborting it loses nothing; connections with a response in progress are left alone.

        Closing a listening socket resets every connection still in its accept queue: the
        client's connect had succeeded and its request was sent, so it saw a reset instead of
        an answer (clients reconnecting through a SIGTERM saw one in a few hundred calls). So
        the queue is emptied first, in the same step as the close, and those connections are
        served like the others: their request is answered (503 while draining) and they close.
        """
        if self.config.is_ssl:
            for connection in list(self.server_state.connections):
                cycle = getattr(connection, "cycle", None)
                if cycle is None or cycle.response_complete:
                    connection.transport.abort()
        queued = [conn for server in self.servers for conn in _accept_queued(server, self.config.backlog)]
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        for conn in queued:
            try:
                await loop.connect_accepted_socket(self._protocol, conn, ssl=self.config.ssl)
            except OSError as exc:  # the client left meanwhile
                log.debug("a queued connection ended before it was served: %s", exc)
                conn.close()
        await super().shutdown(sockets)

    def _protocol(self) -> asyncio.Protocol:
        """A connection's protocol, as uvicorn's `startup` makes it."""
        protocol: asyncio.Protocol = self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        return protocol


def _accept_queued(server: asyncio.AbstractServer, most: int) -> list[socket.socket]:
    """The connections waiting in `server`'s accept queues (at most `most` per socket), accepted
    without blocking; the listening sockets stay open (EmbeddedUvicorn.shutdown)."""
    out: list[socket.socket] = []
    for listening in getattr(server, "sockets", None) or ():
        with socket.socket(fileno=os.dup(listening.fileno())) as dup:
            dup.setblocking(False)
            for _ in range(most):
                try:
                    conn, _addr = dup.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    log.debug("accepting a queued connection failed: %s", exc)
                    break
                conn.setblocking(False)
                out.append(conn)
    return out


def http_limits(cfg: ServerConfig) -> HttpLimits:
    """The connection limits every HTTP listener enforces (ValueError names a bad setting)."""
    return HttpLimits(
        max_header_bytes=cfg.http_max_header_bytes,
        header_timeout_s=cfg.http_header_timeout_s,
        body_timeout_s=cfg.http_body_timeout_s,
        keep_alive_s=cfg.http_keep_alive_s,
        max_connections=cfg.http_max_connections,
    )


# The listeners, by the names `tls_listeners` takes.
LISTENER_NAMES = ("inference", "management", "metrics", "grpc_inference", "grpc_management")


def tls_listeners(cfg: ServerConfig) -> frozenset[str]:
    """The listeners served over TLS: none without a certificate, else those `cfg.tls_listeners`
    names (a TorchServe file's https:// addresses and enable_grpc_ssl), else every one. ValueError
    for a name that is no listener, or names without a certificate."""
    if cfg.tls_listeners is None:
        return frozenset(LISTENER_NAMES) if cfg.tls_cert_file is not None else frozenset()
    names = frozenset(n.strip() for n in cfg.tls_listeners.split(",") if n.strip())
    unknown = sorted(names - set(LISTENER_NAMES))
    if unknown:
        raise ValueError(
            f"tls_listeners: {', '.join(unknown)} is no listener; use {', '.join(LISTENER_NAMES)}"
        )
    if names and cfg.tls_cert_file is None:
        raise ValueError(
            "tls_listeners names listeners to encrypt, but no --tls-cert-file / --tls-key-file is set"
        )
    return names


def grpc_tls(cfg: ServerConfig, listener: str) -> grpc.ServerCredentials | None:
    """The gRPC listener's TLS credentials, or None when it is plain."""
    if listener not in tls_listeners(cfg):
        return None
    assert cfg.tls_cert_file is not None, "tls_listeners is empty without a certificate"
    assert cfg.tls_key_file is not None, "check_exposure insists on both"
    return grpc_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)


def uvicorn_config(
    app: Callable[..., Any],
    host: str,
    port: int,
    cfg: ServerConfig,
    *,
    listener: str | None = None,
    held: HeldBytes | None = None,
    protocol: type[LimitedHttpToolsProtocol] = LimitedHttpToolsProtocol,
) -> uvicorn.Config:
    """uvicorn settings for one of our HTTP listeners: the loop is ours, TLS (our context: AEAD
    suites only; on `listener` when `tls_listeners` covers it, on any when no listener is named)
    and the access log follow the config, a graceful shutdown never outlasts the
    drain's grace period, and the connection limits are enforced by our protocol class (a fresh
    one per listener) before uvicorn hands a request to auth or routing, with `held` (a frontend's
    budget of request bytes, common.held_bytes) counting request bodies; `protocol` is the
    listener's subclass of that class, if it has one. No WebSocket upgrade: no route needs one,
    and an upgraded connection would leave the limits behind."""
    tls: Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext] | None = None
    encrypted = cfg.tls_cert_file is not None and (listener is None or listener in tls_listeners(cfg))
    if encrypted:
        assert cfg.tls_cert_file is not None
        assert cfg.tls_key_file is not None, "check_exposure insists on both"
        context = http_ssl_context(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)

        def tls(_config: uvicorn.Config, _default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
            return context

    limits = http_limits(cfg)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        lifespan="off",
        http=limited_protocol(limits, held, protocol),
        ws="none",
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # call_later takes a float
        access_log=cfg.access_log,
        log_level="warning",
        timeout_graceful_shutdown=int(cfg.grace_seconds) + 1,
        ssl_context_factory=tls,
    )


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); an empty host is loopback."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen_on(address: str, backlog: int = 512) -> socket.socket:
    """A listening socket on `address` (port 0 picks a free one); a port in use is an OSError
    that names the address."""
    host, port = split_address(address)
    try:
        return socket.create_server((host, port), family=_family(host), backlog=backlog)
    except OSError as exc:
        raise OSError(f"cannot listen on {address!r}: {exc.strerror or exc}") from exc


def reuseport_socket(host: str, port: int, *, reuse_addr: bool = False) -> socket.socket:
    """A bound, not yet listening, SO_REUSEPORT TCP socket on (host, port).

    Only sockets of the same user that set SO_REUSEPORT may share the port, so a server that
    does not (say a stock TorchServe) is refused with EADDRINUSE. `reuse_addr` lets a listener
    rebind past connections in TIME_WAIT; a socket that only holds the port leaves it off, so
    that a foreign server setting SO_REUSEADDR cannot bind beside it.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def reuseport_listener(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on (host, port) that the other frontends share."""
    sock = reuseport_socket(host, port, reuse_addr=True)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


@dataclass(frozen=True)
class ListenerAuth:
    """How one listener checks its callers: what it accepts and how it refuses."""

    credential: Credential
    refusal: Refusal

    def http(self, app: Any, *, open_paths: frozenset[str] = frozenset()) -> Any:
        """`app` behind the check (nothing in front of it when nothing is required)."""
        if not self.credential:
            return app
        return HttpTokenAuth(app, self.credential, open_paths=open_paths, refusal=self.refusal)

    def grpc(self, *, open_health: bool) -> list[grpc.aio.ServerInterceptor]:
        """The interceptors a gRPC listener needs for the check (none when nothing is required)."""
        if not self.credential:
            return []
        return [GrpcTokenAuth(self.credential, open_health=open_health, refusal=self.refusal)]


def listener_auth(tokens: Tokens, torchserve_key: Credential | None) -> ListenerAuth:
    """Mariner's own tokens and, when TorchServe's token authorization is on, its key for this
    listener: either is accepted, and a refusal is TorchServe's (its clients expect its answer)."""
    if torchserve_key is None:
        return ListenerAuth(tokens, MARINER_REFUSAL)
    return ListenerAuth(AnyCredential(tokens, torchserve_key), TORCHSERVE_REFUSAL)


def check_exposure(cfg: ServerConfig) -> tuple[Tokens, Tokens]:
    """Load the tokens; refuse to listen beyond loopback without them unless --insecure.

    TorchServe's keys count (they protect the inference and management listeners whenever its
    token authorization is on); open metrics and open health are the operator's choice."""
    if (cfg.tls_cert_file is None) != (cfg.tls_key_file is None):
        raise ServingError(Code.INVALID_ARGUMENT, "TLS needs both --tls-cert-file and --tls-key-file")
    try:
        encrypted = tls_listeners(cfg)
    except ValueError as exc:
        raise ServingError(Code.INVALID_ARGUMENT, str(exc)) from None
    inference = load_tokens(cfg.inference_token, cfg.inference_token_file)
    management = load_tokens(cfg.management_token, cfg.management_token_file)
    keys = not cfg.disable_token_auth  # TorchServe's inference and management keys
    # label -> (listener name, address, whether it requires a credential)
    listeners = {
        "HTTP inference": ("inference", cfg.inference_address, bool(inference) or keys),
        "gRPC inference": ("grpc_inference", cfg.grpc_inference_address, bool(inference) or keys),
        "HTTP management": ("management", cfg.management_address, bool(management) or keys),
        "gRPC management": ("grpc_management", cfg.grpc_management_address, bool(management) or keys),
    }
    if not cfg.open_metrics:
        # Closed metrics take the management credentials, else the inference ones (see the
        # servers); with neither they would answer anyone, which the operator did not ask for.
        listeners["HTTP metrics"] = ("metrics", cfg.metrics_address, bool(management or inference) or keys)
    for label, (name, address, guarded) in listeners.items():
        if encrypted and guarded and name not in encrypted and not is_loopback(split_address(address)[0]):
            # TLS on some listeners only, as TorchServe serves such a file: say what it costs.
            log.warning(
                "%s on %s is plain HTTP beyond loopback: its bearer tokens cross the network unencrypted",
                label,
                address,
            )
    protected = {label: (address, guarded) for label, (_, address, guarded) in listeners.items()}
    problems = exposure_problems(protected)
    # KServe's TorchServe runtime puts authentication in front of the pod (its ingress); its
    # config.properties turns TorchServe's keys off, and TorchServe's KServe image then serves
    # unauthenticated. That explicit choice counts only there, never for `mariner serve` alone.
    consent = cfg.insecure or (cfg.kserve_runtime and cfg.disable_token_auth)
    if problems and not consent:
        raise ServingError(
            Code.PERMISSION_DENIED,
            "refusing to listen beyond loopback without authentication ("
            + "; ".join(problems)
            + "): anyone who can reach these ports could run the models and manage them. Set "
            "MARINER_INFERENCE_TOKEN_FILE / MARINER_MANAGEMENT_TOKEN_FILE (or the *_TOKEN variables), "
            "or pass --insecure if something in front of Mariner authenticates callers",
        )
    if problems:
        why = "--insecure" if cfg.insecure else "a KServe runtime with TorchServe's token authorization off"
        log.warning("listening beyond loopback WITHOUT authentication (%s): %s", why, "; ".join(problems))
    return inference, management
