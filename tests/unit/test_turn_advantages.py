"""Per-turn advantages for multi-turn episodes (algorithm.advantage_level = "turn").

The math by hand (return-to-go per turn, a group baseline per turn index, inheritance when
a turn index has fewer than 2 episodes), the exact equalities that anchor it to episode-level
advantages, the token mapping (prompt offset, observation tokens zeroed), the gradient at
observation tokens through the real Learner, and a real episode's turn fields going from the
rollout through the reward stage's scoring, msgpack, and collate to the loss's [N, T] tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import pytest
import torch
from pydantic import ValidationError

from services.reward.worker import apply_scores
from services.rollout.engine import Adapter, Generation, Sample, SamplingConfig
from services.rollout.episodes import new_episode, run_episodes
from services.trainer.advantages import (
    compute_advantages,
    compute_turn_advantages,
    spread_turn_advantages,
    turn_advantages,
)
from services.trainer.batch import collate
from shared.domain.envs import StepResult, make_env, register_env
from shared.job import JobSpec
from shared.schema import Completion, GroupMsg, decode, encode, pack_f32, pack_i32, unpack_i32
from tests.support.multiturn import PROMPT, grads_and_stats
from tests.support.multiturn import episode as multiturn_episode
from tests.support.trainer_groups import ready_group

KINDS = ["grpo", "dr_grpo", "rloo"]


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# -- the math, by hand ----------------------------------------------------------------------
# One group of 3 episodes:
#   e0: R = 1.0,  3 turns, step rewards [-0.5, 0, 0] -> returns-to-go [1.0, 1.5, 1.5]
#   e1: R = 0.0,  2 turns, step rewards [0, 0]       -> [0.0, 0.0]
#   e2: R = -0.5, 1 turn,  step rewards [-0.5]       -> [-0.5]
# Turn 0: all three; turn 1: e0 and e1; turn 2: e0 alone, so it inherits its turn-1 value.
HAND_R = torch.tensor([[1.0, 0.0, -0.5]])
HAND_STEPS = [t([-0.5, 0.0, 0.0]), t([0.0, 0.0]), t([-0.5])]


def _hand(kind: str) -> list[list[float]]:
    def level(xs: list[float]) -> list[float]:
        n, mean = len(xs), sum(xs) / len(xs)
        if kind == "dr_grpo":
            return [x - mean for x in xs]
        if kind == "rloo":
            return [x - (sum(xs) - x) / (n - 1) for x in xs]  # leave-one-out, written out
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        return [(x - mean) / (std + 1e-6) for x in xs]

    a0 = level([1.0, 0.0, -0.5])
    a1 = level([1.5, 0.0])
    return [[a0[0], a1[0], a1[0]], [a0[1], a1[1]], [a0[2]]]


@pytest.mark.parametrize("kind", KINDS)
def test_hand_computed_turn_advantages(kind: str) -> None:
    got = turn_advantages(kind, HAND_R, HAND_STEPS)
    want = _hand(kind)
    assert [len(a) for a in got] == [3, 2, 1]
    for a, w in zip(got, want, strict=True):
        assert torch.allclose(a, t(w), atol=1e-5), (kind, a, w)
    # The numbers themselves, for dr_grpo: turn 0 centred on mean 1/6, turn 1 on 0.75.
    if kind == "dr_grpo":
        assert torch.allclose(got[0], t([5 / 6, 0.75, 0.75])) and torch.allclose(got[1], t([-1 / 6, -0.75]))
    if kind == "rloo":
        assert torch.allclose(got[0], t([1.25, 1.5, 1.5])) and torch.allclose(got[2], t([-1.0]))


def test_the_penalised_turn_is_credited_apart_from_the_rest() -> None:
    """The point of the turn level: two episodes, same final score, one paid a step penalty on
    its first turn. Episode level blames both turns of the penalised one; turn level blames
    only the turn that earned the penalty (later turns' returns are equal: advantage 0)."""
    r = torch.tensor([[1.0, 0.5]])  # e1 = 1.0 (final) - 0.5 (a failed tool call on turn 0)
    a = turn_advantages("dr_grpo", r, [t([0.0, 0.0]), t([-0.5, 0.0])])
    assert torch.allclose(a[0], t([0.25, 0.0])) and torch.allclose(a[1], t([-0.25, 0.0]))


def _random_batch(seed: int, b: int = 3, g: int = 4, k_max: int = 4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, g, generator=gen)
    steps = []
    for _ in range(b * g):
        k = int(torch.randint(1, k_max + 1, (1,), generator=gen))
        steps.append(torch.randn(k, generator=gen) * (torch.rand(k, generator=gen) < 0.5))
    return rewards, steps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_turn_zero_is_the_episode_level_advantage_exactly(kind: str, seed: int) -> None:
    rewards, steps = _random_batch(seed)
    episode = compute_advantages(kind, rewards)  # [N]
    turns = turn_advantages(kind, rewards, steps)
    assert torch.equal(torch.stack([a[0] for a in turns]), episode)


@pytest.mark.parametrize("kind", KINDS)
def test_without_step_rewards_every_turn_has_the_episode_advantage(kind: str) -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    episode = compute_advantages(kind, rewards)
    turns = turn_advantages(kind, rewards, [torch.zeros(3) for _ in range(8)])
    for i, a in enumerate(turns):
        assert torch.equal(a, episode[i].expand(3)), (i, a, episode[i])
    # Empty turn rewards (an older rollout, or a failed reset) count as one turn, no step reward.
    assert torch.equal(torch.stack([a[0] for a in turn_advantages(kind, rewards, [t([])] * 8)]), episode)


@pytest.mark.parametrize("kind", KINDS)
def test_a_turn_reached_by_one_episode_inherits_per_group(kind: str) -> None:
    """Group 0: everyone reaches turn 1 (its own baseline); group 1: only episode 0 does, so
    its turn 1 keeps its turn-0 advantage. Groups are baselined separately."""
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    steps = [t([0.0, 0.3]), t([0.0, -0.3]), t([0.0, 0.3]), t([0.0])]
    a = turn_advantages(kind, rewards, steps)
    episode = compute_advantages(kind, rewards)
    assert torch.equal(a[2][1], a[2][0]) and torch.equal(a[2][0], episode[2])
    # Group 0's turn 1: returns-to-go (1.0 - 0.0, 0.0 - 0.0) are the rewards again.
    assert torch.allclose(a[0][1], episode[0]) and torch.allclose(a[1][1], episode[1])
    assert len(a[3]) == 1 and torch.equal(a[3][0], episode[3])


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="grpo, dr_grpo or rloo"):
        turn_advantages("distill", HAND_R, HAND_STEPS)
    with pytest.raises(ValueError, match="turn rewards"):
        turn_advantages("grpo", HAND_R, HAND_STEPS[:2])


# -- tokens -------------------------------------------------------------------------------
def test_spread_maps_turns_to_shifted_positions_and_zeroes_observations() -> None:
    # Completion 0: prompt of 3 -> token j is predicted at position 2 + j. Layout:
    # turn 0 = tokens 0-1, observation 2-3, turn 1 = tokens 4-5. Completion 1: prompt of 2,
    # no turns (one turn from 0), 3 tokens, its last one masked.
    mask = torch.zeros(2, 8)
    mask[0, 2:8] = t([1, 1, 0, 0, 1, 1])
    mask[1, 1:4] = t([1, 1, 0])
    out = spread_turn_advantages(
        [t([2.0, -1.0]), t([0.5])],
        [torch.tensor([0, 4]), torch.tensor([], dtype=torch.long)],
        offsets=[2, 1],
        lengths=[6, 3],
        mask=mask,
    )
    assert out[0].tolist() == [0, 0, 2.0, 2.0, 0, 0, -1.0, -1.0]
    assert out[1].tolist() == [0, 0.5, 0.5, 0, 0, 0, 0, 0]


# -- the trainer's path: gradient at observation tokens ----------------------------------------
# The layout of tests/unit/test_multiturn.py's episodes (generated | observation | ... : 3 turns).
STARTS = [0, 7, 11]


def episode(seed: int, reward: float, steps: list[float], obs_lp: float = 0.0) -> Completion:
    """tests/unit/test_multiturn.py's episode, with its turn starts and per-turn step rewards."""
    return msgspec.structs.replace(
        multiturn_episode(seed, reward, obs_lp), turn_starts=pack_i32(STARTS), turn_rewards=pack_f32(steps)
    )


def groups(step_rewards: bool = True) -> list[GroupMsg]:
    def steps(i: int) -> list[float]:
        return [-0.5 * (i % 2), 0.25 * (i % 3 == 0), 0.0] if step_rewards else [0.0, 0.0, 0.0]

    return [
        ready_group(k, [episode(4 * k + i, float(i % 2) + 0.1 * k, steps(i)) for i in range(4)], PROMPT, prompt="")
        for k in range(2)
    ]


def turn_spec(level: str = "turn", **algorithm: object) -> JobSpec:
    return JobSpec(
        base_model="x",
        group_size=4,
        batch_size=2,
        kl_coef=0.1,
        env={"name": "calc"},
        algorithm={"advantage_level": level, "entropy_coef": 0.01, **algorithm},
    )


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_observation_tokens_carry_no_gradient_with_turn_advantages(aggregation: str) -> None:
    spec = turn_spec(aggregation=aggregation)
    gs = groups()
    b = collate(gs, pad_id=0)
    adv = compute_turn_advantages(
        "grpo", b.rewards, b.turn_starts, b.turn_rewards, offsets=b.offsets, lengths=b.lengths, mask=b.mask
    )
    # Live: the advantages do differ between turns of one episode, and are zero off the mask.
    assert any(len(set(adv[i][b.mask[i] == 1].tolist())) > 1 for i in range(len(adv)))
    assert torch.count_nonzero(adv[b.mask == 0]) == 0

    n, length = b.input_ids.shape
    untrained = torch.ones(n, length)
    untrained[:, : length - 1] = 1.0 - b.mask
    g0, st0, dhidden = grads_and_stats(spec, gs, None)
    g1, st1, _ = grads_and_stats(spec, gs, untrained)
    assert st0["loss"] == st1["loss"]
    assert all(torch.equal(a, c) for a, c in zip(g0, g1, strict=True))
    assert torch.count_nonzero(dhidden[untrained.bool()]) == 0
    assert torch.count_nonzero(dhidden[~untrained.bool()]) > 0
    assert st0["turns_mean"] == 3.0  # the metric the trainer's point carries

    # Control: noise at one generated token's position does change the gradient.
    trained = torch.zeros(n, length)
    i, j = (b.mask == 1).nonzero()[0].tolist()
    trained[i, j] = 1.0
    g2, st2, _ = grads_and_stats(spec, gs, trained)
    assert st2["loss"] != st0["loss"] or not all(torch.equal(a, c) for a, c in zip(g0, g2, strict=True))


def test_turn_level_without_step_rewards_is_the_episode_level_step() -> None:
    """Same turns everywhere, no step rewards: the turn level trains exactly as the episode
    level does (same advantages per token, so the same loss and gradients)."""
    gs = groups(step_rewards=False)
    g_turn, st_turn, _ = grads_and_stats(turn_spec("turn"), gs, None)
    g_ep, st_ep, _ = grads_and_stats(turn_spec("episode"), gs, None)
    assert st_turn["loss"] == st_ep["loss"]
    assert all(torch.equal(a, c) for a, c in zip(g_turn, g_ep, strict=True))


# -- a real episode, end to end to the [N, T] advantages ------------------------------------------
class ByteEngine:
    """Byte-level 'tokenizer' (id = byte value); answers with policy(context text)."""

    mode = "fake"
    dtype = "float32"

    def __init__(self, policy: Callable[[str], str]) -> None:
        self.policy = policy

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return list(text.encode())

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        out = []
        for ids in prompts:
            toks = list(self.policy(bytes(ids).decode()).encode())[: cfg.max_tokens]
            out.append(Generation(list(ids), [Sample(toks, [-0.1] * len(toks), bytes(toks).decode(), "stop")]))
        return out


def careless(context: str) -> str:
    """Calls the tool with a bad expression first, then a good one, then copies the result."""
    if context.endswith("="):
        return "<calc>1+</calc>"
    if context.endswith("=error\n"):
        return f"<calc>{context.split('=', 1)[0]}</calc>"
    return context.rstrip("\n").rsplit("=", 1)[-1]


def careful(context: str) -> str:
    if context.endswith("="):
        return f"<calc>{context.split('=', 1)[0]}</calc>"
    return context.rstrip("\n").rsplit("=", 1)[-1]


def test_calc_penalty_is_a_step_reward_of_its_turn() -> None:
    env = make_env("calc", {"tool_error_penalty": 0.25})
    env.reset("1+2=", {})
    assert env.step("<calc>1+</calc>").reward_parts == {"tool_error": -0.25}
    assert env.step("<calc>1+2</calc>").reward_parts == {}
    assert make_env("calc").step("<calc>1+</calc>").reward_parts == {}  # default: as before
    # A call beyond max_calls is a failed tool call too (it ends the episode unanswered).
    over = make_env("calc", {"tool_error_penalty": 0.25, "max_calls": 0}).step("<calc>1+2</calc>")
    assert over.done and over.tool_error and over.reward_parts == {"tool_error": -0.25}
    with pytest.raises(ValueError, match="tool_error_penalty"):
        make_env("calc", {"tool_error_penalty": -1.0})


class TaggedEnv:
    """Pays each turn 0.5 with a zero-valued tag alongside (tags are not step reward)."""

    name = "turn-test-tagged"
    stop = ()

    def __init__(self) -> None:
        self.n = 0

    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        return prompt

    def step(self, text: str) -> StepResult:
        self.n += 1
        return StepResult(
            observation="ok\n", reward_parts={"bonus": 0.5, "bonus!odd": 0.0}, done=self.n == 2, answer=text
        )


def test_episode_records_turn_rewards_without_tags() -> None:
    register_env("turn-test-tagged", TaggedEnv, replace=True)
    job = JobSpec(base_model="tiny", task="arith3", group_size=2, env={"name": "turn-test-tagged"})
    cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_tokens=8)
    ep = new_episode(job, "hi", {}, None, cfg, 256)
    run_episodes(ByteEngine(lambda ctx: "ab"), [ep])
    assert ep.end == "done" and ep.turn_starts == [0, 5] and ep.turn_rewards == [0.5, 0.5]
    c = ep.completion()
    assert c.reward_parts == {"bonus": 1.0, "bonus!odd": 0.0}
    assert unpack_i32(c.turn_starts).tolist() == [0, 5]


def test_real_episodes_to_turn_advantages_through_msgpack_and_collate() -> None:
    """Rollout -> reward stage scoring -> msgpack -> collate -> per-token advantages."""
    job = JobSpec(
        base_model="tiny",
        task="arith3",
        group_size=2,
        env={"name": "calc", "args": {"tool_error_penalty": 0.5}},
        algorithm={"advantage": "dr_grpo", "advantage_level": "turn"},
    )
    cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_tokens=32)
    eps = [new_episode(job, "12+30=", {"answer": "42"}, None, cfg, 256) for _ in range(2)]
    run_episodes(ByteEngine(careless), eps[:1])
    run_episodes(ByteEngine(careful), eps[1:])
    bad, good = eps
    assert bad.answer == good.answer == "42" and bad.turns == 3 and good.turns == 2
    assert bad.turn_rewards == [-0.5, 0.0, 0.0] and good.turn_rewards == [0.0, 0.0]
    g = GroupMsg(
        job_id="j",
        group_id="g0",
        item_id="12+30",
        prompt="12+30=",
        prompt_ids=pack_i32(bad.prompt_ids),
        policy_version=0,
        completions=[e.completion() for e in eps],
    )
    g = apply_scores(g, [{"correct": 1.0}, {"correct": 1.0}])  # the reward stage's merge of parts
    assert [c.reward for c in g.completions] == [0.5, 1.0]
    g = decode(encode(g), GroupMsg)
    b = collate([g], pad_id=0)
    adv = compute_turn_advantages(
        job.algorithm.advantage,
        b.rewards,
        b.turn_starts,
        b.turn_rewards,
        offsets=b.offsets,
        lengths=b.lengths,
        mask=b.mask,
    )
    # Returns-to-go: bad [0.5, 1.0, 1.0], good [1.0, 1.0]. dr_grpo: turn 0 around 0.75,
    # turn 1 around 1.0; turn 2 only bad reached: it inherits its turn-1 value 0.
    want_turn = [[-0.25, 0.0, 0.0], [0.25, 0.0]]
    P = len(bad.prompt_ids)
    for i, e in enumerate(eps):
        want = torch.zeros(b.mask.shape[1])
        bounds = [*e.turn_starts, len(e.ids)]
        for k, a in enumerate(want_turn[i]):
            for j in range(bounds[k], bounds[k + 1]):
                want[P - 1 + j] = a * e.mask[j]  # observation tokens (mask 0) get 0
        assert torch.allclose(adv[i], want), (i, adv[i], want)
    # The penalised first turn's tokens are where the signal is.
    assert adv[0, P - 1] == -0.25 and adv[1, P - 1] == 0.25


def test_malformed_turn_fields_fall_back_to_one_turn() -> None:
    c = episode(0, 1.0, [0.0, 0.0, 0.0])
    c.turn_rewards = pack_f32([0.0, 0.0])  # K differs from turn_starts'
    d = episode(1, 0.0, [0.0, 0.0, 0.0])
    d.turn_starts = pack_i32([0, 99, 100])  # past the end
    g = GroupMsg(
        job_id="j",
        group_id="g",
        item_id="i",
        prompt="",
        prompt_ids=pack_i32(PROMPT),
        policy_version=0,
        completions=[c, d],
    )
    b = collate([g], pad_id=0)
    assert [len(s) for s in b.turn_starts] == [0, 0] and b.turns_mean is None


# -- the job spec ---------------------------------------------------------------------------------
def test_job_validation() -> None:
    assert JobSpec(base_model="m").algorithm.advantage_level == "episode"
    with pytest.raises(ValidationError, match="env.name"):
        JobSpec(base_model="m", algorithm={"advantage_level": "turn"})
    with pytest.raises(ValidationError, match="grpo, dr_grpo or rloo"):
        JobSpec(base_model="m", env={"name": "calc"}, algorithm={"advantage_level": "turn", "advantage": "distill"})
    with pytest.raises(ValidationError):
        JobSpec(base_model="m", env={"name": "calc"}, algorithm={"advantage_level": "token"})
    for kind in KINDS:
        spec = JobSpec(base_model="m", env={"name": "calc"}, algorithm={"advantage_level": "turn", "advantage": kind})
        assert spec.algorithm.advantage_level == "turn"
