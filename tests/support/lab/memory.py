"""Peak tensor memory of a measured case, the method bench/plan_calibration.py and
bench/chunked_logprobs.py share.

torch's profiler with `profile_memory=True` sees every allocation and free made through c10's CPU
allocator (all tensor storage, autograd's saved tensors and kernel scratch included) and reports
the running total of live bytes at each event: the max of that total is the exact peak of tensor
memory. Each case runs in a fresh interpreter (`run_fresh`), so nothing from another is alive or
cached."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from pydantic import BaseModel

from tests.support import ROOT


def allocations(prof: Any) -> list:
    """Every allocation event the profiler saw (`profile_memory=True`), in time order: each carries
    `extra_fields.alloc_size` and the running total of live bytes, `extra_fields.total_allocated`."""
    from torch.profiler._memory_profiler import _EventType

    def walk(nodes):  # type: ignore[no-untyped-def]
        for node in nodes:
            yield node
            yield from walk(node.children)

    return sorted(
        (e for e in walk(prof.profiler.kineto_results.experimental_event_tree()) if e.tag == _EventType.Allocation),
        key=lambda e: e.start_time_ns,
    )


def run_fresh(script: str, case: BaseModel, timeout: float) -> dict[str, float]:
    """`python script --case <case as JSON>` in a fresh interpreter; the JSON object its last
    stdout line prints. A failed case raises, with the end of its stderr."""
    out = subprocess.run(
        [sys.executable, script, "--case", case.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"case {case.model_dump()} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
