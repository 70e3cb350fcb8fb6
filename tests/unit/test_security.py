"""Bearer tokens: exact matching, token files (comments, rotation), and the MARINER_*_TOKEN_FILE path.

A token check that accepts a prefix, a suffix or a neighbour's token is a hole nobody notices
while every honest client keeps working, so these tests present near-misses on purpose.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mariner.server.common.config_loading import load_config
from mariner.server.common.listeners import check_exposure
from mariner.server.common.security import Tokens, load_tokens
from mariner.server.contracts.errors import Code, ServingError

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token-A"


@pytest.mark.parametrize(
    "authorization",
    [
        f"Bearer {TOKEN}",
        f"bearer {TOKEN}",  # the scheme is case-insensitive (RFC 7235), the token is not
        f"BEARER {TOKEN}",
        f"Bearer {TOKEN}  ",  # surrounding whitespace is not part of the token
    ],
)
def test_the_exact_token_is_accepted(authorization: str) -> None:
    assert Tokens((TOKEN,)).accepts(authorization)


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        TOKEN,  # no scheme
        f"Basic {TOKEN}",
        f"Bearer{TOKEN}",
        f"Bearer {TOKEN}x",  # starts with the valid token
        f"Bearer {TOKEN}{TOKEN}",
        f"Bearer {TOKEN} extra",
        f"Bearer {TOKEN[:-1]}",  # a prefix of the valid token
        f"Bearer x{TOKEN}",  # ends with the valid token
        f"Bearer {TOKEN.upper()}",
        f"Bearer {TOKEN.lower()}",
        f"Bearer {TOKEN},other",
    ],
)
def test_anything_but_the_exact_token_is_refused(authorization: str | None) -> None:
    assert not Tokens((TOKEN,)).accepts(authorization)


def test_no_tokens_means_unprotected_and_some_tokens_mean_protected() -> None:
    assert not Tokens()
    assert Tokens().accepts(None)
    assert Tokens((TOKEN,))
    assert not Tokens((TOKEN,)).accepts(None)


def test_tokens_never_show_in_repr() -> None:
    assert TOKEN not in repr(Tokens((TOKEN,)))
    assert TOKEN not in repr(load_tokens(TOKEN, None))


def test_token_value_is_comma_separated_and_blank_entries_are_dropped() -> None:
    tokens = load_tokens(" a1 , ,b2,", None)
    assert tokens.values == ("a1", "b2")
    assert tokens.accepts("Bearer a1")
    assert tokens.accepts("Bearer b2")
    assert not tokens.accepts("Bearer ")
    assert not tokens.accepts("Bearer a1,b2")


def test_token_file_one_per_line_with_comments_and_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# inference tokens\n\n  first-token  \n# second-token\nthird-token\n")
    tokens = load_tokens(None, f)
    assert tokens.values == ("first-token", "third-token")
    assert not tokens.accepts("Bearer second-token"), "a commented-out token must be refused"
    assert not tokens.accepts("Bearer # second-token")
    assert not tokens.accepts("Bearer # inference tokens")


def test_value_and_file_together_accept_both(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text("from-file\n")
    tokens = load_tokens("from-value", f)
    assert tokens.values == ("from-value", "from-file")


def test_rotation_file_accepts_old_and_new_until_the_old_line_is_removed(tmp_path: Path) -> None:
    """Rotation: add the new token beside the old, move clients, then drop the old line."""
    f = tmp_path / "tokens"
    f.write_text("old-token\nnew-token\n")
    during = load_tokens(None, f)
    for token in ("old-token", "new-token"):
        assert during.accepts(f"Bearer {token}"), token
    assert not during.accepts("Bearer old-tokennew-token")
    assert not during.accepts("Bearer old-token\nnew-token")
    f.write_text("new-token\n")
    after = load_tokens(None, f)
    assert after.accepts("Bearer new-token")
    assert not after.accepts("Bearer old-token")


def test_token_files_from_the_environment_protect_each_api_with_its_own_tokens(tmp_path: Path) -> None:
    inference, management = tmp_path / "inference", tmp_path / "management"
    inference.write_text("# rotated\ninf-old\ninf-new\n")
    management.write_text("mgmt-1\n")
    cfg = load_config(
        [],
        env={
            "MARINER_INFERENCE_TOKEN_FILE": str(inference),
            "MARINER_MANAGEMENT_TOKEN_FILE": str(management),
            "MARINER_INFERENCE_ADDRESS": "0.0.0.0:8080",  # exposed: allowed only because of the tokens
        },
    )
    assert cfg.inference_token_file == inference
    assert cfg.management_token_file == management
    inf_tokens, mgmt_tokens = check_exposure(cfg)
    assert inf_tokens.values == ("inf-old", "inf-new")
    assert mgmt_tokens.values == ("mgmt-1",)
    assert not inf_tokens.accepts("Bearer mgmt-1"), "the management token must not open inference"
    assert not mgmt_tokens.accepts("Bearer inf-new"), "an inference token must not open management"
    assert not inf_tokens.accepts("Bearer inf-new2")


def test_flags_close_health_and_metrics() -> None:
    cfg = load_config(["--no-open-health", "--no-open-metrics"], env={})
    assert cfg.open_health is False
    assert cfg.open_metrics is False
    env_cfg = load_config([], env={"MARINER_OPEN_HEALTH": "false", "MARINER_OPEN_METRICS": "0"})
    assert (env_cfg.open_health, env_cfg.open_metrics) == (False, False)
    assert (load_config([], env={}).open_health, load_config([], env={}).open_metrics) == (True, True)


def test_closed_metrics_beyond_loopback_need_tokens_like_every_other_listener(tmp_path: Path) -> None:
    """With --no-open-metrics, /metrics takes the management tokens (else the inference ones); with
    neither (and TorchServe's keys off) it would answer anyone, so binding it beyond loopback is
    refused unless --insecure."""
    exposed = ["--metrics-address", "0.0.0.0:8082", "--no-open-metrics", "--disable-token-auth"]
    with pytest.raises(ServingError) as info:
        check_exposure(load_config(exposed, env={}))
    assert info.value.code is Code.PERMISSION_DENIED
    assert "HTTP metrics on 0.0.0.0:8082" in info.value.message
    check_exposure(load_config([*exposed, "--insecure"], env={}))
    check_exposure(load_config(["--metrics-address", "0.0.0.0:8082"], env={}))  # open by choice
    check_exposure(load_config(["--metrics-address", "127.0.0.1:8082", "--no-open-metrics"], env={}))
    for env in ({"MARINER_MANAGEMENT_TOKEN": "m"}, {"MARINER_INFERENCE_TOKEN": "i"}):
        check_exposure(load_config(exposed, env=env))


def test_only_a_kserve_runtime_takes_torchserve_auth_off_as_consent(caplog: pytest.LogCaptureFixture) -> None:
    """KServe's TorchServe runtime authenticates at its ingress and its config.properties turns
    TorchServe's keys off: started that way (`mariner serve torchserve ...` sets --kserve-runtime)
    the exposed listeners start, with a warning; `mariner serve` alone still refuses."""
    exposed = ["--inference-address", "0.0.0.0:8080", "--management-address", "0.0.0.0:8085"]
    with pytest.raises(ServingError) as info:
        check_exposure(load_config([*exposed, "--disable-token-auth"], env={}))
    assert "HTTP management on 0.0.0.0:8085" in info.value.message
    with caplog.at_level(logging.WARNING, logger="mariner"):
        check_exposure(load_config([*exposed, "--disable-token-auth", "--kserve-runtime"], env={}))
    assert "KServe runtime with TorchServe's token authorization off" in caplog.text
    assert "HTTP inference on 0.0.0.0:8080" in caplog.text
    # TorchServe's keys on: protected, nothing to consent to.
    check_exposure(load_config([*exposed, "--kserve-runtime"], env={}))
