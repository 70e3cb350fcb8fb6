"""The descriptor budget that the HTTP and gRPC listeners of a frontend share."""

from __future__ import annotations

import resource

import pytest

from mariner.server.common.connection_budget import RESERVED_DESCRIPTORS, raise_descriptor_limit, share
from mariner.server.common.grpc_server import STREAM_WINDOW_BYTES, GrpcLimits, server_options


def test_caps_that_fit_are_kept() -> None:
    budget = share(20_000, 1000, 1000)
    assert (budget.http, budget.grpc, budget.scaled) == (1000, 1000, False)


def test_caps_that_do_not_fit_shrink_in_proportion_and_never_exceed_the_limit() -> None:
    budget = share(1024, 1000, 3000)
    assert budget.scaled
    assert budget.http + budget.grpc <= 1024 - RESERVED_DESCRIPTORS
    assert budget.grpc == pytest.approx(3 * budget.http, abs=2)


def test_a_tiny_limit_still_leaves_one_connection_each() -> None:
    budget = share(100, 1000, 1000)
    assert (budget.http, budget.grpc) == (1, 1)


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and soft > 64:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
        raised = raise_descriptor_limit()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert raised == now
        if hard != resource.RLIM_INFINITY:
            assert now == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_grpc_limits_become_grpc_core_arguments() -> None:
    options = dict(server_options(1 << 20, limits=GrpcLimits(7, 9, 1.5)))
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.max_connection_idle_ms"] == 1500
    # A fixed per-call window bounds what a call refused on its metadata can push in.
    assert options["grpc.http2.bdp_probe"] == 0
    assert options["grpc.http2.lookahead_bytes"] == STREAM_WINDOW_BYTES


@pytest.mark.parametrize("field", ["max_connections", "max_concurrent_streams", "idle_timeout_s"])
def test_grpc_limits_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=f"grpc_{field} must be positive"):
        GrpcLimits(**{field: 0})
