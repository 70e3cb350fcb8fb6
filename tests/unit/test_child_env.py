"""A child's environment holds no secret: neither the token variables nor any variable whose
value carries a token the supervisor loaded (a config.properties `$$VAR$$` may name any)."""

from __future__ import annotations

import os

import pytest

from mariner.server.common import child_env


def test_secret_names_and_values_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(child_env, "_secret_values", set())
    monkeypatch.setenv("MARINER_INFERENCE_TOKEN", "tok-inference-123,tok-second-456")
    monkeypatch.setenv("MARINER_MANAGEMENT_TOKEN", "x")  # dropped by its name, however short
    monkeypatch.setenv("MY_TS_SECRET", "tok-second-456")  # named by a $$MY_TS_SECRET$$
    monkeypatch.setenv("TS_KEYSTORE_PASS", "changeit")
    monkeypatch.setenv("PLAIN", "value with x in it")
    child_env.forget_secrets(["tok-inference-123,tok-second-456", "x"])
    env = child_env.child_env()
    for name in ("MARINER_INFERENCE_TOKEN", "MARINER_MANAGEMENT_TOKEN", "MY_TS_SECRET", "TS_KEYSTORE_PASS"):
        assert name not in env
    assert env["PLAIN"] == "value with x in it"  # a short token matches no ordinary value
    assert "MARINER_INFERENCE_TOKEN" not in os.environ  # gone from ours too: children inherit it
    given = child_env.child_env({"A": "1", "B": "has tok-inference-123 inside"})
    assert given == {"A": "1"}
