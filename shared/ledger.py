"""The per-job ledger and its audit against what is physically in the streams.

Counters (a Redis hash per job, bumped in the same atomic step that moves an entry):
- `fed`: prompts the feeder put in the prompt stream (one per GRPO group);
- `produced`, `scored`, `refd`: groups handed on by rollout, reward and ref;
- `trained`: groups whose gradient effect is in a stored checkpoint;
- `dropped_<reason>`: groups the trainer discarded (stale, zero_variance, too_long, ...);
- `dead`: entries moved to the dead-letter stream;
- `spilled`: ready groups moved into the backlog's disk segments (shared/backlog.py), still in
  flight; `backlog_done`: groups that left a segment (trained, dropped or dead-lettered);
  `backlog_bytes`: the bytes of the indexed segments (a running total, not a counter).

Invariant (docs/architecture.md, invariant 3): fed = trained + dropped + dead + in flight. Because every
move is one server-side step (XADD downstream + XACK upstream + counter), a group is
at any instant in exactly one place: unacknowledged in one stage stream, or counted as
consumed. `audit()` checks that in one atomic snapshot: the in-flight figure the
counters imply must equal the entries pending or undelivered across the stage streams plus
the groups `remaining` in the backlog's indexed segments, and spilled - backlog_done must
equal those remaining.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shared import keys

# KEYS: ledger, dead stream, backlog index, then (stream) per stage; ARGV: the group reading each
# stage. Returns {ledger hash as a flat list, dead stream length, groups remaining in indexed
# segments, their bytes, then (pending, undelivered) per stage}.
AUDIT_LUA = """
local backlog, bytes = 0, 0
for _, raw in ipairs(redis.call('HVALS', KEYS[3])) do
  local seg = cjson.decode(raw)
  backlog, bytes = backlog + seg['remaining'], bytes + seg['bytes']
end
local out = {redis.call('HGETALL', KEYS[1]), redis.call('XLEN', KEYS[2]), backlog, bytes}
for i = 4, #KEYS do
  local pending, undelivered = 0, 0
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[i])
  if ok then
    for _, g in ipairs(groups) do
      local info = {}
      for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
      if info['name'] == ARGV[i - 3] then
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


def init_ledger(pipe: redis.client.Pipeline, job_id: str, settled: int = 0) -> None:
    """Queue the ledger of a job that starts with `settled` groups already trained (0 for a new job;
    a job registered again from the store after Redis lost it starts from its checkpoint's count,
    with every earlier stage balanced against it, so the invariant holds from the first audit)."""
    n = max(0, settled)
    pipe.hset(keys.ledger(job_id), mapping={"fed": n, "produced": n, "scored": n, "trained": n, "dead": 0})


def count(r: redis.Redis | redis.client.Pipeline, job_id: str, counter: str, n: int = 1) -> None:
    """`counter += n` outside the bus's scripts: the trainer's `segments_refused`, a tally no entry
    moves with (the feeder's `fed` moves with its prompts, in shared/bus.py's `feed`)."""
    r.hincrby(keys.ledger(job_id), counter, n)


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
    in_backlog: int = 0  # groups remaining in the backlog's indexed segments
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
    raw = r.eval(
        AUDIT_LUA,
        3 + len(stages),
        keys.ledger(job_id),
        keys.dead_letter(job_id),
        keys.backlog_index(job_id),
        *stages,
        *stages.values(),
    )
    flat = raw[0]
    if not flat:
        # Every job's ledger is created with the job: none means no such job here (or a Redis
        # that lost its data), never "balanced with nothing in it".
        raise UnknownJob(f"no ledger for job {job_id!r} in this Redis (unknown job, or Redis lost its data)")
    counters = {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
    names = [keys.stage_of_stream(s) for s in stages]
    in_streams = {name: int(raw[4 + 2 * i]) + int(raw[5 + 2 * i]) for i, name in enumerate(names)}
    a = LedgerAudit(job_id, counters, in_streams, int(raw[1]), int(raw[2]))
    physical = sum(in_streams.values()) + a.in_backlog
    if a.in_flight != physical:
        a.problems.append(
            f"ledger says {a.in_flight} in flight (fed {counters.get('fed', 0)} - consumed {consumed(counters)}) "
            f"but the streams hold {sum(in_streams.values())} unacknowledged entries {in_streams} "
            f"and the backlog's segments {a.in_backlog} groups"
        )
    spilled_left = counters.get("spilled", 0) - counters.get("backlog_done", 0)
    if spilled_left != a.in_backlog:
        a.problems.append(
            f"spilled {counters.get('spilled', 0)} - backlog_done {counters.get('backlog_done', 0)} = {spilled_left} "
            f"but the backlog's indexed segments hold {a.in_backlog} groups"
        )
    if counters.get("backlog_bytes", 0) != int(raw[3]):
        a.problems.append(
            f"backlog_bytes {counters.get('backlog_bytes', 0)} != the indexed segments' {int(raw[3])} bytes"
        )
    if counters.get("dead", 0) != a.dead_stream_len:
        a.problems.append(f"dead counter {counters.get('dead', 0)} != dead-letter stream length {a.dead_stream_len}")
    return a


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x
