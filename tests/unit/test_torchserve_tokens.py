"""TorchServe's token authorization, in process: key_file.json's shape and mode, the keys' expiry
on an injected clock, the token API, and when it is on (TorchServe's precedence of
`--disable-token-auth`, `disable_token_authorization` and `TS_DISABLE_TOKEN_AUTHORIZATION`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mariner.server.common.config_loading import load_config
from mariner.server.common.security import (
    MARINER_REFUSAL,
    TORCHSERVE_REFUSAL,
    AnyCredential,
    HttpTokenAuth,
    Tokens,
)
from mariner.server.compat.torchserve.tokens import (
    KEY_FILE_NAME,
    Key,
    KeyCheck,
    KeyKind,
    TokenApi,
    TorchServeKeys,
    expiration_seconds,
    java_instant,
    key_file_text,
    start_keys,
)

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def counter_keys() -> Iterator[str]:
    return (f"key-{n:02d}-{'x' * 40}" for n in itertools.count())


def make_keys(tmp_path: Path, minutes: float = 60.0, clock: Clock | None = None) -> TorchServeKeys:
    values = counter_keys()
    return TorchServeKeys(
        tmp_path / KEY_FILE_NAME, minutes, clock=clock or Clock(), new_value=lambda: next(values)
    )


def bearer(value: str) -> str:
    return f"Bearer {value}"


def file_keys(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# -- key_file.json ------------------------------------------------------------------------------
def test_the_key_file_has_torchserves_shape_byte_for_byte() -> None:
    text = key_file_text(Key("mgmt", T0 + 3600), Key("inf", T0 + 3600.25), Key("api"))
    assert text == (
        "{\n"
        '  "management": {\n'
        '    "key": "mgmt",\n'
        '    "expiration time": "2023-11-14T23:13:20Z"\n'
        "  },\n"
        '  "inference": {\n'
        '    "key": "inf",\n'
        '    "expiration time": "2023-11-14T23:13:20.250Z"\n'
        "  },\n"
        '  "API": {\n'
        '    "key": "api"\n'
        "  }\n"
        "}"
    ), "Gson's pretty printing, keys in TorchServe's order, no newline at the end"


@pytest.mark.parametrize(
    ("t", "written"),
    [
        (T0, "2023-11-14T22:13:20Z"),
        (T0 + 0.5, "2023-11-14T22:13:20.500Z"),
        (T0 + 0.000123, "2023-11-14T22:13:20.000123Z"),
    ],
)
def test_expiration_times_are_written_as_java_instants(t: float, written: str) -> None:
    assert java_instant(t) == written


def test_start_writes_all_three_keys_readable_by_the_owner_only(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    old_umask = os.umask(0)  # a permissive umask must not widen the file
    try:
        keys.start()
    finally:
        os.umask(old_umask)
    path = tmp_path / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    written = file_keys(path)
    assert set(written) == {"management", "inference", "API"}
    assert written["management"]["key"] == keys.current(KeyKind.MANAGEMENT).value
    assert written["inference"]["key"] == keys.current(KeyKind.INFERENCE).value
    assert written["management"]["expiration time"] == java_instant(T0 + 3600)
    assert written["API"] == {"key": keys.api.key.value if keys.api.key else None}
    assert len({written["management"]["key"], written["inference"]["key"], written["API"]["key"]}) == 3
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE_NAME], "no temporary file is left behind"


def test_real_keys_are_long_random_and_url_safe(tmp_path: Path) -> None:
    keys = TorchServeKeys(tmp_path / KEY_FILE_NAME, 60.0)
    keys.start()
    values = [k["key"] for k in file_keys(tmp_path / KEY_FILE_NAME).values()]
    assert len(set(values)) == 3
    for value in values:
        assert len(value) >= 43, "32 bytes of the CSPRNG, not TorchServe's 6"
        assert set(value) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_a_symlink_in_the_keys_place_is_replaced_never_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not yours")
    (tmp_path / KEY_FILE_NAME).symlink_to(elsewhere)
    make_keys(tmp_path).start()
    assert not (tmp_path / KEY_FILE_NAME).is_symlink()
    assert elsewhere.read_text() == "not yours"


def test_the_file_is_rewritten_whole_on_every_regeneration(tmp_path: Path) -> None:
    clock = Clock()
    keys = make_keys(tmp_path, clock=clock)
    keys.start()
    before = file_keys(tmp_path / KEY_FILE_NAME)
    clock.now += 100
    fresh = keys.regenerate(KeyKind.INFERENCE)
    after = file_keys(tmp_path / KEY_FILE_NAME)
    assert after["inference"] == {"key": fresh.value, "expiration time": java_instant(T0 + 100 + 3600)}
    assert after["management"] == before["management"], "only the asked-for key changes"
    assert after["API"] == before["API"], "the API key never changes"
    assert stat.S_IMODE((tmp_path / KEY_FILE_NAME).stat().st_mode) == 0o600


def test_a_file_that_cannot_be_written_keeps_the_old_keys(tmp_path: Path) -> None:
    home = tmp_path / "cwd"
    home.mkdir()
    keys = make_keys(home)
    keys.start()
    old = keys.current(KeyKind.MANAGEMENT)
    shutil.rmtree(home)  # the directory is gone: the new file cannot be made
    with pytest.raises(FileNotFoundError):
        keys.regenerate(KeyKind.MANAGEMENT)
    assert keys.current(KeyKind.MANAGEMENT) == old
    assert keys.management.accepts(bearer(old.value)), "the key in force stays the one clients have"


def test_start_refuses_a_directory_it_cannot_write_saying_what_to_do(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / KEY_FILE_NAME
    with pytest.raises(OSError, match="cannot write TorchServe's key file") as info:
        start_keys(missing, 60.0)
    assert str(missing) in str(info.value)
    assert "--disable-token-auth" in str(info.value)


def test_remove_file_removes_only_the_file_written_here(tmp_path: Path) -> None:
    keys = make_keys(tmp_path)
    keys.start()
    keys.remove_file()
    assert not (tmp_path / KEY_FILE_NAME).exists()
    keys = make_keys(tmp_path)
    keys.start()
    (tmp_path / KEY_FILE_NAME).unlink()
    (tmp_path / KEY_FILE_NAME).write_text("another server's keys")
    keys.remove_file()
    assert (tmp_path / KEY_FILE_NAME).read_text() == "another server's keys"


# -- expiry, on the injected clock --------------------------------------------------------------
@pytest.mark.parametrize(
    ("minutes", "seconds"), [(60, 3600), (0.25, 15), (0.01, 0), (-0.5, -30), (1e30, 3153600000)]
)
def test_lifetimes_are_whole_seconds_truncated_as_java_casts_them(minutes: float, seconds: int) -> None:
    assert expiration_seconds(minutes) == seconds


def test_keys_expire_at_their_expiration_time_and_the_api_key_never(tmp_path: Path) -> None:
    clock = Clock()
    keys = make_keys(tmp_path, minutes=0.25, clock=clock)
    keys.start()
    management = keys.current(KeyKind.MANAGEMENT).value
    api = file_keys(tmp_path / KEY_FILE_NAME)["API"]["key"]
    clock.now = T0 + 14.999
    assert keys.management.accepts(bearer(management))
    clock.now = T0 + 15  # TorchServe: expired once now is not before the expiration time
    assert not keys.management.accepts(bearer(management))
    clock.now = T0 + 10**9
    assert keys.api.accepts(bearer(api))
    fresh = keys.regenerate(KeyKind.MANAGEMENT)
    assert keys.management.accepts(bearer(fresh.value)), "a new key gets a new lifetime"
    clock.now += 15
    assert not keys.management.accepts(bearer(fresh.value))


def test_a_zero_lifetime_means_keys_expire_as_soon_as_they_are_made(tmp_path: Path) -> None:
    keys = make_keys(tmp_path, minutes=0)
    keys.start()
    assert not keys.inference.accepts(bearer(keys.current(KeyKind.INFERENCE).value))


MANAGEMENT = "key-00-" + "x" * 40  # counter_keys' first value: start() makes the management key first


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        f"Basic {MANAGEMENT}",
        f"Bearer {MANAGEMENT[:-1]}",
        f"Bearer {MANAGEMENT}x",
        f"Bearer x{MANAGEMENT}",
        MANAGEMENT,
        "Bearer key-01-" + "x" * 40,  # the inference key
        "Bearer key-02-" + "x" * 40,  # the API key
    ],
)
def test_anything_but_the_exact_key_is_refused(tmp_path: Path, authorization: str | None) -> None:
    keys = make_keys(tmp_path)
    keys.start()
    assert keys.current(KeyKind.MANAGEMENT).value == MANAGEMENT
    assert keys.management.accepts(f"Bearer {MANAGEMENT}")
    assert keys.management.accepts(f"bearer  {MANAGEMENT} "), (
        "the scheme's case and spaces around are not the key"
    )
    assert not keys.management.accepts(authorization)


def test_a_key_check_without_a_key_yet_refuses_everything() -> None:
    check = KeyCheck()
    assert check, "a listener given a key check is protected before its first key"
    assert not check.accepts("Bearer anything")
    check.set(Key("k" * 43, T0 + 60))
    assert not check.accepts("Bearer anything")


# -- Mariner's tokens and TorchServe's keys together --------------------------------------------
def test_either_mariners_token_or_torchserves_key_is_accepted() -> None:
    key = KeyCheck(Key("ts-key-" + "k" * 36, None))
    both = AnyCredential(Tokens(("mariner-token",)), key)
    assert both.accepts("Bearer mariner-token")
    assert both.accepts("Bearer ts-key-" + "k" * 36)
    assert not both.accepts("Bearer other")
    assert not both.accepts(None)
    assert AnyCredential(Tokens(), key), "TorchServe's key alone protects"
    assert not AnyCredential(Tokens()), "no credential at all: open"
    assert AnyCredential(Tokens()).accepts(None)


# -- the wire answers (ASGI, in process) ---------------------------------------------------------
async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"app"})


def _call(
    app: Any, path: str, authorization: str | None = None, query: str = ""
) -> tuple[int, dict[bytes, bytes], bytes]:
    headers = [(b"authorization", authorization.encode())] if authorization is not None else []
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "query_string": query.encode(),
        "headers": headers,
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


def test_torchserves_refusal_is_its_400_invalid_key_exception() -> None:
    app = HttpTokenAuth(_ok_app, Tokens(("t",)), refusal=TORCHSERVE_REFUSAL)
    status, headers, body = _call(app, "/predictions/m", "Bearer wrong")
    assert status == 400
    assert json.loads(body) == {
        "code": 400,
        "type": "InvalidKeyException",
        "message": "Token Authorization failed. Token either incorrect, expired, or not provided correctly",
    }
    assert b"www-authenticate" not in headers
    assert headers[b"connection"] == b"close"
    status, headers, _ = _call(HttpTokenAuth(_ok_app, Tokens(("t",)), refusal=MARINER_REFUSAL), "/x")
    assert (status, headers[b"www-authenticate"]) == (401, b"Bearer")


def _token_api(tmp_path: Path) -> tuple[TokenApi, TorchServeKeys, list[Key]]:
    keys = make_keys(tmp_path)
    keys.start()
    published: list[Key] = []

    async def on_inference(key: Key) -> None:
        published.append(key)

    return TokenApi(_ok_app, keys, on_inference), keys, published


def test_the_token_api_replaces_a_key_with_the_api_key_and_answers_as_torchserve(tmp_path: Path) -> None:
    api, keys, published = _token_api(tmp_path)
    api_key = file_keys(tmp_path / KEY_FILE_NAME)["API"]["key"]
    old_inference = keys.current(KeyKind.INFERENCE)
    status, headers, body = _call(api, "/token", bearer(api_key), "type=inference")
    assert (status, headers[b"content-type"], body) == (200, b"application/json", b"\n")
    assert published == [keys.current(KeyKind.INFERENCE)] != [old_inference], "frontends get the new key"
    assert file_keys(tmp_path / KEY_FILE_NAME)["inference"]["key"] == published[0].value
    old_management = keys.current(KeyKind.MANAGEMENT)
    assert _call(api, "/token", bearer(api_key), "type=management")[0] == 200
    assert keys.current(KeyKind.MANAGEMENT) != old_management
    assert len(published) == 1, "a management key stays in the supervisor"


@pytest.mark.parametrize(
    ("authorization", "query"),
    [
        (None, "type=inference"),
        ("Bearer wrong", "type=inference"),
        ("management key", "type=inference"),
        ("api key", "type=API"),
        ("api key", "type=Inference"),
        ("api key", ""),
    ],
)
def test_the_token_api_refuses_a_wrong_key_or_type_with_torchserves_answer(
    tmp_path: Path, authorization: str | None, query: str
) -> None:
    api, keys, published = _token_api(tmp_path)
    written = file_keys(tmp_path / KEY_FILE_NAME)
    real = {"management key": written["management"]["key"], "api key": written["API"]["key"]}
    if authorization in real:
        authorization = bearer(real[authorization])
    status, _, body = _call(api, "/token", authorization, query)
    assert status == 400
    assert json.loads(body) == {
        "code": 400,
        "type": "InvalidKeyException",
        "message": "Token Authentication failed. Token either incorrect, expired, or not provided correctly",
    }
    assert file_keys(tmp_path / KEY_FILE_NAME) == written
    assert published == []


def test_the_token_api_is_the_path_token_and_nothing_else(tmp_path: Path) -> None:
    api, _, _ = _token_api(tmp_path)
    for path in ("/models/tokenizer", "/token/", "/tokens"):
        assert _call(api, path)[2] == b"app", path


# -- when it is on: TorchServe's precedence -----------------------------------------------------
ENVVARS = "enable_envvars_config=true\n"


@pytest.mark.parametrize(
    ("properties", "env", "argv", "disabled"),
    [
        ("", {}, [], False),  # TorchServe's default: on
        ("", {}, ["--disable-token-auth"], True),
        ("", {}, ["--dt"], True),
        ("disable_token_authorization=true\n", {}, [], True),
        ("disable_token_authorization=TRUE\n", {}, [], True),  # Java's Boolean.parseBoolean
        ("disable_token_authorization=yes\n", {}, [], False),  # ... is true for "true" alone
        ("disable_token_authorization=false\n", {}, ["--disable-token-auth"], True),  # flag over file
        # TS_* variables (only with enable_envvars_config in the file) over the flag and the file:
        (
            ENVVARS + "disable_token_authorization=false\n",
            {"TS_DISABLE_TOKEN_AUTHORIZATION": "true"},
            [],
            True,
        ),
        (ENVVARS, {"TS_DISABLE_TOKEN_AUTHORIZATION": "false"}, ["--disable-token-auth"], False),
        ("", {"TS_DISABLE_TOKEN_AUTHORIZATION": "true"}, [], False),  # ignored without the switch
        ("", {"MARINER_DISABLE_TOKEN_AUTH": "true"}, [], True),
        ("disable_token_authorization=true\n", {}, ["--no-disable-token-auth"], False),
    ],
)
def test_token_authorization_is_on_exactly_when_torchserve_would_have_it_on(
    tmp_path: Path, properties: str, env: dict[str, str], argv: list[str], disabled: bool
) -> None:
    props = tmp_path / "config.properties"
    props.write_text(properties)
    cfg = load_config(["--ts-config", str(props), *argv], env=env, cwd=tmp_path)
    assert cfg.disable_token_auth is disabled


@pytest.mark.parametrize(
    ("properties", "env", "minutes"),
    [
        ("", {}, 60.0),
        ("token_expiration_min=0.25\n", {}, 0.25),
        (ENVVARS + "token_expiration_min=5\n", {"TS_TOKEN_EXPIRATION_TIME_MIN": "2.5"}, 2.5),
        ("token_expiration_min=5\n", {"TS_TOKEN_EXPIRATION_TIME_MIN": "2.5"}, 5.0),
    ],
)
def test_token_expiration_comes_from_torchserves_key_and_variable(
    tmp_path: Path, properties: str, env: dict[str, str], minutes: float
) -> None:
    props = tmp_path / "config.properties"
    props.write_text(properties)
    assert load_config(["--ts-config", str(props)], env=env, cwd=tmp_path).token_expiration_min == minutes


@pytest.mark.parametrize("value", ["soon", "NaN", "inf", ""])
def test_an_expiration_that_is_not_a_number_is_torchserves_default_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    props = tmp_path / "config.properties"
    props.write_text(f"token_expiration_min={value}\n")
    with caplog.at_level(logging.WARNING, logger="mariner.config"):
        cfg = load_config(["--ts-config", str(props)], env={}, cwd=tmp_path)
    assert cfg.token_expiration_min == 60.0
    (warning,) = [r for r in caplog.records if "token_expiration_min" in r.getMessage()]
    assert f"token_expiration_min={value} is not a number" in warning.getMessage()
    assert "60 minutes" in warning.getMessage()
