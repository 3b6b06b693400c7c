"""The Python tool environment ("python") and its companion task, 3-digit sums ("arith3py").

A model turn that contains `<python>CODE</python>` calls the tool: CODE runs as a
program in the code sandbox (shared/domain/sandbox: namespaces, no network, rlimits) and the
episode continues with what it printed, stripped and cut to 200 characters:

    123+456=<python>print(123+456)</python><output>579</output>      (prompt, turn 1, observation)
    579<eos>                                                          (turn 2: the answer)

A failed run answers `<output>error: Kind</output>` (ZeroDivisionError, SyntaxError,
wall_time_limit, ...; a tool error), and so does an unreachable sandbox (`error: tool
unavailable`): the episode goes on, nothing is raised into the rollout service. A turn
without a tool call is the final answer; `max_calls` and `submit_last_result` work as
in the calculator environment (shared/domain/envs/calc.py).

Where the code runs is the rollout service's own setting, never a job's: with
BURSTRL_TOOLS_SANDBOX_URL set, on the reward service (POST /v1/sandbox/run, which
already hosts the sandbox and its isolation); empty, in this process's own sandbox
(single-box development). A job's env args reach only `max_calls`,
`submit_last_result` and `tool_error_penalty`, so a job cannot point the tool at another host.
"""

from __future__ import annotations

import logging
import random
import re
import textwrap
import threading
from dataclasses import dataclass

import httpx
from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.domain.envs.base import StepResult, ToolEnv
from shared.domain.envs.calc import Arith3Task
from shared.domain.sandbox import Limits, ProgramResult, SandboxUnavailable, run_program
from shared.domain.tasks.base import TaskItem

log = logging.getLogger(__name__)

MAX_OBSERVATION_CHARS = 200  # of the program's stripped stdout, per call: the context is small
MAX_CODE_CHARS = 16 * 1024  # the reward service's own bound (services/reward/tool_api.py)
LOCAL_MAX_OUTPUT = 64 * 1024  # local runs keep as much stdout as the service does by default
UNAVAILABLE = "tool unavailable"


class ToolSettings(BaseSettings):
    """`BURSTRL_TOOLS_*`: where tool calls run (the rollout service's environment, never a job's)."""

    model_config = SettingsConfigDict(
        env_prefix="BURSTRL_TOOLS_", extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    sandbox_url: str = Field(
        "",
        description="Base URL of the reward service that runs tool code (http://reward:8702); empty runs it "
        "in this process's own sandbox.",
    )
    api_key: SecretStr = Field(
        SecretStr(""),
        # The stack shares one token between services: the rollout's BURSTRL_TOKEN is the reward's too.
        validation_alias=AliasChoices("BURSTRL_TOOLS_API_KEY", "BURSTRL_TOKEN"),
        description="Bearer token of the reward service (defaults to BURSTRL_TOKEN).",
    )
    timeout_s: float = Field(3.0, gt=0, le=120, description="Wall-clock limit of one tool run.")

    @field_validator("sandbox_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if v and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", v):
            raise ValueError("sandbox_url must be an http(s) URL, e.g. http://127.0.0.1:8702")
        return v


_settings: ToolSettings | None = None
_clients: dict[tuple[str, float], httpx.Client] = {}
_lock = threading.Lock()


def tool_settings() -> ToolSettings:
    """The process's tool settings, read once from the environment."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = ToolSettings()
        return _settings


def _client(url: str, timeout_s: float) -> httpx.Client:
    # One pooled client per process and target: episodes are many and short, so a connection
    # per call would cost more than the run. httpx.Client is safe to share between threads.
    key = (url, timeout_s)
    with _lock:
        if key not in _clients:
            # The run's own limit plus room for the sandbox's start-up and the round trip.
            _clients[key] = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s + 2.0, connect=2.0))
        return _clients[key]


def run_tool(code: str, settings: ToolSettings) -> ProgramResult | None:
    """Run `code` where the settings say; None when the tool could not run at all."""
    if not settings.sandbox_url:
        t = settings.timeout_s
        try:
            return run_program(code, "", Limits.for_program(t, LOCAL_MAX_OUTPUT))
        except SandboxUnavailable as e:
            log.warning("python tool: local sandbox unavailable: %s", e)
            return None
    key = settings.api_key.get_secret_value()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = _client(settings.sandbox_url, settings.timeout_s).post(
            "/v1/sandbox/run", json={"code": code, "stdin": "", "timeout_s": settings.timeout_s}, headers=headers
        )
    except httpx.HTTPError as e:
        log.warning("python tool: %s unreachable: %s", settings.sandbox_url, e)
        return None
    if r.status_code != 200:
        # 5xx: sandbox down or busy; 401/422: a misconfiguration the operator must see. Either
        # way the model did nothing wrong that it could learn from: "unavailable", not its error.
        log.warning("python tool: %s answered %d: %s", settings.sandbox_url, r.status_code, r.text[:200])
        return None
    try:
        body = r.json()
        return ProgramResult(
            stdout=str(body["stdout"]),
            reason=str(body["reason"]),
            detail=str(body.get("detail", "")),
            seconds=float(body.get("seconds", 0.0)),
        )
    except (ValueError, KeyError, TypeError) as e:
        log.warning("python tool: bad answer from %s: %s", settings.sandbox_url, e)
        return None


def _error_kind(res: ProgramResult) -> str:
    """What the model is told went wrong: the exception's name, or the limit it hit."""
    if res.reason.startswith("runtime_error:"):
        return res.reason.split(":", 1)[1]
    if res.reason == "syntax_error":
        return res.detail.split(":", 1)[0] or "SyntaxError"  # "IndentationError" stays itself
    return res.reason


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_OBSERVATION_CHARS else text[:MAX_OBSERVATION_CHARS] + "..."


class PythonEnv(ToolEnv):
    """Tool calls `<python>CODE</python>`, answered `<output>stdout</output>`; see ToolEnv for
    the episode rules (final answer, submit_last_result, max_calls, tool_error_penalty)."""

    name = "python"

    def __init__(
        self,
        max_calls: int = 3,
        submit_last_result: bool = True,
        tool_error_penalty: float = 0.0,
        *,
        tools: ToolSettings | None = None,
    ) -> None:
        super().__init__(
            "<python>",
            "</python>",
            max_calls=max_calls,
            submit_last_result=submit_last_result,
            tool_error_penalty=tool_error_penalty,
        )
        self.tools = tools

    def call(self, arg: str) -> StepResult:
        # Models often indent or pad the block; a program starts at column 0.
        code = textwrap.dedent(arg).strip()
        if len(code) > MAX_CODE_CHARS:
            return self._error("code too long")
        try:
            res = run_tool(code, self.tools or tool_settings())
        except Exception:  # noqa: BLE001 - a tool failure is an observation, never the rollout's crash
            log.exception("python tool: unexpected failure")
            res = None
        if res is None:
            return self._error(UNAVAILABLE)
        if res.reason != "ok":
            return self._error(_error_kind(res))
        out = _clip(res.stdout)
        return self.result(out, f"<output>{out}</output>\n")

    def _error(self, kind: str) -> StepResult:
        return self.failed(f"<output>error: {kind}</output>\n")


def python_env(max_calls: int = 3, submit_last_result: bool = True, tool_error_penalty: float = 0.0) -> PythonEnv:
    """The registered factory (shared/domain/catalog.py): a job's env args reach only these (never the
    tool's URL or key)."""
    return PythonEnv(max_calls=max_calls, submit_last_result=submit_last_result, tool_error_penalty=tool_error_penalty)


# -- the companion task ---------------------------------------------------------------------
@dataclass
class Arith3PyTask(Arith3Task):
    """The "arith3" task (same items, same verifier), with demonstrations in the python tool's format."""

    name: str = "arith3py"

    def demonstration(self, item: TaskItem, rng: random.Random, correct_fraction: float) -> str:
        """An SFT target, as Arith3Task's: with probability correct_fraction a tool call and its
        output (then an empty turn submits that output as the answer), else a direct answer."""
        a, b = item.prompt.removesuffix("=").split("+")
        answer = item.fields["answer"]
        if rng.random() < correct_fraction:
            return f"<python>print({a}+{b})</python><output>{answer}</output>\n"
        return answer
