"""A job's agent block (`JobSpec.agent`): groups come from agents over an OpenAI-compatible API.

Off by default: the feeder feeds the job's task as always. On, the feeder feeds nothing; the
rollout service serves `/v1/jobs/{job}/episodes/{episode}/openai/v1/...` (docs/agents.md),
an agent drives each episode through a chat client and closes it with a reward or hands
it to the job's verifiers, and the rollout service puts each finished group on the bus.
"""

from __future__ import annotations

from pydantic import Field

from shared.limits import AGENT_MAX_TURNS, SpecModel


class AgentSpec(SpecModel):
    enabled: bool = Field(
        False,
        description="Groups come from agents over the rollout service's OpenAI-compatible endpoint (docs/agents.md); "
        "the feeder feeds this job no prompts.",
    )
    deadline_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="A group whose episodes are not all closed (rewarded or handed to the verifier) this long after "
        "it was opened is dropped (ledger dropped_agent_deadline), and its leases on the policy version freed.",
    )
    max_turns: int = Field(
        16, ge=1, le=AGENT_MAX_TURNS, description="Model turns (chat or completion calls) per episode."
    )
