"""The bus's server-side scripts: each one atomic step of stream handling, with its
contract (KEYS and ARGV) above it. Only shared/bus.py runs them; they live apart so the
bus's Python reads in one sitting.

- SETTLE_LUA: hand a batch of entries on, each at most once (XACK, then XADD + counters);
- ACK_LUA / FENCED_ACK_LUA: acknowledge a batch with one count each (fenced: only the
  lease holder, docs/architecture.md invariant 10);
- SPILL_LUA: move entries from the ready stream into an indexed backlog segment, all or nothing;
- TRIM_LUA: delete what every consumer group has acknowledged;
- LEAVE_LUA: a consumer leaving its group for good hands its pending entries to a live peer.
- INJECT_LUA: put a group that no upstream entry carries (an agent's) on the bus, once;
- FEED_LUA: append a job's new prompts and count them fed, only from the position read.
"""

from __future__ import annotations

from shared.lease import FENCE_CHECK

# One call settles a batch of units of one job, each at most once. KEYS: every stream and
# ledger key the batch touches (one job's: one Redis Cluster slot). ARGV: group, field, n_units, then per unit: input key index,
# entry id, ledger key index, n_outputs, (output key index, payload)..., n_counters,
# (name, n)... Returns one flag per unit: 1 if it was settled now (its XACK removed the entry).
SETTLE_LUA = """
local group, field = ARGV[1], ARGV[2]
local i, flags = 4, {}
local sums, order = {}, {}  -- counters summed per (ledger, name): one HINCRBY each
for _ = 1, tonumber(ARGV[3]) do
  local fresh = redis.call('XACK', KEYS[tonumber(ARGV[i])], group, ARGV[i + 1]) == 1
  local ledger = KEYS[tonumber(ARGV[i + 2])]
  local nout = tonumber(ARGV[i + 3])
  i = i + 4
  table.insert(flags, fresh and 1 or 0)
  for _ = 1, nout do
    if fresh then redis.call('XADD', KEYS[tonumber(ARGV[i])], '*', field, ARGV[i + 1]) end
    i = i + 2
  end
  local ncount = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, ncount do
    if fresh then
      local key = ledger .. '\0' .. ARGV[i]
      if sums[key] == nil then
        sums[key] = 0
        table.insert(order, {ledger, ARGV[i], key})
      end
      sums[key] = sums[key] + tonumber(ARGV[i + 1])
    end
    i = i + 2
  end
end
for _, c in ipairs(order) do redis.call('HINCRBY', c[1], c[2], sums[c[3]]) end
return flags
"""


# A batch acknowledged with the same counters (the trainer's step, a drop). KEYS: stream,
# ledger. ARGV: group, n_names, names..., entry ids... Each counter rises by how many
# entries XACK removed from the pending list right now.
# The body both scripts share, as a Lua function of where its keys and arguments start.
_ACK_COUNTED = """
local function ack_counted(stream, ledger, group, at)  -- ARGV[at]: n_names, then names..., ids...
  local nnames = tonumber(ARGV[at])
  local acked = redis.call('XACK', stream, group, unpack(ARGV, at + 1 + nnames))
  if acked > 0 then
    for j = 1, nnames do redis.call('HINCRBY', ledger, ARGV[at + j], acked) end
  end
  return acked
end
"""
ACK_LUA = _ACK_COUNTED + "return ack_counted(KEYS[1], KEYS[2], ARGV[1], 2)\n"


# KEYS: ready stream, ledger, backlog index. ARGV: group, consumer, segment id, index entry JSON,
# entry ids in stream order... All or nothing: -1 (nothing done) unless every entry is still pending to this
# consumer (the trainer may have taken some over: they must not be trained and spilled both),
# -2 if the segment is indexed already; else XACK them all, count them spilled (and the ledger's
# running backlog_bytes), index the segment.
SPILL_LUA = """
local lo, hi = ARGV[5], ARGV[#ARGV]  -- the ids come in stream order
local mine = {}
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], lo, hi, 100000, ARGV[2])) do mine[p[1]] = true end
for i = 5, #ARGV do
  if not mine[ARGV[i]] then return -1 end
end
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return -2 end
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 5))
redis.call('HINCRBY', KEYS[2], 'spilled', n)
redis.call('HINCRBY', KEYS[2], 'backlog_bytes', cjson.decode(ARGV[4])['bytes'])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return n
"""


# ACK_LUA behind the lease guard (shared/lease.py): KEYS lease, stream, ledger; ARGV the lease
# value, then ACK_LUA's ARGV. Returns -1, acknowledging nothing, when the caller lost the lease.
FENCED_ACK_LUA = FENCE_CHECK + _ACK_COUNTED + "return ack_counted(KEYS[2], KEYS[3], ARGV[2], 3)\n"


# KEYS: the stream. Computes, atomically, the lowest id any group still needs — per
# group its oldest pending entry, else the first entry after its last-delivered id —
# and trims below it. Returns {entries removed, the bound or ""}.
TRIM_LUA = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok or #groups == 0 then return {0, ''} end
local best_ms, best_seq = nil, nil
for _, g in ipairs(groups) do
  local info = {}
  for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
  local bound
  if tonumber(info['pending']) > 0 then
    bound = redis.call('XPENDING', KEYS[1], info['name'])[2]
  else
    bound = info['last-delivered-id']
  end
  local ms, seq = string.match(bound, '(%d+)-(%d+)')
  ms, seq = tonumber(ms), tonumber(seq)
  if info['pending'] == 0 then seq = seq + 1 end
  if best_ms == nil or ms < best_ms or (ms == best_ms and seq < best_seq) then
    best_ms, best_seq = ms, seq
  end
end
local minid = string.format('%d-%d', best_ms, best_seq)
return {redis.call('XTRIM', KEYS[1], 'MINID', minid), minid}
"""


# A consumer leaves its group for good (a burst-side replica at the end of its burst). KEYS[1]:
# the stream. ARGV: group, consumer, peer ("" when no peer is alive), count. Its pending
# entries (up to count) go to the peer, without counting a delivery (JUSTID), and the peer
# redoes them from its own pending list; once it holds none, the consumer is deleted. Never
# deleted while it holds entries: XGROUP DELCONSUMER would drop them from the pending list,
# and nobody could ever claim them again. Returns {handed, still pending, deleted (0/1)}.
LEAVE_LUA = """
local stream, group, me, peer = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local ok, pending = pcall(redis.call, 'XPENDING', stream, group, '-', '+', tonumber(ARGV[4]), me)
if not ok then return {0, 0, 0} end  -- no such stream or group: nothing to leave
local ids = {}
for _, p in ipairs(pending) do table.insert(ids, p[1]) end
local handed = 0
if peer ~= '' and #ids > 0 then
  handed = #redis.call('XCLAIM', stream, group, peer, 0, unpack(ids), 'JUSTID')
end
local left = redis.call('XPENDING', stream, group, '-', '+', tonumber(ARGV[4]), me)
if #left == 0 then
  redis.call('XGROUP', 'DELCONSUMER', stream, group, me)
  return {handed, 0, 1}
end
return {handed, #left, 0}
"""


# A group born outside the streams (an agent group, docs/agents.md) enters the ledger once.
# KEYS: the job's agent_groups hash, ledger, then the output streams. ARGV: field, group id,
# outcome, n_outputs, payloads..., n_counters, (name, n)... Returns 1 if done now; 0 if the
# group id already has an outcome (nothing added or counted); -1 if the job's ledger is gone
# (Redis lost the job: nothing written, so a recovered job starts from a clean slate).
INJECT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[3]) == 0 then return 0 end
local nout = tonumber(ARGV[4])
for j = 1, nout do redis.call('XADD', KEYS[2 + j], '*', ARGV[1], ARGV[4 + j]) end
local i = 5 + nout
for _ = 1, tonumber(ARGV[i]) do
  redis.call('HINCRBY', KEYS[2], ARGV[i + 1], tonumber(ARGV[i + 2]))
  i = i + 2
end
return 1
"""


# The feeder's append: new prompts and their `fed` count, only if the ledger still says `fed`
# is what the feeder read. A ledger that is gone (Redis flushed or lost the job between the
# read and this write) or moved (another feeder fed first) refuses the whole batch, so no
# feeder writes into a Redis that no longer holds the job, and none feeds a position twice.
# KEYS: ledger, prompts stream. ARGV: field, expected fed, then one payload per prompt.
# Returns the prompts appended; 0 if `fed` moved; -1 if the ledger is gone.
FEED_LUA = """
local fed = redis.call('HGET', KEYS[1], 'fed')
if not fed then return -1 end
if fed ~= ARGV[2] then return 0 end
for j = 3, #ARGV do redis.call('XADD', KEYS[2], '*', ARGV[1], ARGV[j]) end
redis.call('HINCRBY', KEYS[1], 'fed', #ARGV - 2)
return #ARGV - 2
"""
