"""Where the trainer's groups come from: the ready stream's hot window and the backlog's segments.

One small interface for the loop (services/trainer/loop.py): `read` hands out references to
groups in the job's order, `decode` turns them into GroupMsg (dead-lettering what does not
decode), `ack` acknowledges them with a ledger counter and `dead_letter` refuses one. A
reference is a stream `Entry` or a `SegmentRef` (a group of a disk segment, shared/backlog.py);
both carry the group's bytes (`data`) and an `id`, and both are acknowledged the same way:
once the checkpoint holding their gradient is stored, fenced by the trainer's lease, each
exactly once (Bus.ack's XACK, mark_done's bitmap).

Segments are read straight from the store (s3:// or file://), never through Redis: a small
thread pool fetches the next few in the job's order while the loop trains, and every one is
verified against its manifest. A corrupt, truncated or missing segment is refused: each group
it still held is dead-lettered with the reason (and counted), never trained.

Order (backlog.order): `oldest` takes segments first (they hold the oldest groups: the spiller
moves the oldest undelivered entries), then the hot stream; `freshest` takes the hot stream
first, then segments newest first, each newest group first.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import redis

from shared import keys
from shared.backlog import done_positions, expire_segments, mark_done, read_index
from shared.bus import Bus, Entry, decode_each
from shared.job import JobRecord
from shared.lease import Fence
from shared.ledger import count
from shared.schema import DeadLetter, GroupMsg, encode_dead
from shared.segments import SegmentInfo, SegmentRefused, delete_segment, read_segment, segment_prefix
from shared.store import ObjectStore

log = logging.getLogger(__name__)
PREFETCH = 4  # segments fetched ahead of the loop (each ~segment_groups x a group's bytes in memory)
INDEX_EVERY_S = 1.0  # how often the segment index is re-read while the loop wants more
RETRY_S = 5.0  # a segment the store could not serve (an outage) is tried again after this


@dataclass(frozen=True)
class SegmentRef:
    """Group `pos` of backlog segment `seg`, with its bytes."""

    seg: str
    pos: int
    data: bytes

    @property
    def id(self) -> str:
        return f"{self.seg}#{self.pos}"


Ref = Entry | SegmentRef


@dataclass
class SourceStats:
    segments_read: int = 0
    segments_refused: int = 0
    segment_bytes: int = 0
    from_backlog: int = 0  # groups handed out from segments
    wait_s: float = 0.0  # the loop waiting for a segment still being fetched


class Sources:
    def __init__(
        self,
        r: redis.Redis,
        store: ObjectStore,
        rec: JobRecord,
        bus: Bus,
        fence: Callable[[], Fence | None],
        version: Callable[[], int],
        *,
        prefetch: int = PREFETCH,
    ) -> None:
        """`fence`: the trainer's lease as of now; `version`: the trainer's policy version (the age rule)."""
        self.r, self.store, self.rec, self.bus, self._fence, self._version = r, store, rec, bus, fence, version
        self.job_id = rec.id
        self.stream = keys.ready(rec.id)
        self.freshest = rec.spec.backlog.order == "freshest"
        self.prefetch = prefetch
        self.stats = SourceStats()
        self._pool: ThreadPoolExecutor | None = None
        self._fetching: OrderedDict[str, Future[list[bytes]]] = OrderedDict()
        self._open: deque[SegmentRef] = deque()
        self._handed: set[str] = set()  # segments whose groups went into _open (never fetched twice)
        self._retry_at: dict[str, float] = {}
        self._index_at = 0.0
        self._order: list[str] = []  # indexed segments not handed out yet, in the job's order
        self._infos: dict[str, SegmentInfo] = {}  # their index entries (each carries its data's sha256)

    # -- reading ---------------------------------------------------------------------
    def read(self, need: int, own_pending: bool) -> list[Ref]:
        """Up to `need` groups (blocking up to ~1 s when none is there). `own_pending`: our own
        stream entries from before a restart come first, in stream order."""
        need = max(1, need)
        if own_pending:
            own = self.bus.read_own(self.stream, count=10_000)
            if own:
                return list(own)
        if not self.rec.spec.backlog.enabled:
            return list(self.bus.read([self.stream], count=need, block_ms=1000))
        if not self.freshest:
            got: list[Ref] = list(self._from_segments(need, wait_s=1.0))
            if got or self.segments_waiting():  # the hot stream only once no segment is left
                return got
            return list(self.bus.read([self.stream], count=need, block_ms=1000))
        got = list(self.bus.read([self.stream], count=need, block_ms=1))  # block_ms=0 would block forever
        if len(got) < need:
            got += self._from_segments(need - len(got), wait_s=0.0 if got else 1.0)
        if got or self.segments_waiting():
            return got
        return list(self.bus.read([self.stream], count=need, block_ms=1000))

    def _from_segments(self, need: int, *, wait_s: float) -> list[SegmentRef]:
        deadline = time.monotonic() + wait_s
        while len(self._open) < need:
            self._fetch_ahead()
            if not self._fetching:
                break
            seg, fut = next(iter(self._fetching.items()))
            t0 = time.monotonic()
            try:
                payloads = fut.result(timeout=max(0.0, deadline - t0) if not self._open else 0.0)
            except FutureTimeout:
                break
            except SegmentRefused as e:
                del self._fetching[seg]
                self.refuse(seg, str(e))
                continue
            except Exception as e:  # the store is unreachable or failing: not the segment's fault
                del self._fetching[seg]
                self._retry_at[seg] = time.monotonic() + RETRY_S
                log.warning("job %s: could not read backlog segment %s (will retry): %s", self.job_id, seg, e)
                continue
            finally:
                self.stats.wait_s += time.monotonic() - t0
            del self._fetching[seg]
            self._handed.add(seg)
            self.stats.segments_read += 1
            self.stats.segment_bytes += sum(len(p) for p in payloads)
            done = done_positions(self.r, self.job_id, seg, len(payloads))  # left before a restart
            positions = [i for i in range(len(payloads)) if i not in done]
            if self.freshest:
                positions.reverse()
            self._open.extend(SegmentRef(seg, i, payloads[i]) for i in positions)
        out = [self._open.popleft() for _ in range(min(need, len(self._open)))]
        self.stats.from_backlog += len(out)
        return out

    def _fetch_ahead(self) -> None:
        """Keep up to `prefetch` segments fetching, in the job's order."""
        now = time.monotonic()
        if now - self._index_at >= INDEX_EVERY_S:
            self._index_at = now
            held = self._handed | set(self._fetching)
            if n := expire_segments(self.r, self.store, self.rec, self._version(), fence=self._fence(), skip=held):
                log.warning("job %s: dropped %d backlog groups past the age limit (dropped_age)", self.job_id, n)
            self._infos = read_index(self.r, self.job_id)
            segs = list(self._infos)  # sorted by id: creation order
            self._order = [s for s in (reversed(segs) if self.freshest else segs) if s not in self._handed]
        for seg in self._order:
            if len(self._fetching) >= self.prefetch:
                break
            if seg in self._fetching or seg in self._handed or self._retry_at.get(seg, 0.0) > now:
                continue
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.prefetch, thread_name_prefix=f"segments-{self.job_id}")
            self._fetching[seg] = self._pool.submit(read_segment, self.store, self.job_id, seg, self._infos.get(seg))
        self._order = [s for s in self._order if s not in self._fetching and s not in self._handed]

    def segments_waiting(self) -> int:
        """Indexed segments not handed out yet (queued, being fetched, or partly handed out); not
        those the store could not serve lately: during an outage the hot stream is trained meanwhile."""
        now = time.monotonic()
        queued = sum(1 for s in self._order if self._retry_at.get(s, 0.0) <= now)
        return queued + len(self._fetching) + (1 if self._open else 0)

    # -- decoding, acknowledging, refusing ---------------------------------------------
    def decode(self, refs: list[Ref]) -> list[tuple[Ref, GroupMsg]]:
        """Each reference's group; one that does not decode is dead-lettered with the reason."""
        return decode_each(refs, GroupMsg, self.dead_letter)

    def ack(self, refs: list[Ref], counter: str | None) -> None:
        """Acknowledge, one `counter` count each (None: none, an extra copy of a counted group),
        as the lease holder (raises LeaseLost if not)."""
        entries = [x for x in refs if isinstance(x, Entry)]
        if entries:
            self.bus.ack(entries, {self.job_id: {counter: len(entries)}} if counter else None, fence=self._fence())
        by_seg: dict[str, list[int]] = {}
        for x in refs:
            if isinstance(x, SegmentRef):
                by_seg.setdefault(x.seg, []).append(x.pos)
        for seg, positions in by_seg.items():
            _, finished = mark_done(self.r, self.job_id, seg, positions, counter, fence=self._fence())
            if finished:
                self._finished(seg)

    def dead_letter(self, ref: Ref, reason: str) -> None:
        if isinstance(ref, Entry):
            self.bus.dead_letter(ref, reason)
            return
        log.error("dead-lettering backlog group %s: %s", ref.id, reason)
        d = DeadLetter(
            stream=segment_prefix(self.job_id, ref.seg),
            entry_id=ref.id,
            reason=reason,
            payload=ref.data,
            at=time.time(),
        )
        _, finished = mark_done(
            self.r, self.job_id, ref.seg, [ref.pos], "dead", fence=self._fence(), dead=[encode_dead(d)]
        )
        if finished:
            self._finished(ref.seg)

    def refuse(self, seg: str, reason: str) -> None:
        """A segment that must never be trained: every group it still holds is dead-lettered with
        the reason (and counted `dead`); its folder stays for inspection until the orphan sweep."""
        info = read_index(self.r, self.job_id).get(seg)
        self._handed.add(seg)
        if info is None:
            return
        positions = sorted(set(range(info.groups)) - done_positions(self.r, self.job_id, seg, info.groups))
        now = time.time()
        dead = [
            encode_dead(
                DeadLetter(
                    stream=segment_prefix(self.job_id, seg),
                    entry_id=f"{seg}#{p}",
                    reason=f"backlog segment refused: {reason}",
                    payload=b"",
                    at=now,
                )
            )
            for p in positions
        ]
        marked, _ = mark_done(self.r, self.job_id, seg, positions, "dead", fence=self._fence(), dead=dead)
        count(self.r, self.job_id, "segments_refused")
        self.stats.segments_refused += 1
        log.error("job %s: backlog segment %s refused, %d groups dead-lettered: %s", self.job_id, seg, marked, reason)

    def _finished(self, seg: str) -> None:
        """Every group of the segment left the backlog: its folder goes (manifest first)."""
        self._handed.discard(seg)
        try:
            delete_segment(self.store, self.job_id, seg)
        except Exception as e:  # clutter, not data: rollout's orphan sweep deletes it later
            log.warning("job %s: could not delete finished segment %s: %s", self.job_id, seg, e)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
