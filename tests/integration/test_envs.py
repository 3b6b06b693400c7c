"""Environments and multi-turn episodes with a scripted fake engine (fast): the calculator
is safe, context is passed as token ids and grows token-exactly, observations are masked,
episodes replay to the same ids, limits hold, and misbehaving environments are contained."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.reward.worker import apply_scores
from services.rollout.engine import Adapter, Generation, Sample, SamplingConfig
from services.rollout.episodes import Episode, new_episode, run_episodes, stuck_env_calls
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from shared import keys
from shared.bus import FIELD
from shared.domain.envs import EnvError, StepResult, env_names, load_env_plugins, make_env, register_env
from shared.domain.envs.calc import CalcError, calc
from shared.domain.tasks import get_task
from shared.domain.verifiers import TAG_SEP
from shared.job import JobSpec
from shared.metrics import read_points
from shared.schema import GroupMsg, PromptMsg, decode, encode, unpack_f32, unpack_i32, unpack_u8
from shared.service import ServiceRuntime
from shared.store import FileStore
from tests.support.plugins import plugin_module
from tests.support.rollout import add_job


def calc_policy(context: str) -> str:
    """A perfect tool user: call the tool on the prompt, then copy the tool's answer."""
    if context.endswith("="):
        return f"<calc>{context.rsplit(chr(10), 1)[-1][:-1]}</calc>"
    return context.rstrip("\n").rsplit("=", 1)[-1]


class ScriptedEngine:
    """Byte-level 'tokenizer' (id = byte value); replies with policy(context text)."""

    mode = "fake"
    dtype = "float32"

    def __init__(self, policy: Callable[[str], str] = calc_policy) -> None:
        self.policy = policy
        self.seen: list[list[int]] = []  # every context it was asked to continue, as ids

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        return list(text.encode())

    def generate_ids(
        self, prompts: list[list[int]], adapters: list[Adapter | None], cfg: SamplingConfig
    ) -> list[Generation]:
        assert cfg.n == 1 and cfg.include_stop
        out = []
        for ids in prompts:
            self.seen.append(list(ids))
            text = self.policy(bytes(ids).decode())
            toks = list(text.encode())[: cfg.max_tokens]
            reason = "stop" if len(toks) == len(text.encode()) else "length"
            lps = [-0.1 - 0.01 * i for i in range(len(toks))]
            out.append(Generation(list(ids), [Sample(toks, lps, bytes(toks).decode(), reason)]))
        return out


def spec(env: str = "calc", **limits: object) -> JobSpec:
    return JobSpec(base_model="tiny", task="arith3", group_size=2, env={"name": env, **limits})


def episodes(job: JobSpec, prompts: list[str], n: int = 1, max_tokens: int = 32, context: int = 256) -> list[Episode]:
    cfg = SamplingConfig(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    return [new_episode(job, p, {"answer": ""}, None, cfg, context) for p in prompts for _ in range(n)]


# -- the calculator ----------------------------------------------------------------------
def test_calc_is_arithmetic_only() -> None:
    assert calc("123+456") == 579 and calc("(2+3)*4-1") == 19 and calc("7/2") == 3.5 and calc("2**10") == 1024
    assert calc("-3 // 2") == -2 and calc("10 % 4") == 2 and calc("6/3") == 2
    for bad in ("__import__('os')", "a+1", "[1]*3", "9**9**9", "1/0", "2**1000", "x" * 100, "1e400*1e400", "(1,2)"):
        with pytest.raises(CalcError):
            calc(bad)


def test_registry_and_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"calc", "guess"} <= set(env_names())
    with pytest.raises(EnvError, match="unknown environment"):
        make_env("nope")
    with pytest.raises(EnvError, match="rejected its args"):
        make_env("calc", {"bogus": 1})
    echo = (
        "from shared.domain.envs import StepResult, register_env\n"
        "class Echo:\n    name = 'echo'\n    stop = ()\n"
        "    def reset(self, prompt, fields): return prompt\n"
        "    def step(self, text): return StepResult(done=True, answer=text)\n"
        "register_env('echo-plugin', Echo)\n"
    )
    plugin_module(tmp_path, monkeypatch, "my_env_plugin", echo)
    assert load_env_plugins(["my_env_plugin", " "]) == ["my_env_plugin"]
    assert "echo-plugin" in env_names()
    sys.modules.pop("my_env_plugin", None)
    with pytest.raises(ImportError, match="BURSTRL_ROLLOUT_ENV_PLUGINS"):
        load_env_plugins(["no_such_plugin_module"])
    # a job payload only names an env: extra keys are refused at the door
    with pytest.raises(ValueError):
        JobSpec(base_model="m", env={"name": "calc", "module": "os"})


# -- token-exact episodes -------------------------------------------------------------------
def test_calc_episode_is_token_exact_and_masks_observations() -> None:
    eng = ScriptedEngine()
    (ep,) = episodes(spec(), ["123+456="])
    run_episodes(eng, [ep])
    assert ep.end == "done" and ep.answer == "579" and ep.turns == 2 and ep.tool_calls == 1
    prompt = list(b"123+456=")
    call, obs, answer = list(b"<calc>123+456</calc>"), list(b"=579\n"), list(b"579")
    assert ep.prompt_ids == prompt and ep.ids == call + obs + answer
    assert ep.mask == [1] * len(call) + [0] * len(obs) + [1] * len(answer)
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 1)
    # The engine was handed ids, and turn 2's context is exactly prompt + turn 1 + observation.
    assert eng.seen == [prompt, prompt + call + obs]
    assert ep.turn_starts == [0, len(call + obs)]
    c = ep.completion()
    assert unpack_i32(c.token_ids).tolist() == ep.ids
    assert unpack_u8(c.loss_mask).tolist() == ep.mask
    assert len(unpack_f32(c.logprobs)) == len(ep.ids) and c.text == "579" and c.reward_parts == {}
    # The task's verifier scores the final answer; the reward service adds the env's parts.
    assert get_task("arith3").score(c.text, {"answer": "579"}) == {"correct": 1.0}


def test_episode_replays_to_the_same_token_ids() -> None:
    """Replay the recorded model turns through a fresh environment: the observations
    tokenize to the recorded ids, so the trajectory is a faithful record of the episode."""
    eng = ScriptedEngine()
    eps = episodes(spec(), ["123+456=", "999+1=", "5*7="], n=2)
    run_episodes(eng, eps)
    first = [list(e.ids) for e in eps]
    again = episodes(spec(), ["123+456=", "999+1=", "5*7="], n=2)
    run_episodes(ScriptedEngine(), again)
    assert [e.ids for e in again] == first
    for ep in eps:
        env = make_env("calc")
        assert eng.tokenize(env.reset(ep.prompt, ep.fields), special=True) == ep.prompt_ids
        rebuilt: list[int] = []
        bounds = [*ep.turn_starts, len(ep.ids)]
        for k, start in enumerate(ep.turn_starts):
            gen_end = start + next(
                (i for i, m in enumerate(ep.mask[start : bounds[k + 1]]) if m == 0), bounds[k + 1] - start
            )
            turn = ep.ids[start:gen_end]
            rebuilt += turn
            r = env.step(bytes(turn).decode())
            if not r.done:
                rebuilt += eng.tokenize(r.observation, special=False)
        assert rebuilt == ep.ids


def test_guess_game_multi_step_with_env_reward_parts() -> None:
    def bisect(context: str) -> str:
        lo, hi = 0, 15
        lines = context.split("\n")[1:]
        guess = (lo + hi) // 2
        for g, fb in zip(lines[0::2], lines[1::2], strict=False):
            if fb == "up":
                lo = int(g) + 1
            elif fb == "down":
                hi = int(g) - 1
            guess = (lo + hi) // 2
        return f"{guess}\n"

    job = JobSpec(base_model="tiny", task="guess", group_size=2, env={"name": "guess", "max_turns": 8})
    task = get_task("guess")
    eps = []
    for it in task.heldout_items(16):
        cfg = SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_tokens=4)
        eps.append(new_episode(job, it.prompt, it.fields, None, cfg, 256))
    run_episodes(ScriptedEngine(bisect), eps)
    assert all(e.end == "done" for e in eps)
    assert all(task.score(e.answer, e.fields)["correct"] == 1.0 for e in eps)
    assert max(e.turns for e in eps) <= 5  # binary search over 16 numbers
    assert any(e.parts["guess_turns"] < 0 for e in eps)  # extra guesses cost
    # the reward service adds the verifier's parts to the env's
    group = GroupMsg(
        job_id="j",
        group_id="g",
        item_id="i",
        prompt="",
        prompt_ids=b"",
        policy_version=0,
        completions=[eps[0].completion()],
    )
    (c,) = apply_scores(group, [{"correct": 1.0}]).completions
    assert c.reward == pytest.approx(1.0 + eps[0].parts["guess_turns"])
    assert set(c.reward_parts) == {"correct", "guess_turns"}


# -- limits -------------------------------------------------------------------------------------
def test_turn_token_and_context_limits() -> None:
    loop = ScriptedEngine(lambda ctx: "<calc>1+1</calc>")  # calls the tool forever
    (ep,) = episodes(spec(max_turns=2), ["1+1="])
    run_episodes(loop, [ep])
    assert ep.end == "max_turns" and ep.turns == 2 and ep.answer == ""
    assert ep.completion().reward_parts == {f"env{TAG_SEP}max_turns": 0.0}

    (ep,) = episodes(spec(max_turns=10, max_tokens=30), ["1+1="])
    run_episodes(loop, [ep])
    assert ep.end == "max_tokens" and len(ep.ids) <= 30 and ep.finish_reason == "length"

    (ep,) = episodes(spec(max_turns=10, max_tokens=1000), ["1+1="], context=40)
    run_episodes(loop, [ep])
    assert ep.end == "context" and len(ep.prompt_ids) + len(ep.ids) < 40

    # a tool-call limit inside the env ends the episode unanswered
    (ep,) = episodes(
        JobSpec(base_model="t", task="arith3", env={"name": "calc", "max_turns": 9, "args": {"max_calls": 1}}), ["1+1="]
    )
    run_episodes(loop, [ep])
    assert ep.end == "done" and ep.answer == "" and ep.tool_calls == 2 and ep.tool_errors == 1


def test_wall_time_limit() -> None:
    def slow(ctx: str) -> str:
        time.sleep(0.3)
        return "<calc>1+1</calc>"

    (ep,) = episodes(spec(max_turns=50, max_tokens=5000, max_seconds=0.5), ["1+1="])
    t0 = time.monotonic()
    run_episodes(ScriptedEngine(slow), [ep])
    assert ep.end == "wall_time" and time.monotonic() - t0 < 2.0 and ep.turns >= 1


# -- containment ------------------------------------------------------------------------------------
class Raising:
    name, stop = "raising", ()

    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        return prompt

    def step(self, text: str) -> StepResult:
        raise RuntimeError("env bug")


class Hanging(Raising):
    release = threading.Event()

    def step(self, text: str) -> StepResult:
        Hanging.release.wait(60)
        return StepResult(done=True)


class BadReset(Raising):
    def reset(self, prompt: str, fields: dict[str, str]) -> str:
        raise KeyError("secret")


class Garbage(Raising):
    def step(self, text: str) -> StepResult:
        return "not a StepResult"  # type: ignore[return-value]


register_env("test-raising", Raising, replace=True)
register_env("test-hanging", Hanging, replace=True)
register_env("test-badreset", BadReset, replace=True)
register_env("test-garbage", Garbage, replace=True)


def test_misbehaving_environments_end_only_their_episode() -> None:
    eng = ScriptedEngine(lambda ctx: "12")
    eps = (
        episodes(spec("test-raising"), ["1+1="])
        + episodes(spec("test-hanging", step_timeout_s=0.5), ["1+1="])
        + episodes(spec("test-badreset"), ["1+1="])
        + episodes(spec("test-garbage"), ["1+1="])
        + episodes(spec("calc"), ["1+1="])
    )
    stuck0 = stuck_env_calls()
    t0 = time.monotonic()
    run_episodes(eng, eps)
    assert time.monotonic() - t0 < 3.0  # the hang cost its deadline, not 60 s
    assert [e.end for e in eps] == ["error:RuntimeError", "timeout", "error:KeyError", "error:bad_step_result", "done"]
    assert eps[-1].answer == "12" and eps[-1].mask == [1, 1]
    # the env's fault is not the policy's: those episodes train nothing
    for e in eps[:4]:
        assert sum(e.mask) == 0
        assert e.completion().reward_parts == {f"env{TAG_SEP}{e.end}": 0.0}
    assert eps[2].ids == [] and eps[2].turns == 0 and eps[2].prompt_ids == list(b"1+1=")  # the group's prompt
    assert stuck_env_calls() == stuck0 + 1
    Hanging.release.set()  # the abandoned call returns: it is no longer counted
    deadline = time.monotonic() + 5
    while stuck_env_calls() != stuck0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stuck_env_calls() == stuck0


# -- the rollout worker ---------------------------------------------------------------------------
class WorkerEngine(ScriptedEngine):
    def load_adapter(self, name: str, path: str) -> Adapter:
        raise AssertionError("no versions in this test")

    def unload(self, adapter: Adapter) -> None:
        pass

    def generate(self, prompts, adapters, cfg):  # noqa: ANN001, ANN201
        raise AssertionError("env jobs must generate from token ids")

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_worker_runs_env_jobs_as_episodes(tmp_path: Path, redis_server, r) -> None:  # noqa: ANN001
    s = RolloutSettings(
        model="tiny", redis_url=redis_server.url, store_url=f"file://{tmp_path}/store", dev=True, data_dir=tmp_path
    )
    rt = ServiceRuntime("rollout", s)
    rt.health.set("engine", True)
    worker = RolloutWorker(rt, s, WorkerEngine(), FileStore(tmp_path / "store"))
    job = add_job(
        r, "tiny", task="arith3", group_size=3, eval_size=0, env={"name": "calc"}, sampling={"max_tokens": 24}
    )
    bad = add_job(r, "tiny", name="bad", task="arith3", group_size=2, eval_size=0, env={"name": "no-such-env"})
    for j, prompt in ((job, "123+456="), (bad, "1+2=")):
        msg = PromptMsg(job_id=j.id, group_id=f"{j.id}:g0", item_id="0", prompt=prompt, fields={"answer": "579"})
        r.xadd(keys.prompts(j.id), {FIELD: encode(msg)})
        r.hincrby(keys.ledger(j.id), "fed", 1)
    worker.tick()
    (_, fields), *_ = r.xrange(keys.rollouts(job.id))
    group = decode(fields[FIELD], GroupMsg)
    assert unpack_i32(group.prompt_ids).tolist() == list(b"123+456=")
    assert len(group.completions) == 3
    for c in group.completions:
        assert c.text == "579"
        assert bytes(unpack_i32(c.token_ids).tolist()) == b"<calc>123+456</calc>=579\n579"
        assert unpack_u8(c.loss_mask).tolist().count(0) == len("=579\n")
    (point,) = read_points(r, job.id, "rollout_env")
    assert point["episodes"] == 3 and point["turns_mean"] == 2 and point["tool_calls"] == 3
    assert point["tool_errors"] == 0 and point["ends"] == {"done": 3} and point["length_mean"] == 28
    # an unknown environment is the job's config error: dead-lettered with the reason, service up
    (_, dead), *_ = r.xrange(keys.dead_letter(bad.id))
    assert b"unknown environment" in b"".join(v for v in dead.values())
    metrics = TestClient(rt.app).get("/metrics").text
    assert 'burstrl_rollout_env_episodes_total{end="done"} 3.0' in metrics
    worker.close()


def test_empty_final_turn_submits_the_last_tool_result() -> None:
    def caller(ctx: str) -> str:
        return f"<calc>{ctx[:-1]}</calc>" if ctx.endswith("=") else ""  # then an empty turn (EOS only)

    (ep,) = episodes(spec(), ["123+456="])
    run_episodes(ScriptedEngine(caller), [ep])
    assert ep.end == "done" and ep.answer == "579" and ep.turns == 2
    env = make_env("calc", {"submit_last_result": False})
    env.reset("1+2=", {})
    env.step("<calc>1+2</calc>")
    assert env.step("").answer == ""
