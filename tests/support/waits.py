"""Wait budgets that stretch with the machine's load.

A test's timeout is a hang detector, not a speed assertion: on a busy machine (two pytest
workers, another session's build, CI neighbours) the same pipeline legitimately takes several
times longer, and a fixed wall-clock budget then fails a test that is not broken. So every
wait in the end-to-end and process tests measures its budget in *unloaded* seconds: the clock
runs slower while the 1-minute load average is above the core count, up to MAX_STRETCH.
"""

from __future__ import annotations

import os
import time

# Past this the machine is not busy but wedged, and the test should say so.
MAX_STRETCH = 4.0


def load_stretch() -> float:
    """How many times slower than an idle machine this one is now (1 .. MAX_STRETCH)."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_STRETCH, max(1.0, per_core))


class Deadline:
    """`timeout` seconds of an idle machine's time from now. Each poll advances the clock by
    the wall time since the last one divided by the load stretch at that moment."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._used = 0.0
        self._last = time.monotonic()

    def expired(self) -> bool:
        now = time.monotonic()
        self._used += (now - self._last) / load_stretch()
        self._last = now
        return self._used > self.timeout

    def __bool__(self) -> bool:  # `while deadline:` reads as "while there is time left"
        return not self.expired()
