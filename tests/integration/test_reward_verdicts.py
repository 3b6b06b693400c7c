"""Issue 44 items 2 and 4, issue 47 item 4, through a real reward service process on a real Redis:
one completion's overflow scores that completion alone; a program's output that is not UTF-8
comes back from /v1/sandbox/run encodable, and says so; tags drawn from completions stay bounded
in length and in number per job, in the scored groups, the job's metric points and /metrics."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.cli.launch import free_port
from shared import keys
from shared.bus import FIELD, Bus
from shared.domain.sandbox import check_isolation
from shared.domain.verifiers.combine import TAGS_PER_JOB
from shared.job import JobRecord, JobSpec, JobState, insert_job
from shared.metrics import read_points
from shared.schema import Completion, GroupMsg, decode, encode, pack_f32, pack_i32, pack_u8
from tests.support.launched import service_launcher
from tests.support.stack import wait_for

ok, why = check_isolation()
pytestmark = pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}")

TOKEN = "reward-verdicts-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A verifier whose reason is the completion's own text, as a careless plugin's might be.
ECHO_PLUGIN = """\
from shared.domain.verifiers import Scored, register_verifier

@register_verifier("echo_reason")
def echo_reason(completions, **_):
    return [Scored(0.0, c) for c in completions]
"""


@pytest.fixture(scope="module")
def reward(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, redis.Redis]]:  # noqa: ANN001
    """The reward service with one scoring process, and a client of its Redis."""
    home: Path = tmp_path_factory.mktemp("reward")
    (home / "echo_plugin.py").write_text(ECHO_PLUGIN)
    settings = {
        "BURSTRL_REWARD_WORKERS": "1",
        "BURSTRL_REWARD_PLUGINS": "echo_plugin",
        "PYTHONPATH": os.pathsep.join([str(home), os.environ.get("PYTHONPATH", "")]),
    }
    with service_launcher(home, redis_server.url, TOKEN, **settings) as (launcher, env):
        port = free_port()
        launcher.start_service("reward", env, port=port)
        launcher.wait_ready(["reward"], timeout=120)
        yield f"http://127.0.0.1:{port}", redis_server.client()


def _job(r: redis.Redis, **spec: object) -> JobRecord:
    now = time.time()
    rec = JobRecord(
        id=f"verdict-{os.urandom(3).hex()}",
        spec=JobSpec(base_model="org/none", **spec),
        state=JobState.running,
        created_at=now,
        updated_at=now,
    )
    Bus.ensure_groups(r, rec.id)
    insert_job(r, rec)
    r.sadd(keys.active_jobs(), rec.id)
    return rec


def _score(r: redis.Redis, rec: JobRecord, texts: list[str], fields: dict[str, str], gid: str = "g") -> GroupMsg:
    """Put one group of `texts` on the job's rollouts stream; the group the reward service hands on."""
    group = GroupMsg(
        job_id=rec.id,
        group_id=gid,
        item_id="i",
        prompt="p",
        prompt_ids=pack_i32([1]),
        fields=fields,
        policy_version=0,
        completions=[
            Completion(
                token_ids=pack_i32([1]), logprobs=pack_f32([-1.0]), loss_mask=pack_u8([1]), text=t, finish_reason="stop"
            )
            for t in texts
        ],
        sampled_at=time.time(),
    )
    r.xadd(keys.rollouts(rec.id), {FIELD: encode(group)})

    def scored() -> GroupMsg | None:
        for _, f in r.xrange(keys.ready(rec.id)):
            g = decode(f[FIELD], GroupMsg)
            if g.group_id == gid:
                return g
        return None

    return wait_for(scored, 60, f"group {gid} of {rec.id} scored")


@pytest.mark.slow
def test_an_overflowing_completion_costs_its_siblings_nothing(reward: tuple[str, redis.Redis]) -> None:
    _, r = reward
    rec = _job(r, task="code")
    tests = [{"call": "half", "args": [3], "expected": 1.5}, {"call": "half", "args": [7], "expected": 3.5}]
    right = "```python\ndef half(x):\n    return x / 2\n```"
    texts = [right, "```python\ndef half(x):\n    return 10 ** 400\n```", right, "def half(x):\n    return x"]
    g = _score(r, rec, texts, {"tests": json.dumps(tests)})
    assert [c.reward for c in g.completions] == [1.0, 0.0, 1.0, 0.0], [c.reward_parts for c in g.completions]
    assert not any("error" in k for c in g.completions for k in c.reward_parts), [c.reward_parts for c in g.completions]


@pytest.mark.slow
def test_tags_from_completions_are_bounded(reward: tuple[str, redis.Redis]) -> None:
    url, r = reward
    rec = _job(r, task_spec={"verifiers": [{"name": "echo_reason", "part": "echo"}]})
    # a reason of 100,000 characters, one with characters no label should hold, then more distinct ones
    # than a job may show
    long_ = "x" * 100_000
    texts = [long_, "a b\n{}", *(f"r{i}" for i in range(TAGS_PER_JOB + 10))]
    g = _score(r, rec, texts, {})
    tags = [k for c in g.completions for k in c.reward_parts if "!" in k]
    assert tags[:2] == ["echo!other", "echo!other"], tags[:2]
    assert len(set(tags)) == TAGS_PER_JOB + 1  # the first TAGS_PER_JOB distinct ones, and "other"
    assert all(len(t) <= 70 for t in tags)
    # A later group of the same job adds no new tag, however new its reasons are.
    g = _score(r, rec, ["brand-new", "r0"], {}, gid="g2")
    assert [list(c.reward_parts) for c in g.completions] == [["echo", "echo!other"], ["echo", "echo!r0"]]
    # The job's metric points and the service's label carry the same bounded set.
    point = wait_for(lambda: read_points(r, rec.id, "reward"), 30, "a reward metric point")[0]
    assert set(point["reward_tags"]) <= {*tags} and "echo!other" in point["reward_tags"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert "x" * 100 not in metrics and 'tag="echo!other"' in metrics


@pytest.mark.slow
def test_sandbox_run_answers_output_that_is_not_utf8(reward: tuple[str, redis.Redis]) -> None:
    url, _ = reward
    run = f"{url}/v1/sandbox/run"
    # The program printed a lone surrogate: the route answered 500 and counted the run "ok".
    r = httpx.post(run, json={"code": 'print("a")\nprint("b\\ud800c")', "timeout_s": 5}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert (r.json()["stdout"], r.json()["reason"]) == ("a\n", "runtime_error:UnicodeEncodeError")
    code = "import sys\nsys.stdout.buffer.write(b'x\\xffy')\nraise ValueError('bad \\udcff')"
    r = httpx.post(run, json={"code": code, "timeout_s": 5}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["stdout"], got["replaced"], got["detail"]) == ("x\ufffdy", 1, "ValueError: bad \ufffd"), got
    r = httpx.post(run, json={"code": "import sys\nsys.stdout.buffer.write(b'\\xfe')", "timeout_s": 5}, headers=AUTH)
    assert r.json()["reason"] == "ok" and "not valid UTF-8" in r.json()["detail"], r.json()
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'burstrl_reward_tool_runs_total{reason="runtime_error"} 2.0' in metrics
    # A lone surrogate escape in the request itself: a 422 that says so (the reward service's
    # errors are made where every service's are).
    body = b'{"code": "print(input())", "stdin": "\\ud800", "timeout_s": 5}'
    r = httpx.post(run, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "lone_surrogate", r.text
