"""The python tool: `run_program` in the real sandbox, the reward service's /v1/sandbox/run
(a real service process on a real Redis), and the "python" environment through both.

Nothing is mocked: every run is an isolated sandbox process. Skipped only where the
sandbox cannot isolate here (check_isolation says why), like tests/integration/test_sandbox.py.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.cli.launch import free_port
from shared.domain.envs import EnvError, make_env
from shared.domain.envs import python_tool as pt
from shared.domain.envs.python_tool import PythonEnv, ToolSettings
from shared.domain.sandbox import Limits, check_isolation, run_program
from shared.domain.tasks import get_task
from tests.support.launched import service_launcher

ok, why = check_isolation()
pytestmark = pytest.mark.skipif(not ok, reason=f"sandbox unavailable here: {why}")

TOKEN = "python-tool-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TIGHT = Limits(cpu_s=1, wall_s=4.0, max_output=1 << 16)


# -- run_program --------------------------------------------------------------------------
def test_run_program_prints_and_reads_stdin() -> None:
    r = run_program("print(2 + 3)\n", limits=TIGHT)
    assert (r.stdout, r.reason, r.detail) == ("5\n", "ok", "")
    assert 0 < r.seconds < TIGHT.wall_s
    r = run_program("a, b = map(int, input().split())\nprint(a * b)\n", "6 7", TIGHT)
    assert (r.stdout, r.reason) == ("42\n", "ok")


def test_run_program_reports_errors_with_what_was_printed() -> None:
    r = run_program("print('before')\n1 / 0\n", limits=TIGHT)
    assert r.reason == "runtime_error:ZeroDivisionError" and r.stdout == "before\n"
    assert r.detail == "ZeroDivisionError: division by zero"  # the traceback's last line
    r = run_program("def f(:\n", limits=TIGHT)
    assert r.reason == "syntax_error" and r.detail.startswith("SyntaxError")
    r = run_program("import sys\nprint(1)\nsys.exit(3)\n", limits=TIGHT)
    assert (r.stdout, r.reason) == ("1\n", "runtime_error:SystemExit")
    assert run_program("import sys\nprint(1)\nsys.exit(0)\n", limits=TIGHT).reason == "ok"


def test_run_program_limits() -> None:
    # CPU allowance above the wall clock, so the wall clock is what stops the loop.
    r = run_program("while True:\n    pass\n", limits=Limits(cpu_s=5, wall_s=1.5))
    assert r.reason == "wall_time_limit" and r.seconds < 5
    r = run_program("while True:\n    print('x' * 1000)\n", limits=Limits(max_output=10_000))
    assert r.reason == "output_limit" and len(r.stdout) <= 10_000
    r = run_program("import socket\nsocket.create_connection(('1.1.1.1', 53), 1)\n", limits=TIGHT)
    assert r.reason.startswith("runtime_error:")  # no network in the tool either


# -- the reward service's endpoint (a real process) ---------------------------------------
@pytest.fixture(scope="module")
def reward_url(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: ANN001
    """The reward service, started the way `burstrl up` starts it, with a real token."""
    home: Path = tmp_path_factory.mktemp("reward")
    settings = {
        "BURSTRL_REWARD_WORKERS": "0",  # no scoring processes: this test only calls the tool
        "BURSTRL_REWARD_TOOL_MAX_TIMEOUT_S": "5",
        "BURSTRL_REWARD_TOOL_CONCURRENCY": "1",  # so the concurrency test sees runs queue
    }
    with service_launcher(home, redis_server.url, TOKEN, **settings) as (launcher, env):
        port = free_port()
        launcher.start_service("reward", env, port=port)
        launcher.wait_ready(["reward"], timeout=60)
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_endpoint_runs_code(reward_url: str) -> None:
    body = {"code": "print(input()[::-1])", "stdin": "abc", "timeout_s": 3}
    r = httpx.post(f"{reward_url}/v1/sandbox/run", json=body, headers=AUTH, timeout=15)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["stdout"], got["reason"], got["detail"]) == ("cba\n", "ok", "")
    r = httpx.post(f"{reward_url}/v1/sandbox/run", json={"code": "[][1]", "timeout_s": 3}, headers=AUTH, timeout=15)
    assert r.json()["reason"] == "runtime_error:IndexError"
    # counted by outcome, the error by its kind only (callers name exception classes)
    metrics = httpx.get(f"{reward_url}/metrics", timeout=5).text
    assert 'burstrl_reward_tool_runs_total{reason="ok"}' in metrics
    assert 'burstrl_reward_tool_runs_total{reason="runtime_error"}' in metrics


@pytest.mark.slow
def test_endpoint_validates_and_requires_the_token(reward_url: str) -> None:
    url = f"{reward_url}/v1/sandbox/run"

    def field_of(resp: httpx.Response) -> str:
        assert resp.status_code == 422, resp.text
        return resp.json()["detail"][0]["loc"][-1]

    assert field_of(httpx.post(url, json={"code": "x" * 16_385}, headers=AUTH, timeout=15)) == "code"
    assert field_of(httpx.post(url, json={"code": "1", "stdin": "x" * 65_537}, headers=AUTH, timeout=15)) == "stdin"
    # over the service's cap (5 s here) although within the schema's absolute ceiling
    assert field_of(httpx.post(url, json={"code": "1", "timeout_s": 6}, headers=AUTH, timeout=15)) == "timeout_s"
    assert field_of(httpx.post(url, json={"code": "1", "memory_mb": 9999}, headers=AUTH, timeout=15)) == "memory_mb"
    assert httpx.post(url, json={"code": "print(1)"}, timeout=15).status_code == 401
    bad = {"Authorization": "Bearer not-the-token-0123456789"}
    assert httpx.post(url, json={"code": "print(1)"}, headers=bad, timeout=15).status_code == 401


@pytest.mark.slow
def test_endpoint_bounds_concurrency_without_blocking_the_server(reward_url: str) -> None:
    sleeper = {"code": "import time\ntime.sleep(1)\nprint('z')", "timeout_s": 4}
    results: list[httpx.Response] = []

    def call() -> None:
        results.append(httpx.post(f"{reward_url}/v1/sandbox/run", json=sleeper, headers=AUTH, timeout=15))

    t0 = time.monotonic()
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    # runs are in the threadpool / queued in the event loop: health still answers at once
    h0 = time.monotonic()
    assert httpx.get(f"{reward_url}/healthz", timeout=5).status_code == 200
    assert time.monotonic() - h0 < 0.5
    for t in threads:
        t.join()
    assert [r.json()["stdout"] for r in results] == ["z\n", "z\n"]
    assert time.monotonic() - t0 >= 2.0  # one slot (BURSTRL_REWARD_TOOL_CONCURRENCY=1): one after the other


@pytest.mark.slow
def test_endpoint_survives_forged_reports(reward_url: str) -> None:
    # A solution that wrote to the old report pipe (fd 4) made this route answer 500.
    for forged in ("b'[' * 100000", repr(b'{"i": 0, "ret": 5}\n')):
        code = f"import os\nprint('hi')\nos.write(4, {forged})\n"
        r = httpx.post(f"{reward_url}/v1/sandbox/run", json={"code": code, "timeout_s": 3}, headers=AUTH, timeout=15)
        assert r.status_code == 200, r.text
        assert r.json()["reason"] == "runtime_error:OSError" and r.json()["stdout"] == "hi\n", r.json()
    ok = httpx.post(f"{reward_url}/v1/sandbox/run", json={"code": "print(1)"}, headers=AUTH, timeout=15)
    assert ok.json()["stdout"] == "1\n"


@pytest.mark.slow
def test_a_tiny_timeout_ends_as_a_wall_time_limit_at_once(reward_url: str) -> None:
    # timeout_s=1e-9 used to hold the request 5 s: longer than the python tool waits for an
    # answer (timeout_s + 2 s), so the tool said "unavailable" instead of the limit.
    body = {"code": "print(1)", "timeout_s": 1e-9}
    r = httpx.post(f"{reward_url}/v1/sandbox/run", json=body, headers=AUTH, timeout=3)
    assert r.status_code == 200 and r.json()["reason"] == "wall_time_limit", r.text
    env = PythonEnv(tools=ToolSettings(sandbox_url=reward_url, api_key=TOKEN, timeout_s=1e-9))
    env.reset("", {})
    assert env.step("<python>print(1)</python>").observation == "<output>error: wall_time_limit</output>\n"


# -- the "python" environment --------------------------------------------------------------
def _remote(url: str, **kw: object) -> PythonEnv:
    env = PythonEnv(tools=ToolSettings(sandbox_url=url, api_key=TOKEN, timeout_s=2.0), **kw)  # type: ignore[arg-type]
    env.reset("2+3=", {})
    return env


@pytest.mark.slow
def test_env_through_the_reward_service(reward_url: str) -> None:
    env = _remote(reward_url)
    s = env.step("2+3=<python>print(2+3)</python>")
    assert s.observation == "<output>5</output>\n" and s.tool_call and not s.tool_error and not s.done
    # indented code is dedented; long output is cut for the context
    s = env.step("<python>\n    print('y' * 500)\n</python>")
    assert s.observation == f"<output>{'y' * 200}...</output>\n" and not s.tool_error
    s = env.step("<python>1/0</python>")
    assert s.observation == "<output>error: ZeroDivisionError</output>\n" and s.tool_error and not s.done
    # an empty final turn submits the last successful result
    env = _remote(reward_url)
    env.step("<python>print(2+3)</python>")
    s = env.step("")
    assert s.done and s.answer == "5"
    # a turn without a call is the answer as is
    assert _remote(reward_url).step("5").answer == "5"


@pytest.mark.slow
def test_env_limits_and_errors(reward_url: str) -> None:
    env = _remote(reward_url)
    s = env.step("<python>while True:\n    pass\n</python>")
    assert s.tool_error and s.observation in (
        "<output>error: wall_time_limit</output>\n",
        "<output>error: cpu_time_limit</output>\n",
    )
    s = env.step("<python>def f(:</python>")
    assert s.observation == "<output>error: SyntaxError</output>\n" and s.tool_error
    env = _remote(reward_url, max_calls=2)
    for _ in range(2):
        assert not env.step("<python>print(1)</python>").done
    s = env.step("<python>print(1)</python>")
    assert s.done and s.answer == "" and s.tool_call and s.tool_error
    # a wrong token is the operator's misconfiguration: the tool is unavailable, nothing raises
    env = PythonEnv(tools=ToolSettings(sandbox_url=reward_url, api_key="wrong-token-0123456789"))
    s = env.step("<python>print(1)</python>")
    assert s.observation == "<output>error: tool unavailable</output>\n" and s.tool_error and not s.done


@pytest.mark.slow
def test_env_reads_its_url_from_the_environment_only(reward_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BURSTRL_TOOLS_SANDBOX_URL", reward_url)
    monkeypatch.setenv("BURSTRL_TOKEN", TOKEN)  # the stack's token doubles as the tool's key
    monkeypatch.setattr(pt, "_settings", None)
    env = make_env("python", {"max_calls": 1})
    env.reset("", {})
    assert env.step("<python>print(6*7)</python>").observation == "<output>42</output>\n"


def test_a_job_cannot_choose_where_code_runs() -> None:
    for arg in ("sandbox_url", "tools", "api_key"):
        with pytest.raises(EnvError):
            make_env("python", {arg: "http://169.254.169.254"})


def test_unreachable_sandbox_is_a_tool_error_not_an_exception() -> None:
    env = PythonEnv(tools=ToolSettings(sandbox_url=f"http://127.0.0.1:{free_port()}", timeout_s=1.0))
    env.reset("", {})
    s = env.step("<python>print(1)</python>")
    assert s.observation == "<output>error: tool unavailable</output>\n"
    assert s.tool_call and s.tool_error and not s.done
    assert env.step("7").answer == "7"  # the episode carries on


def test_local_sandbox_when_no_url() -> None:
    env = PythonEnv(tools=ToolSettings(sandbox_url=""))
    env.reset("", {})
    assert env.step("<python>print(sum(range(10)))</python>").observation == "<output>45</output>\n"
    assert env.step("").answer == "45"


def test_bad_sandbox_url_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="http"):
        ToolSettings(sandbox_url="file:///etc/passwd")


def test_arith3py_demonstration_is_the_tools_format() -> None:
    task = get_task("arith3py")
    item = next(task.train_items(3))
    a, b = item.prompt.removesuffix("=").split("+")
    demo = task.demonstration(item, random.Random(0), 1.0)
    assert demo == f"<python>print({a}+{b})</python><output>{item.fields['answer']}</output>\n"
    assert task.demonstration(item, random.Random(0), 0.0) == item.fields["answer"]
    # the demonstrated episode, replayed through the environment (locally), earns the answer
    env = PythonEnv(tools=ToolSettings(sandbox_url=""))
    env.reset(item.prompt, item.fields)
    s = env.step(f"<python>print({a}+{b})</python>")
    assert s.observation == f"<output>{item.fields['answer']}</output>\n"
    assert task.score(env.step("").answer or "", item.fields)["correct"] == 1.0
