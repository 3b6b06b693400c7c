"""HTTP reward models: a JSON endpoint, or an OpenAI-compatible server used as a judge.

URLs come from the job payload, so the reward service only calls URLs under the
prefixes its operator allowed (BURSTRL_REWARD_HTTP_ALLOW, comma-separated): a job
must not be able to make the service probe its own network.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from shared.domain.verifiers.registry import Scored, VerifierError

ALLOW_ENV = "BURSTRL_REWARD_HTTP_ALLOW"


def _check_url(url: str | None) -> str:
    if not url:
        raise VerifierError("an HTTP verifier needs args.url")
    allowed = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    if not any(url.startswith(p) for p in allowed):
        raise VerifierError(
            f"{url!r} is not under a prefix in {ALLOW_ENV} ({allowed or 'empty'}); the operator must allow it"
        )
    return url


def _headers(api_key_env: str) -> dict[str, str]:
    # Secrets stay in the service's environment; the job names the variable, never the key.
    key = os.environ.get(api_key_env, "") if api_key_env else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_rm(
    completions: Sequence[str],
    url: str | None = None,
    prompt: str = "",
    timeout_s: float = 30.0,
    api_key_env: str = "",
    **fields: Any,
) -> list[float]:
    """POST {"prompt", "completions", "fields"} to url; the reply is {"rewards": [float, ...]}."""
    target = _check_url(url)
    ctx = {k: v for k, v in fields.items() if isinstance(v, str)}  # task fields only
    resp = httpx.post(
        target,
        json={"prompt": prompt, "completions": list(completions), "fields": ctx},
        headers=_headers(api_key_env),
        timeout=timeout_s,
    )
    resp.raise_for_status()
    rewards = resp.json().get("rewards")
    if not isinstance(rewards, list) or len(rewards) != len(completions):
        raise VerifierError(f"reward model at {target} must answer {{'rewards': [{len(completions)} numbers]}}")
    return [float(x) for x in rewards]


JUDGE_TEMPLATE = (
    "Rate the response to the question on a scale from 0 to 10. Reply with the number only.\n\n"
    "Question:\n{prompt}\n\nReference answer (may be empty):\n{answer}\n\nResponse:\n{completion}"
)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def openai_judge(
    completions: Sequence[str],
    url: str | None = None,
    model: str = "",
    prompt: str = "",
    answer: str = "",
    template: str = JUDGE_TEMPLATE,
    scale: float = 10.0,
    timeout_s: float = 60.0,
    api_key_env: str = "",
    **_: object,
) -> list[float]:
    """Score each completion with an OpenAI-compatible chat server (vLLM, ...): the first
    number in the reply, divided by `scale`, clipped to [0, 1]. url is the server base (.../v1)."""
    base = _check_url(url).rstrip("/")
    if not model:
        raise VerifierError("openai_judge needs args.model (the served model name)")
    out: list[float] = []
    with httpx.Client(timeout=timeout_s, headers=_headers(api_key_env)) as client:
        for c in completions:
            text = template.replace("{prompt}", prompt).replace("{answer}", answer).replace("{completion}", c)
            resp = client.post(
                f"{base}/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": text}],
                    "temperature": 0.0,
                    "max_tokens": 16,
                },
            )
            resp.raise_for_status()
            reply = resp.json()["choices"][0]["message"]["content"] or ""
            m = _NUMBER.search(reply)
            if not m:
                out.append(Scored(0.0, "judge_unparsable"))
                continue
            out.append(min(1.0, max(0.0, float(m.group()) / scale)))
    return out


def check_http_args(args: Mapping[str, Any]) -> None:
    # Which URLs are allowed is the reward service's setting (BURSTRL_REWARD_HTTP_ALLOW), so
    # the api checks only that there is one, of the right scheme.
    url = args.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise VerifierError(f"an HTTP verifier needs args.url (http:// or https://), got {url!r}", arg="url")
    for key in ("timeout_s", "scale"):
        v = args.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v <= 0:
            raise VerifierError(f"{key} must be above 0, got {v!r}", arg=key)


def check_judge_args(args: Mapping[str, Any]) -> None:
    check_http_args(args)
    if not isinstance(args.get("model"), str) or not args["model"]:
        raise VerifierError("openai_judge needs args.model (the served model name)", arg="model")
