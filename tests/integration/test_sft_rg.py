"""The reasoning-gym demo's model (tiny-sft-rg) is SFT'd on train items only, for the demo's job.

If its SFT data held a held-out item, the demo's held-out pass@1 would measure recall, not
what GRPO taught: these tests fail on any such item, on the whole SFT stream of the recipe.
"""

from __future__ import annotations

import inspect
import itertools
import tomllib
from pathlib import Path

import pytest

from shared.domain.tasks import make_task
from shared.domain.tasks.base import ConfiguredTask
from shared.job import JobSpec
from shared.ml import sft_rg as sftmod
from shared.ml.models import RG_MODEL_NAME
from shared.ml.sft_rg import RG_ARGS, RG_TASK, RG_TEMPLATE, rg_sft_examples, sft_rg

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo_rg.toml"


def recipe_size() -> int:
    """How many items the recipe's SFT reads: steps x batch_size, sft_rg's defaults."""
    params = inspect.signature(sft_rg).parameters
    return params["steps"].default * params["batch_size"].default


@pytest.fixture(scope="module")
def heldout() -> tuple[set[str], set[str]]:
    """The demo task's whole held-out split (item ids, rendered prompts): it is a few hundred."""
    task = ConfiguredTask(make_task(RG_TASK, RG_ARGS), RG_TEMPLATE, [])
    items = task.heldout_items(1_000_000)  # stops when the problem space runs out
    assert len(items) > 300  # the whole split, not the job's first 64
    return {it.item_id for it in items}, {it.prompt for it in items}


def leaks(examples: list[tuple[str, str, str]], heldout: tuple[set[str], set[str]]) -> list[str]:
    ids, prompts = heldout
    return [prompt for item_id, prompt, _ in examples if item_id in ids or prompt in prompts]


def test_the_demo_job_is_the_task_the_model_was_sftd_on() -> None:
    spec = tomllib.loads(DEMO.read_text())
    assert spec["task"] == RG_TASK
    assert spec["task_spec"]["args"] == RG_ARGS
    assert spec["task_spec"]["template"] == RG_TEMPLATE
    assert Path(spec["base_model"]).name == RG_MODEL_NAME
    JobSpec.model_validate(spec)


def test_the_recipes_sft_data_has_no_heldout_item(heldout: tuple[set[str], set[str]]) -> None:
    examples = list(rg_sft_examples(recipe_size()))
    assert len(examples) == recipe_size()
    assert leaks(examples, heldout) == []
    # The check itself catches a leak: one held-out prompt among the SFT data.
    task = ConfiguredTask(make_task(RG_TASK, RG_ARGS), RG_TEMPLATE, [])
    one = task.heldout_items(1)[0]
    assert leaks([*examples[:10], (one.item_id, one.prompt, one.fields["answer"])], heldout) == [one.prompt]
    # Answers are the generator's: the SFT teaches reasoning-gym's task, scored by its scorer.
    for _, prompt, answer in examples[:50]:
        assert eval(prompt.removesuffix(" =")) == int(answer)  # noqa: S307 - digits, + and - only


def test_sft_rg_trains_on_those_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heldout: tuple[set[str], set[str]]
) -> None:
    """A two-step run on a one-layer model: what sft_rg trains on is rg_sft_examples' stream."""
    from shared.ml.tiny_model import build_model

    seen: list[tuple[str, str, str]] = []

    def spy(n: int, **kw: int) -> object:
        for ex in itertools.islice(rg_sft_examples(n, **kw), n):
            seen.append(ex)
            yield ex

    monkeypatch.setattr(sftmod, "rg_sft_examples", spy)
    base = build_model(tmp_path / "base", hidden=64, layers=1)
    out = sft_rg(base, tmp_path / "out", steps=2, batch_size=4)
    assert (out / "model.safetensors").exists()
    assert len(seen) == 8
    assert leaks(seen, heldout) == []
