"""ServiceRuntime.run: the loop every service's main runs, and how it ends."""

from __future__ import annotations

import pytest

from services.api.settings import ApiSettings
from shared import keys
from shared.service import ServiceRuntime

TOKEN = "service-runtime-test-token-0123456789"


def test_run_shuts_down_even_when_close_raises(r, redis_server) -> None:
    """Regression: a `close` that raised (an engine that failed to shut down) skipped `shutdown`, so
    the replica's heartbeat stayed for five heartbeat periods and its HTTP server kept serving."""
    rt = ServiceRuntime("api", ApiSettings(redis_url=redis_server.url, token=TOKEN))
    beat = keys.service("api", rt.settings.replica)
    r.set(beat, b"alive")

    def close() -> None:
        raise RuntimeError("engine shutdown failed")

    with pytest.raises(RuntimeError, match="engine shutdown failed"):
        rt.run(rt.stop.set, close=close)  # one tick that asks to stop, then close raises
    assert r.get(beat) is None  # shutdown ran: the heartbeat is gone, stop is set
    assert rt.stop.is_set()
