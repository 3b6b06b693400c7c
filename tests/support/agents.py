"""What the agent tests share: the calculator tool as an OpenAI function definition, and a
service stack with an agent job submitted (dev mode, a bearer token, a file store)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.stack import ServiceStack, service_stack

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


@dataclass
class AgentStack:
    """The running stack, the headers that authenticate to it, the submitted spec and its job id."""

    stack: ServiceStack
    auth: dict[str, str]
    spec: dict[str, Any]
    job: str

    @property
    def api(self) -> str:
        return self.stack.api

    @property
    def rollout(self) -> str:
        return self.stack.url("rollout")


@contextmanager
def agent_stack(
    tmp_path: Path, tiny_model: Path, roles: Sequence[str], token: str, **spec: Any
) -> Iterator[AgentStack]:
    """`roles` on a fresh Redis with `token` as the bearer token, and a job of `base_model`
    `tiny_model` plus `spec` submitted (it must be accepted: 201)."""
    with service_stack(
        tmp_path,
        tiny_model,
        roles,
        env_extra={"BURSTRL_DEV": "1", "BURSTRL_TOKEN": token},
        store_url=f"file://{tmp_path / 'store'}",
    ) as stack:
        auth = {"Authorization": f"Bearer {token}"}
        full = {"base_model": str(tiny_model), **spec}
        resp = httpx.post(f"{stack.api}/v1/jobs", json=full, headers=auth, timeout=30)
        assert resp.status_code == 201, resp.text
        yield AgentStack(stack, auth, full, resp.json()["id"])
