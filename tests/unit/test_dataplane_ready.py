"""A data plane's readiness before and after it knows what the server serves."""

from __future__ import annotations

from mariner.server.frontend.dataplane import DataPlane
from tests.unit.fakes import QuietMetrics


def test_no_model_is_ready_only_once_the_table_says_so() -> None:
    """A server serving no model is ready (TorchServe's /ping), but a frontend that has only the
    supervisor's placeholder table (version 0, before start-up publishes the models) does not yet
    know that: it must not pass a readiness probe while the models are still loading."""
    dp = DataPlane(QuietMetrics())
    assert dp.is_ready()
    dp.awaiting_table = True
    assert not dp.is_ready()
    dp.awaiting_table = False
    dp.draining = True
    assert not dp.is_ready()
