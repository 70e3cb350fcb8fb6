"""TorchServe 0.12's token authorization: key_file.json, its three keys, and the token API.

TorchServe protects its APIs by default: at start it writes `key_file.json` in its working
directory with an inference key (the inference API), a management key (the management API)
and an API key (the token API, `/token?type=management|inference` on the management port,
which replaces one of the other two), and refuses a call whose `Authorization: Bearer <key>` is
missing, wrong or expired (400 InvalidKeyException; gRPC PERMISSION_DENIED). The inference and
management keys expire `token_expiration_min` minutes (default 60) after they were made; the
API key never does. Clients read the keys from the file, so Mariner writes the same file, with
the same JSON keys, whenever TorchServe would (ServerConfig.disable_token_auth, decided from
`--disable-token-auth`, `disable_token_authorization` and `TS_DISABLE_TOKEN_AUTHORIZATION` in
TorchServe's order by config.load_config).

Deliberate differences, none of which a client of the file or the API can trip on:
- a key is 32 bytes from the OS's CSPRNG (`secrets`), 43 URL-safe characters; TorchServe's are
  6 bytes (8 characters), few enough to guess at network speed over days;
- keys are compared in constant time;
- the file is written whole or not at all (a private temporary file, mode 0600 from its
  creation, renamed over the old one): a reader never sees half a file nor a moment of wider
  permissions;
- the server removes the file when it stops, if it is still the one it wrote (TorchServe's
  launcher removes it on `torchserve --stop`, whoever wrote it);
- the token API is the path `/token` (TorchServe takes any management request whose text
  contains "/token", a model named `tokenizer` included).

The supervisor holds the keys (`TorchServeKeys`) and serves the token API; each frontend gets the
inference key, and only that one, with every model table over its control channel, and checks it
itself (`KeyCheck`). No key is ever logged or put in a child's environment.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from mariner.server.common.security import TORCHSERVE_REFUSAL, authorization_header, bearer_token, error_body

log = logging.getLogger("mariner")

KEY_FILE_NAME = "key_file.json"
KEY_BYTES = 32
TOKEN_API_PATH = "/token"
# The token API's own refusal (TorchServe says "Authentication" here, "Authorization" elsewhere).
TOKEN_API_REFUSED_MESSAGE = (
    "Token Authentication failed. Token either incorrect, expired, or not provided correctly"
)
# Lifetimes are capped at a century either way: TorchServe overflows past that, a datetime formats it.
_MAX_SECONDS = 100 * 365 * 24 * 3600

Clock = Callable[[], float]


class KeyKind(enum.Enum):
    """The keys the token API replaces (its `type` parameter)."""

    MANAGEMENT = "management"
    INFERENCE = "inference"


@dataclass(frozen=True)
class Key:
    """One key and when it stops being accepted (wall-clock seconds; None: never)."""

    value: str = field(repr=False)
    expires_at: float | None = None

    def accepts(self, presented: bytes | None, now: float) -> bool:
        """The exact key, before its expiry (TorchServe's `!now.isBefore(expiration)`: at the
        expiry instant it is already refused)."""
        if presented is None:
            return False
        matches = hmac.compare_digest(presented, self.value.encode())
        return matches and (self.expires_at is None or now < self.expires_at)


def new_key_value() -> str:
    """A fresh key from the OS's CSPRNG."""
    return secrets.token_urlsafe(KEY_BYTES)


def expiration_seconds(minutes: float) -> int:
    """TorchServe's `(long) (minutes * 60)`: whole seconds, truncated toward zero."""
    return int(max(-_MAX_SECONDS, min(_MAX_SECONDS, minutes * 60)))


class KeyCheck:
    """The current key of one kind, as a listener's credential (see security.Credential).

    Always protecting: before its first key arrives (a frontend waiting for its model table) it
    accepts nothing. `set` swaps the key at once for every later call."""

    def __init__(self, key: Key | None = None, *, clock: Clock = time.time) -> None:
        self._key = key
        self._clock = clock

    @property
    def key(self) -> Key | None:
        return self._key

    def set(self, key: Key) -> None:
        self._key = key

    def __bool__(self) -> bool:
        return True

    def accepts(self, authorization: str | None) -> bool:
        key = self._key
        return key is not None and key.accepts(bearer_token(authorization), self._clock())


def java_instant(t: float) -> str:
    """`t` as Java's `Instant.toString()` writes it (UTC, the fraction in groups of three digits,
    none when whole), the form of TorchServe's "expiration time"."""
    moment = datetime.fromtimestamp(t, UTC)
    micro = moment.microsecond
    fraction = "" if micro == 0 else f".{micro // 1000:03d}" if micro % 1000 == 0 else f".{micro:06d}"
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


def key_file_text(management: Key, inference: Key, api: Key) -> str:
    """key_file.json as TorchServe writes it (Gson's pretty printing, no final newline)."""

    def expiring(key: Key) -> dict[str, str]:
        assert key.expires_at is not None, "inference and management keys expire"
        return {"key": key.value, "expiration time": java_instant(key.expires_at)}

    document = {
        "management": expiring(management),
        "inference": expiring(inference),
        "API": {"key": api.value},
    }
    return json.dumps(document, indent=2)


def write_private_file(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by our user only, in one step.

    The content goes to a new file created with mode 0600 (O_EXCL, never through a symlink) beside
    `path` and is renamed over it: readers see the old file or the new one, never a part, and
    `path` itself being a symlink only replaces the link."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o600)  # whatever the umask took away or left
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class TorchServeKeys:
    """The supervisor's three keys and the file that publishes them.

    `start` makes all three and writes the file (an OSError: the server must not start without
    it, as TorchServe does not); `regenerate` replaces one key and rewrites the file, the old key
    staying in force if the file cannot be written; `remove_file` deletes the file if it is still
    the one written here."""

    def __init__(
        self,
        path: Path,
        expiration_min: float,
        *,
        clock: Clock = time.time,
        new_value: Callable[[], str] = new_key_value,
    ) -> None:
        self.path = path
        self._lifetime_s = expiration_seconds(expiration_min)
        self._clock = clock
        self._new_value = new_value
        self.api = KeyCheck(clock=clock)
        self.management = KeyCheck(clock=clock)
        self.inference = KeyCheck(clock=clock)
        self._written: str | None = None  # the file's text as last written here

    def _fresh(self) -> Key:
        return Key(self._new_value(), self._clock() + self._lifetime_s)

    def _publish(self, management: Key, inference: Key, api: Key) -> None:
        text = key_file_text(management, inference, api)
        write_private_file(self.path, text)
        self._written = text
        self.management.set(management)
        self.inference.set(inference)
        self.api.set(api)

    def start(self) -> None:
        self._publish(self._fresh(), self._fresh(), Key(self._new_value()))
        log.info(
            "TorchServe token authorization is on: keys in %s (inference, management and API keys; "
            "--disable-token-auth turns it off)", self.path,
        )  # fmt: skip

    def current(self, kind: KeyKind) -> Key:
        key = (self.management if kind is KeyKind.MANAGEMENT else self.inference).key
        assert key is not None, "start() made every key"
        return key

    def regenerate(self, kind: KeyKind) -> Key:
        """A new key of `kind` with a new expiry, written to the file; returns it."""
        api = self.api.key
        assert api is not None, "start() made every key"
        fresh = self._fresh()
        management = fresh if kind is KeyKind.MANAGEMENT else self.current(KeyKind.MANAGEMENT)
        inference = fresh if kind is KeyKind.INFERENCE else self.current(KeyKind.INFERENCE)
        self._publish(management, inference, api)
        log.info("TorchServe token API: a new %s key is in %s", kind.value, self.path)
        return fresh

    def remove_file(self) -> None:
        if self._written is None:
            return
        # Ours if it still holds our keys (random: no other writer's file does). An inode number
        # proves nothing here: a file made after ours was removed may get the same one.
        with contextlib.suppress(OSError):  # gone already, or not ours to read
            if self.path.is_file() and not self.path.is_symlink() and self.path.read_text() == self._written:
                os.unlink(self.path)
        self._written = None


def start_keys(path: Path, expiration_min: float) -> TorchServeKeys:
    """The keys, made and published at `path`, or OSError naming the file and what to do."""
    keys = TorchServeKeys(path, expiration_min)
    try:
        keys.start()
    except OSError as exc:
        raise OSError(
            f"cannot write TorchServe's key file {path}: {exc.strerror or exc}. Start the server in a "
            "directory it can write, or turn TorchServe's token authorization off with --disable-token-auth "
            "(disable_token_authorization=true) and protect the APIs with --inference-token-file / "
            "--management-token-file"
        ) from exc
    return keys


# -- the token API (an ASGI layer in front of the management listener) --------------------------
def _answer(status: int, body: bytes, *, close: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


_REFUSED = error_body(TORCHSERVE_REFUSAL.http_status, "InvalidKeyException", TOKEN_API_REFUSED_MESSAGE)


class TokenApi:
    """TorchServe's token API on the management listener, in front of `app` (its auth included).

    `/token?type=management|inference` (any method, as TorchServe) with the API key makes a new
    key of that type, rewrites key_file.json and answers 200 with TorchServe's body (an empty JSON
    text: the key is in the file); `on_inference` is awaited with a new inference key before the
    answer, so the frontends no longer accept the old one once the client has it. A wrong key or
    type is TorchServe's 400 InvalidKeyException; the request body is never read."""

    def __init__(
        self, app: Any, keys: TorchServeKeys, on_inference: Callable[[Key], Awaitable[None]]
    ) -> None:
        self.app = app
        self.keys = keys
        self.on_inference = on_inference

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != TOKEN_API_PATH:
            await self.app(scope, receive, send)
            return
        wanted = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("type", [""])[0]
        kinds = {k.value: k for k in KeyKind}
        if not self.keys.api.accepts(authorization_header(scope)) or wanted not in kinds:
            start, body = _answer(TORCHSERVE_REFUSAL.http_status, _REFUSED, close=True)
        else:
            try:
                fresh = self.keys.regenerate(kinds[wanted])
            except OSError as exc:
                # TorchServe answers a failed rewrite as a refused key; the reason is for the log.
                log.error("TorchServe token API: cannot rewrite %s: %s", self.keys.path, exc.strerror or exc)
                start, body = _answer(TORCHSERVE_REFUSAL.http_status, _REFUSED, close=True)
            else:
                if kinds[wanted] is KeyKind.INFERENCE:
                    await self.on_inference(fresh)
                start, body = _answer(200, b"\n", close=False)
        await send(start)
        await send(body)
