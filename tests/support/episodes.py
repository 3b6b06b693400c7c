"""Multi-turn episodes on a real vLLM engine (in-process or a server), shared by the engine tests:
a recording engine wrapper, sampled tool-using episodes, and the sampler-vs-trainer gap."""

from __future__ import annotations

from pathlib import Path

import torch

from services.rollout.engine import Engine, SamplingConfig
from services.rollout.episodes import new_episode, run_episodes
from shared.domain.tasks import get_task
from shared.job import JobSpec


class Recording:
    """Wraps an engine; keeps what each generate_ids call was given and what vLLM reports."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], list[int]]] = []

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return self.engine.tokenize(text, special=special)

    def generate_ids(self, prompts, adapters, cfg):  # noqa: ANN001, ANN201
        gens = self.engine.generate_ids(prompts, adapters, cfg)
        self.calls += [(list(p), list(g.prompt_ids)) for p, g in zip(prompts, gens, strict=True)]
        return gens


JOB = JobSpec(base_model="tiny", task="arith3", env={"name": "calc", "max_turns": 3, "max_tokens": 64})


def episodes(eng: Recording, n: int, temperature: float) -> list:
    items = get_task("arith3").heldout_items(n)
    cfg = SamplingConfig(n=1, temperature=temperature, top_p=1.0, max_tokens=24)
    eps = [new_episode(JOB, it.prompt, it.fields, None, cfg, 256) for it in items]
    run_episodes(eng, eps)
    return eps


def multi_turn_sample(engine: Engine) -> tuple[Recording, list]:
    """24 sampled episodes through a recording engine; only those that used the tool."""
    rec = Recording(engine)
    eps = episodes(rec, 24, 1.0)
    multi = [e for e in eps if e.turns >= 2 and 0 in e.mask]
    assert multi, [e.end for e in eps]  # the SFT'd model calls the tool sometimes
    print(f"\n{len(multi)}/{len(eps)} episodes used the tool; ends: {[e.end for e in eps]}")
    return rec, multi


def worst_gap_to_trainer(multi: list, model_path: Path) -> float:
    """Largest |sampler - trainer| log-prob over generated tokens (transformers, fp32, on
    prompt + trajectory); observation tokens must carry log-prob 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    worst = 0.0
    for e in multi:
        ids = torch.tensor([e.prompt_ids + e.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        p = len(e.prompt_ids)
        trainer = logp[p - 1 :].gather(-1, ids[0, p:, None]).squeeze(-1)
        for t, (m, lp) in enumerate(zip(e.mask, e.logprobs, strict=True)):
            if m:
                worst = max(worst, abs(float(trainer[t]) - lp))
            else:
                assert lp == 0.0
    return worst


def assert_greedy_replays(engine: Engine) -> None:
    """Two greedy runs of the same 16 episodes give the same ids and masks."""
    a = episodes(Recording(engine), 16, 0.0)
    b = episodes(Recording(engine), 16, 0.0)
    assert [e.ids for e in a] == [e.ids for e in b]
    assert [e.mask for e in a] == [e.mask for e in b]
    acc = sum(get_task("arith3").score(e.answer, e.fields)["correct"] for e in a) / len(a)
    print(f"\ngreedy accuracy {acc:.2f}, tool calls {sum(e.tool_calls for e in a)}/{len(a)}")
