"""The agent server (docs/agents.md) in-process: token-exact chat deltas, history checks, the
ledger's once-only injection, a Hermes tool call and batched turns with a scripted engine.

The same endpoint as real processes, driven by plain `openai` client code: tests/e2e/test_agents_openai.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.rollout.chat import ChatTemplate, HistoryMismatch, check_extends, normal, parse_tool_calls
from shared import keys
from shared.bus import inject
from shared.job import JobSpec
from shared.ledger import UnknownJob, audit
from shared.schema import GroupMsg, decode, unpack_i32, unpack_u8
from tests.support.agents import CALC

TOKEN = "agent-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate(str(tiny_model))


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


def test_inject_into_a_redis_that_lost_the_job_writes_nothing(r) -> None:  # noqa: ANN001
    job = "inj-000002"  # its group opened before Redis lost everything: no ledger now
    with pytest.raises(UnknownJob, match="no ledger"):
        inject(r, job, "g1", [(keys.ready(job), b"x")], {"fed": 1, "produced": 1}, outcome="bus")
    assert list(r.scan_iter(match=keys.job_key_pattern(job))) == []


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
        spec=JobSpec(base_model=engine.tpl.model, group_size=2, agent={"enabled": True}, **spec),
        state="running",
        created_at=0.0,
        updated_at=0.0,
    )
    r.hset(keys.ledger(rec.id), mapping={"fed": 0, "trained": 0, "dead": 0})
    for stream, group in keys.job_streams(rec.id).items():
        r.xgroup_create(stream, group, id="0", mkstream=True)
    reg = CollectorRegistry()
    leases = Leases(engine, reg, 256)  # type: ignore[arg-type]
    srv = AgentServer(SimpleNamespace(redis=r, registry=reg), engine.tpl.model, leases, {rec.id: ServedJob(rec)})  # type: ignore[arg-type]
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


def test_a_group_whose_job_redis_lost_is_dropped_here_and_writes_nothing(tpl: ChatTemplate, r) -> None:  # noqa: ANN001
    srv, rec = scripted_server(r, ScriptedEngine(tpl, []), "lost-000001")
    g = srv.open_group(rec.id, {})
    r.flushall()  # Redis loses everything while the group is open
    g.deadline_at = 0.0  # its deadline passes: the worker drops it
    srv.step()  # raised UnknownJob out of the rollout loop before
    assert g.ended == "job_lost" and not any(e.id in srv.episodes for e in g.episodes)
    assert list(r.scan_iter(match=keys.job_key_pattern(rec.id))) == []
