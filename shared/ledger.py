"""The per-job ledger and its audit against what is physically in the streams.

Counters (a Redis hash per job, bumped in the same atomic step that moves an entry):
- `fed`: prompts the feeder put in the prompt stream (one per GRPO group);
- `produced`, `scored`, `refd`: groups handed on by rollout, reward and ref;
- `trained`: groups whose gradient effect is in a stored checkpoint;
- `dropped_<reason>`: groups the trainer discarded (stale, zero_variance, too_long, ...);
- `dead`: entries moved to the dead-letter stream.

Invariant (docs/architecture.md, invariant 3): fed = trained + dropped + dead + in flight. Because every
move is one server-side step (XADD downstream + XACK upstream + counter), a group is
at any instant in exactly one place: unacknowledged in one stage stream, or counted as
consumed. `audit()` checks that in one atomic snapshot: the in-flight figure the
counters imply must equal the entries pending or undelivered across the stage streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shared import keys

# KEYS: ledger, dead stream, then (stream) per stage; ARGV: the group reading each stage.
# Returns {ledger hash as a flat list, dead stream length, then (pending, undelivered) per stage}.
AUDIT_LUA = """
local out = {redis.call('HGETALL', KEYS[1]), redis.call('XLEN', KEYS[2])}
for i = 3, #KEYS do
  local pending, undelivered = 0, 0
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[i])
  if ok then
    for _, g in ipairs(groups) do
      local info = {}
      for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
      if info['name'] == ARGV[i - 2] then
        pending = tonumber(info['pending'])
        undelivered = #redis.call('XRANGE', KEYS[i], '(' .. info['last-delivered-id'], '+')
      end
    end
  end
  table.insert(out, pending)
  table.insert(out, undelivered)
end
return out
"""


class UnknownJob(KeyError):
    """audit() of a job whose ledger does not exist."""


def consumed(counters: dict[str, int]) -> int:
    """Groups that left the pipeline: trained, dropped for any reason, or dead-lettered."""
    dropped = sum(v for k, v in counters.items() if k.startswith("dropped_"))
    return counters.get("trained", 0) + counters.get("dead", 0) + dropped


@dataclass
class LedgerAudit:
    job_id: str
    counters: dict[str, int]
    in_streams: dict[str, int]  # stage -> entries pending or undelivered there
    dead_stream_len: int
    problems: list[str] = field(default_factory=list)

    @property
    def in_flight(self) -> int:
        return self.counters.get("fed", 0) - consumed(self.counters)

    @property
    def balanced(self) -> bool:
        return not self.problems


def audit(r: redis.Redis, job_id: str) -> LedgerAudit:
    """One atomic snapshot of a job's counters and streams, with any imbalance named."""
    stages = keys.job_streams(job_id)
    raw = r.eval(AUDIT_LUA, 2 + len(stages), keys.ledger(job_id), keys.dead_letter(job_id), *stages, *stages.values())
    flat = raw[0]
    if not flat:
        # Every job's ledger is created with the job: none means no such job here (or a Redis
        # that lost its data), never "balanced with nothing in it".
        raise UnknownJob(f"no ledger for job {job_id!r} in this Redis (unknown job, or Redis lost its data)")
    counters = {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
    names = [keys.stage_of_stream(s) for s in stages]
    in_streams = {name: int(raw[2 + 2 * i]) + int(raw[3 + 2 * i]) for i, name in enumerate(names)}
    a = LedgerAudit(job_id, counters, in_streams, int(raw[1]))
    physical = sum(in_streams.values())
    if a.in_flight != physical:
        a.problems.append(
            f"ledger says {a.in_flight} in flight (fed {counters.get('fed', 0)} - consumed {consumed(counters)}) "
            f"but the streams hold {physical} unacknowledged entries {in_streams}"
        )
    if counters.get("dead", 0) != a.dead_stream_len:
        a.problems.append(f"dead counter {counters.get('dead', 0)} != dead-letter stream length {a.dead_stream_len}")
    return a


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
