"""reasoning-gym tasks through the real services: api (validation, feeder) and reward (scoring).

redis-server, the api and the reward service run as separate processes; jobs go in over
HTTP. The test stands in for rollout only: it reads the prompts the api fed, answers each
one three ways (the item's own answer in tags, a wrong answer, no tags) and puts the group
on the rollouts stream; the reward service scores it in its worker processes, from the
prompt's JSON fields alone, and forwards it to the ready stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from services.cli.launch import Launcher, free_port
from shared import keys
from shared.bus import FIELD
from shared.schema import Completion, GroupMsg, PromptMsg, decode, encode, pack_f32, pack_i32, pack_u8
from tests.support.stack import service_env

TOKEN = "rg-reward-test-token-0123456789"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
# Five categories: arithmetic, algorithmic, games (a scorer that evaluates the answer against the
# entry's metadata), graphs, logic; ARC (boards compared as tuples); and a raw answer with a template.
JOBS = {
    "chain_sum": {"task_spec": {"args": {"min_terms": 2, "max_terms": 3}}},
    "spell_backward": {},
    "countdown": {},
    "family_relationships": {},
    "syllogism": {},
    "rearc": {},
    "basic_arithmetic": {
        "task_spec": {"args": {"operators": ["+", "-"], "answer_format": "raw"}, "template": "{expression}="}
    },
}
WRONG = "not the answer"
pytestmark = pytest.mark.slow  # two services and seven jobs: minutes on a busy 2-core box


@pytest.fixture
def stack(r, redis_server, tmp_path) -> Iterator[str]:
    launcher = Launcher(tmp_path / "run")
    env = service_env(
        redis_server.url,
        tmp_path,
        TOKEN,
        BURSTRL_REWARD_WORKERS="2",  # scoring in spawned processes: entries cross as JSON
    )
    api_port = free_port()
    launcher.start_service("api", env, port=api_port)
    launcher.start_service("reward", env, port=free_port())
    try:
        launcher.wait_ready(["api", "reward"], timeout=120)
        yield f"http://127.0.0.1:{api_port}"
    finally:
        launcher.stop_all()


def submit(api: str, dataset: str, extra: dict) -> httpx.Response:
    spec = {"name": "rg", "base_model": "m", "task": f"rg:{dataset}", "batch_size": 2, "max_staleness": 0, **extra}
    return httpx.post(f"{api}/v1/jobs", json=spec, headers=HEADERS, timeout=120)


def wait(pred, timeout: float, what: str):  # noqa: ANN001
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def completion(text: str) -> Completion:
    return Completion(
        token_ids=pack_i32([5, 6]), logprobs=pack_f32([-1.0, -1.0]), loss_mask=pack_u8([1, 1]), text=text,
        finish_reason="stop",
    )  # fmt: skip


def answers(p: PromptMsg, dataset: str) -> list[str]:
    gold = p.fields["answer"]
    if dataset == "basic_arithmetic":  # answer_format = "raw": the whole completion is the answer
        return [f" {gold}", WRONG, ""]
    return [f"So: <answer>{gold}</answer>", f"<answer>{WRONG}</answer>", gold]


def test_bad_rg_jobs_get_422_naming_the_field_and_choices(stack) -> None:
    resp = submit(stack, "chain_sun", {})
    assert resp.status_code == 422, resp.text
    d = resp.json()["detail"][0]
    assert d["loc"] == ["body", "task"] and "rg:chain_sum" in d["msg"] and "'spell_backward'" in d["msg"]
    for args, loc, words in [
        ({"terms": 2}, ["args", "terms"], ["unknown option 'terms'", "'max_terms'"]),
        ({"min_terms": "two"}, ["args", "min_terms"], ["min_terms must be an integer"]),
        ({"min_terms": 0}, ["args"], ["min_terms must be positive"]),  # rg's validate(): the options as a whole
        # Checked by generating items (in a child process under a deadline).
        ({"min_terms": 5000, "max_terms": 5000}, [], ["could not generate", "characters"]),
    ]:
        resp = submit(stack, "chain_sum", {"task_spec": {"args": args}})
        assert resp.status_code == 422, (args, resp.text)
        d = resp.json()["detail"][0]
        assert d["loc"] == ["body", "task_spec", *loc], d
        assert all(w in d["msg"] for w in words), d["msg"]
    resp = submit(stack, "chain_sum", {"task_spec": {"args": {"seed": 1, "x": [1] * 300}}})
    assert resp.status_code == 422  # bounds of the args themselves


def test_datasets_score_through_the_reward_service(stack, r) -> None:
    jobs = {}
    for dataset, extra in JOBS.items():
        resp = submit(stack, dataset, extra)
        assert resp.status_code == 201, (dataset, resp.text)
        jobs[dataset] = resp.json()["id"]
    for dataset, job_id in jobs.items():
        fed = wait(lambda j=job_id: r.xrange(keys.prompts(j)), 120, f"prompts of {dataset}")
        for _, entry in fed:
            p = decode(entry[FIELD], PromptMsg)
            assert p.item_id.startswith(f"rg:{dataset}:") and "rg_entry" in p.fields
            if dataset == "basic_arithmetic":
                assert p.prompt == p.fields["expression"] + "="
            else:
                assert p.prompt.endswith("<answer> and </answer>.")
            group = GroupMsg(
                job_id=job_id,
                group_id=p.group_id,
                item_id=p.item_id,
                prompt=p.prompt,
                prompt_ids=pack_i32([1, 2, 3]),
                fields=p.fields,
                policy_version=0,
                completions=[completion(t) for t in answers(p, dataset)],
            )
            r.xadd(keys.rollouts(job_id), {FIELD: encode(group)})
    for dataset, job_id in jobs.items():
        n = len(r.xrange(keys.prompts(job_id)))
        ready = wait(lambda j=job_id, n=n: len(r.xrange(keys.ready(j))) >= n and r.xrange(keys.ready(j)), 180, dataset)
        for _, entry in ready:
            g = decode(entry[FIELD], GroupMsg)
            gold, wrong, untagged = g.completions
            assert gold.reward == 1.0 and gold.reward_parts == {"correct": 1.0}, (dataset, g.fields["answer"])
            assert wrong.reward < 1.0, dataset
            if dataset == "basic_arithmetic":
                assert untagged.reward == 0.0
            else:
                assert untagged.reward == 0.0 and "correct!no_answer" in untagged.reward_parts, dataset
        assert r.xlen(keys.dead_letter(job_id)) == 0
        assert int(r.hget(keys.ledger(job_id), "scored")) == n
