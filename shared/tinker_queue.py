"""The Tinker API's queues in Redis: training calls (api -> trainer) and sample calls (api -> rollout).

docs/tinker.md. Every training call of a Tinker model carries a `seq_id` the SDK numbers from
its training client, and calls must be applied in that order. The api enqueues a call with
`enqueue_call`, one script that checks the seq_id against what the model has received (a
repeat with the same digest is the same request; another request under a used seq_id, or one
too far ahead, is refused) and appends it to the model's call stream. The SDK may send the
chunks of one forward_backward out of order, so the stream's order is arrival, not seq: the
trainer buffers what it reads and applies `applied + 1` next.

Exactly-once, the burstrl way (docs/architecture.md, invariant 2): a call stays in the stream
until a checkpoint holding its effect is in the store (`checkpointed` removes it); a trainer
that starts restores the newest checkpoint and applies the calls after it again, in order, so
each call's effect is in the weights once. Results are written by the lease holder only
(`write_result` is fenced, invariant 10); a replayed call writes the same result again.

Sample calls go to a stream per model read by the rollout replicas' consumer group; a replica
writes the result and acknowledges the entry in one script.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
import redis.asyncio

from shared import keys
from shared.lease import FENCE_CHECK, Fence, LeaseLost
from shared.schema import SampleCall, SampleResult, TinkerCall, TinkerResult, decode_tinker, encode
from shared.slots import read_streams

# How far ahead of the lowest seq_id not yet received a call may be: the SDK keeps a few
# requests in flight (the chunks of one forward_backward, the optim_step behind them); a
# seq_id thousands ahead is a client bug, refused before it can hold a slot forever.
SEQ_WINDOW = 1024
# Results (and seq digests) kept below the newest checkpoint, for clients that retry a
# retrieve: older ones are pruned with the calls they answer.
KEEP_BELOW_CHECKPOINT = 1024
DONE_TTL_S = 120  # the long poll's wake-up token outlives any poll waiting for it
# A sample call's result waits this long for its client (which reads it at once, retrying on
# a lost answer); then it expires: nothing else holds it.
SAMPLE_RESULT_TTL_S = 3600


class SeqRefused(ValueError):
    """A training call's seq_id cannot be taken: `reason` says why (the api answers 409/400)."""


# KEYS: calls stream, seqs hash, state hash. ARGV: seq, digest, encoded call, window.
# Returns 1 (a repeat of the call under this seq), 0 (appended), -1 (seq used by another
# call), -2 (seq below the pruned history), -3 (seq too far ahead), -4 (no such model).
ENQUEUE_LUA = """
if redis.call('EXISTS', KEYS[3]) == 0 then return -4 end
local seen = redis.call('HGET', KEYS[2], ARGV[1])
if seen then
  if seen == ARGV[2] then return 1 end
  return -1
end
local seq = tonumber(ARGV[1])
local nxt = tonumber(redis.call('HGET', KEYS[3], 'next') or '0')
if seq < nxt then return -2 end
if seq >= nxt + tonumber(ARGV[4]) then return -3 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('XADD', KEYS[1], '*', 'seq', ARGV[1], 'call', ARGV[3])
while redis.call('HEXISTS', KEYS[2], tostring(nxt)) == 1 do nxt = nxt + 1 end
redis.call('HSET', KEYS[3], 'next', nxt)
return 0
"""

# KEYS: lease, results hash, state hash, done list. ARGV: fence value, seq, encoded result, ttl s.
# Writes the result, raises `applied`, wakes the long poll. -1 when the caller lost the lease.
RESULT_LUA = (
    FENCE_CHECK
    + """
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
local applied = tonumber(redis.call('HGET', KEYS[3], 'applied') or '-1')
if tonumber(ARGV[2]) > applied then redis.call('HSET', KEYS[3], 'applied', ARGV[2]) end
redis.call('DEL', KEYS[4])
redis.call('RPUSH', KEYS[4], '1')
redis.call('EXPIRE', KEYS[4], ARGV[4])
return 1
"""
)

# KEYS: lease, calls stream, state hash, results hash, seqs hash. ARGV: fence value, seq,
# keep, then the stream ids of the calls the checkpoint holds. Removes them, records the
# checkpoint, prunes results and digests `keep` below it. -1 when the caller lost the lease.
CHECKPOINTED_LUA = (
    FENCE_CHECK
    + """
local seq = tonumber(ARGV[2])
for i = 4, #ARGV do redis.call('XDEL', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[3], 'checkpointed', seq)
local floor = seq - tonumber(ARGV[3])
if floor > 0 then
  for _, h in ipairs({KEYS[4], KEYS[5]}) do
    for _, f in ipairs(redis.call('HKEYS', h)) do
      if tonumber(f) and tonumber(f) < floor then redis.call('HDEL', h, f) end
    end
  end
end
return 1
"""
)

# KEYS: result key, samples stream, done list. ARGV: encoded result, result ttl s, group, entry id, ttl s.
SAMPLE_DONE_LUA = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('XACK', KEYS[2], ARGV[3], ARGV[4])
redis.call('XDEL', KEYS[2], ARGV[4])
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], '1')
redis.call('EXPIRE', KEYS[3], ARGV[5])
return 1
"""


def request_id(job_id: str, seq: int) -> str:
    """The request id of a training call: its model's job and its seq_id, so any api replica finds it."""
    return f"{job_id}.{seq}"


def sample_request_id(job_id: str, n: int) -> str:
    return f"{job_id}.s{n}"


def parse_request_id(rid: str) -> tuple[str, str]:
    """(job, what): what is a seq_id (digits) or a sample's `s{n}`. ValueError for anything else."""
    job, sep, what = rid.rpartition(".")
    if not sep or not job or not (what.isdigit() or (what[:1] == "s" and what[1:].isdigit())):
        raise ValueError(f"{rid!r} is not a request id this server issued")
    return job, what


# -- the api's side ----------------------------------------------------------------------
def init_model(pipe: redis.Redis | redis.client.Pipeline, job_id: str, *, first_seq: int) -> None:
    """A new model's queue: calls from `first_seq` on (0 when its first call is a load)."""
    pipe.hset(
        keys.tinker_state(job_id),
        mapping={"first": first_seq, "next": first_seq, "applied": first_seq - 1, "versions": 0},
    )


def enqueue_call(r: redis.Redis, call: TinkerCall, digest: str) -> bool:
    """Append `call` to its model's queue: True when new, False when it repeats the call already
    received under its seq_id. Raises SeqRefused for a seq_id that cannot be taken."""
    job = call.job_id
    got = int(
        r.eval(
            ENQUEUE_LUA,
            3,
            keys.tinker_calls(job),
            keys.tinker_seqs(job),
            keys.tinker_state(job),
            call.seq,
            digest,
            encode(call),
            SEQ_WINDOW,
        )
    )
    if got >= 0:
        return got == 0
    why = {
        -1: f"seq_id {call.seq} was already used by another request of this model",
        -2: f"seq_id {call.seq} is from the past: this model has received every call up to it",
        -3: f"seq_id {call.seq} is too far ahead: at most {SEQ_WINDOW} past the lowest one not received yet",
        -4: f"no Tinker model {job}",
    }[got]
    raise SeqRefused(why)


def queue_state(r: redis.Redis, job_id: str) -> dict[str, int]:
    raw = r.hgetall(keys.tinker_state(job_id))
    return {k.decode(): int(v) for k, v in raw.items()}


def read_result(r: redis.Redis, job_id: str, seq: int) -> TinkerResult | None:
    raw = r.hget(keys.tinker_results(job_id), str(seq))
    return decode_tinker(raw, TinkerResult) if raw is not None else None


async def wait_done(ar: redis.asyncio.Redis, job_id: str, request: str, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `request`'s result to be written (the long poll of retrieve_future).

    The token stays for the next waiter: one client may poll the same request twice."""
    key = keys.tinker_done(job_id, request)
    got = await ar.blpop([key], timeout=timeout_s)
    if got is not None:
        await ar.rpush(key, b"1")
        await ar.expire(key, DONE_TTL_S)


# -- the trainer's side ------------------------------------------------------------------
@dataclass(frozen=True)
class QueuedCall:
    entry_id: str
    call: TinkerCall | None  # None: an entry that does not decode (its error in `problem`)
    seq: int
    problem: str = ""


def read_calls(r: redis.Redis, cursors: dict[str, str], *, block_ms: int) -> dict[str, list[QueuedCall]]:
    """New entries of the models' call streams after each cursor (job -> last id read, "0" for
    all), in arrival order, blocking up to `block_ms` when none has any. Moves the cursors."""
    if not cursors:
        return {}
    streams = {keys.tinker_calls(j): c for j, c in cursors.items()}
    got = read_streams(r, streams, count=256, block_ms=block_ms or None)
    out: dict[str, list[QueuedCall]] = {}
    for stream, entries in got or []:
        job = keys.job_of_stream(stream.decode())
        for eid, fields in entries:
            entry = eid.decode()
            cursors[job] = entry
            seq = int(fields.get(b"seq", b"-1"))
            try:
                call = decode_tinker(fields[b"call"], TinkerCall)
                out.setdefault(job, []).append(QueuedCall(entry, call, seq))
            except (KeyError, ValueError, TypeError) as e:  # msgspec errors are ValueErrors
                out.setdefault(job, []).append(QueuedCall(entry, None, seq, f"{type(e).__name__}: {e}"))
    return out


def write_result(r: redis.Redis, fence: Fence, result: TinkerResult) -> None:
    """Store a call's result and wake its long poll, as the lease holder (LeaseLost if not)."""
    job = result.job_id
    got = r.eval(
        RESULT_LUA,
        4,
        fence.key,
        keys.tinker_results(job),
        keys.tinker_state(job),
        keys.tinker_done(job, request_id(job, result.seq)),
        fence.value,
        result.seq,
        encode(result),
        DONE_TTL_S,
    )
    if int(got) < 0:
        raise LeaseLost(f"job {job}: lease lost; the result of call {result.seq} was not written")


def checkpointed(r: redis.Redis, fence: Fence, job_id: str, seq: int, entry_ids: list[str]) -> None:
    """A checkpoint holding every call up to `seq` is in the store: drop those calls from the queue."""
    got = r.eval(
        CHECKPOINTED_LUA,
        5,
        fence.key,
        keys.tinker_calls(job_id),
        keys.tinker_state(job_id),
        keys.tinker_results(job_id),
        keys.tinker_seqs(job_id),
        fence.value,
        seq,
        KEEP_BELOW_CHECKPOINT,
        *entry_ids,
    )
    if int(got) < 0:
        raise LeaseLost(f"job {job_id}: lease lost; the calls up to {seq} stay queued for the new holder")


def bump_versions(r: redis.Redis, job_id: str, version: int) -> None:
    """Record the newest policy version a model published (its next save publishes version + 1)."""
    r.hset(keys.tinker_state(job_id), "versions", version)


# -- sample calls (api -> rollout) --------------------------------------------------------
def ensure_sample_group(r: redis.Redis, job_id: str) -> None:
    try:
        r.xgroup_create(keys.tinker_samples(job_id), keys.GROUP_TINKER_SAMPLER, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def enqueue_sample(r: redis.Redis, call: SampleCall) -> None:
    r.xadd(keys.tinker_samples(call.job_id), {"call": encode(call)})


@dataclass(frozen=True)
class QueuedSample:
    job_id: str
    entry_id: str
    call: SampleCall | None  # None: an entry that does not decode (its error in `problem`)
    problem: str = ""


def read_samples(
    r: redis.Redis, job_ids: list[str], consumer: str, *, count: int, new_block_ms: int = 0
) -> list[QueuedSample]:
    """Sample calls for this rollout replica: those it took before and has not answered (waiting
    for their version) and new ones, waiting up to `new_block_ms` for a new one (0: not at all)."""
    out: dict[str, QueuedSample] = {}
    for start in ("0", ">"):
        streams = {keys.tinker_samples(j): start for j in job_ids}
        if not streams:
            break
        block = new_block_ms if start == ">" and new_block_ms else None
        got = read_streams(r, streams, count=count, block_ms=block, group=keys.GROUP_TINKER_SAMPLER, consumer=consumer)
        for stream, entries in got or []:
            job = keys.job_of_stream(stream.decode())
            for eid, fields in entries:
                entry = eid.decode()
                if not fields:  # deleted while pending
                    continue
                try:
                    out[entry] = QueuedSample(job, entry, decode_tinker(fields[b"call"], SampleCall))
                except (KeyError, ValueError, TypeError) as e:
                    out[entry] = QueuedSample(job, entry, None, f"{type(e).__name__}: {e}")
    return list(out.values())


def drop_sample(r: redis.Redis, job_id: str, entry_id: str) -> None:
    """An entry that names no request to answer (it does not decode): out of the stream."""
    stream = keys.tinker_samples(job_id)
    pipe = r.pipeline(transaction=True)
    pipe.xack(stream, keys.GROUP_TINKER_SAMPLER, entry_id)
    pipe.xdel(stream, entry_id)
    pipe.execute()


def write_sample_result(r: redis.Redis, job_id: str, entry_id: str, result: SampleResult) -> None:
    r.eval(
        SAMPLE_DONE_LUA,
        3,
        keys.tinker_sample_result(job_id, result.request_id),
        keys.tinker_samples(job_id),
        keys.tinker_done(job_id, result.request_id),
        encode(result),
        SAMPLE_RESULT_TTL_S,
        keys.GROUP_TINKER_SAMPLER,
        entry_id,
        DONE_TTL_S,
    )


def read_sample_result(r: redis.Redis, job_id: str, request: str) -> SampleResult | None:
    raw = r.get(keys.tinker_sample_result(job_id, request))
    return decode_tinker(raw, SampleResult) if raw is not None else None


def next_sample_number(r: redis.Redis, job_id: str) -> int:
    return int(r.hincrby(keys.tinker_state(job_id), "samples", 1))
