"""A spill-only rollout replica as a real process (`python -m services.rollout.spill`), for the
backlog fault tests, optionally stopping dead at one point of its first spill (run as a script).

BURSTRL_TEST_SPILL_PAUSE:
- `before_manifest`: the segment's data file is written, its manifest not yet;
- `after_manifest`: the segment exists in the store, the script that indexes it has not run.
At that point the process touches BURSTRL_TEST_SPILL_MARKER and sleeps, for the test to kill -9.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import services.rollout.spill as spill  # noqa: E402
from shared.segments import DATA, segment_prefix  # noqa: E402

PAUSE = os.environ.get("BURSTRL_TEST_SPILL_PAUSE", "")
MARKER = Path(os.environ.get("BURSTRL_TEST_SPILL_MARKER", "/nonexistent/marker"))
_orig = spill.write_segment


def _paused(store, job_id, seg, data, info):  # noqa: ANN001, ANN202
    if PAUSE == "before_manifest":
        store.put(f"{segment_prefix(job_id, seg)}/{DATA}", data)
        MARKER.write_text(seg)
        time.sleep(3600)
    _orig(store, job_id, seg, data, info)
    if PAUSE == "after_manifest":
        MARKER.write_text(seg)
        time.sleep(3600)


if PAUSE:
    spill.write_segment = _paused

if __name__ == "__main__":
    spill.main()
