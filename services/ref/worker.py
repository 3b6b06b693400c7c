"""Ref worker: scored stream -> reference (or teacher) log-probs -> ready stream.

A replica serves one model and reads only the scored streams of jobs whose reference that
model is (`JobSpec.reference_model`: the teacher if set, else the base model), so replicas
serving different models share the consumer group without taking each other's groups.

Groups are read and scored in batches. A group that cannot be scored — too long for the
reference's context, token ids the reference does not have, a teacher whose tokenizer maps
ids differently from the job's base model's — goes to the dead-letter stream with the
reason (the ledger stays balanced); the others go on. When the engine is away the batch is
held and retried, never dropped.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import Counter, Gauge

from services.ref.engine import RefScorer, Rejected, ScorerUnavailable, Seq, validate
from services.ref.settings import RefSettings
from shared import keys
from shared.bus import Entry
from shared.job import JobSpec, UnreadableJob, load_job, same_model
from shared.metrics import record_point
from shared.schema import GroupMsg, encode, pack_f32, unpack_f32, unpack_i32, unpack_u8
from shared.service import ServiceRuntime, active_job_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Vocab:
    """What must agree between a student's and a teacher's tokenizer: the id -> token map."""

    size: int
    digest: str
    tokens: dict[int, str] = field(repr=False, compare=False)
    specials: dict[str, int] = field(repr=False, compare=False)


def load_vocab(name: str) -> Vocab:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    tokens = {i: t for t, i in tok.get_vocab().items()}  # added/special tokens included
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for i, t in sorted(tokens.items())).encode()).hexdigest()
    specials = {str(t): int(i) for t, i in zip(tok.all_special_tokens, tok.all_special_ids, strict=True)}
    return Vocab(len(tokens), digest, tokens, specials)


def vocab_mismatch(base: Vocab, ref: Vocab) -> str:
    """Why the reference would read the base model's token ids as other tokens, or "" when it would not.

    Every id the base tokenizer has must name the same token in the reference's; extra tokens
    in the reference (a newer tokenizer of the same family) are fine: the student never emits them.
    """
    if base.digest == ref.digest:
        return ""
    differ = sorted(i for i, t in base.tokens.items() if ref.tokens.get(i) != t)
    if not differ:
        return ""
    ref_ids = {t: i for i, t in ref.tokens.items()}
    special = sorted(f"{t}: {i} vs {ref_ids.get(t)}" for t, i in base.specials.items() if ref_ids.get(t) != i)
    why = (
        f"vocab sizes {base.size} vs {ref.size}, {len(differ)} of the base's ids name other tokens (first: {differ[0]})"
    )
    if special:
        why += f"; special token ids differ ({', '.join(special[:4])})"
    return why


@dataclass
class RefJobView:
    spec: JobSpec
    served: bool  # this replica's model is the job's reference
    mismatch: str = ""  # non-empty: why this job's groups cannot be scored here (tokenizer)


@dataclass
class JobBatchStats:
    groups: int = 0
    sequences: int = 0
    tokens: int = 0
    lags: list[float] = field(default_factory=list)
    kl_sum: float = 0.0  # sum over trained tokens of sampler - reference log-prob (k1)
    kl_tokens: int = 0
    versions: list[int] = field(default_factory=list)


class RefWorker:
    def __init__(self, rt: ServiceRuntime, settings: RefSettings, scorer: RefScorer) -> None:
        self.rt, self.settings, self.scorer = rt, settings, scorer
        self.bus = rt.stage_bus(keys.GROUP_REF)
        self.jobs: dict[str, RefJobView] = {}
        self._unreadable: set[str] = set()  # jobs whose record could not be read
        self.held: list[Entry] = []  # a batch the engine could not score yet (retried first)
        self._vocab: dict[str, Vocab | str] = {}  # model -> Vocab, or why it could not be loaded
        reg = rt.registry
        self.m_groups = Counter("burstrl_ref_groups", "Groups scored and handed on", registry=reg)
        self.m_tokens = Counter("burstrl_ref_tokens", "Completion tokens scored", registry=reg)
        self.m_rejected = Counter("burstrl_ref_rejected", "Groups dead-lettered, by reason", ["kind"], registry=reg)
        self.g_tps = Gauge("burstrl_ref_tokens_per_second", "Scored tokens/s in the last batch", registry=reg)
        self.g_batch = Gauge("burstrl_ref_batch_groups", "Groups in the last scored batch", registry=reg)
        self.g_seqs = Gauge("burstrl_ref_batch_sequences", "Sequences in the last scored batch", registry=reg)
        self.g_lag = Gauge(
            "burstrl_ref_queue_lag_seconds", "Oldest group's age (now - sampled_at) in the last batch", registry=reg
        )
        rt.gauges["ref_model"] = settings.model
        rt.gauges["ref_engine"] = scorer.mode

    # -- which jobs ------------------------------------------------------------------
    def _view(self, job_id: str) -> RefJobView | None:
        view = self.jobs.get(job_id)
        if view is None:
            try:
                rec = load_job(self.rt.redis, job_id)
            except UnreadableJob as e:  # one bad record must not stop the other jobs' scoring
                if job_id not in self._unreadable:  # said once, not every tick
                    self._unreadable.add(job_id)
                    log.error("%s; not served", e)
                return None
            if rec is None:
                return None
            spec = rec.spec  # immutable once accepted: cached for the job's life
            served = spec.uses_ref and same_model(spec.reference_model, self.settings.model)
            view = RefJobView(spec, served, self._tokenizer_check(spec) if served else "")
            self.jobs[job_id] = view
            if served and view.mismatch:
                log.error("job %s: %s", job_id, view.mismatch)
        return view

    def _vocab_of(self, name: str) -> Vocab | str:
        if name not in self._vocab:
            try:
                self._vocab[name] = load_vocab(name)
            except Exception as e:  # not on this box, no hub access: the caller degrades
                self._vocab[name] = f"{type(e).__name__}: {e}"
        return self._vocab[name]

    def _tokenizer_check(self, spec: JobSpec) -> str:
        """Why the job's base tokenizer and this replica's differ ("" when they agree or need not)."""
        if same_model(spec.base_model, self.settings.model):
            return ""  # scoring under the base model itself: one tokenizer
        base = self._vocab_of(spec.base_model)
        ref = self._vocab_of(self.settings.tokenizer or self.settings.model)
        if isinstance(base, str) or isinstance(ref, str):
            # Cannot compare here (the base model's files are not on this box, say): token ids
            # are still checked against the reference's vocabulary size, so nothing crashes.
            why = base if isinstance(base, str) else ref
            log.warning("cannot compare tokenizers of %s and %s: %s", spec.base_model, self.settings.model, why)
            return ""
        why = vocab_mismatch(base, ref)
        if why:
            return (
                f"tokenizer mismatch between the job's base model {spec.base_model} and the reference "
                f"{self.settings.model}: {why}; a teacher must share the student's tokenizer"
            )
        return ""

    def streams(self) -> list[str]:
        out = []
        for job_id in active_job_ids(self.rt.redis):
            view = self._view(job_id)
            if view is not None and view.served:
                out.append(keys.scored(job_id))
        return out

    # -- the loop --------------------------------------------------------------------
    def tick(self) -> int:
        if self.held:
            entries, self.held = self.held, []
        else:
            entries = self.bus.read(self.streams(), count=self.settings.batch_groups, block_ms=1000)
        return self.handle(entries)

    def _reject(self, e: Entry, kind: str, reason: str) -> None:
        self.m_rejected.labels(kind).inc()
        self.bus.dead_letter(e, reason)

    def handle(self, entries: list[Entry]) -> int:
        """Score a batch; forward each group, or dead-letter it with the reason. Returns groups forwarded."""
        todo: list[tuple[Entry, GroupMsg, list[Seq]]] = []
        decoded = self.bus.decode(entries, GroupMsg)  # undecodable ones are dead-lettered there
        if len(decoded) < len(entries):
            self.m_rejected.labels("undecodable").inc(len(entries) - len(decoded))
        for e, g in decoded:
            view = self._view(e.job_id)
            if view is None:
                self._reject(e, "job", f"unknown job {e.job_id}")
                continue
            if not view.served:
                self._reject(
                    e,
                    "job",
                    f"this ref replica serves {self.settings.model}, the job's reference is {view.spec.reference_model}",
                )
                continue
            if g.stage != "scored":
                self._reject(e, "stage", f"group at stage {g.stage!r}, expected 'scored'")
                continue
            if view.mismatch:
                self._reject(e, "tokenizer", view.mismatch)
                continue
            prompt = unpack_i32(g.prompt_ids).tolist()
            seqs = [(prompt, unpack_i32(c.token_ids).tolist()) for c in g.completions]
            try:
                for s in seqs:
                    validate(s, self.scorer.max_len, self.scorer.vocab_size)
            except Rejected as err:
                self._reject(e, err.kind, str(err))
                continue
            todo.append((e, g, seqs))
        if not todo:
            return 0

        t0 = time.perf_counter()
        flat = [s for _, _, seqs in todo for s in seqs]
        try:
            lps = self.scorer.score(flat)
            results: list[list[list[float]] | Rejected] = []
            i = 0
            for _, _, seqs in todo:
                results.append(lps[i : i + len(seqs)])
                i += len(seqs)
        except Rejected:
            # The engine refused something in the batch: score group by group to find which.
            results = []
            for _, _, seqs in todo:
                try:
                    results.append(self.scorer.score(seqs))
                except Rejected as err:
                    results.append(err)
        except ScorerUnavailable as err:
            self.held = [e for e, _, _ in todo]  # retried on the next tick, after the backoff
            self.rt.health.set("engine", False, str(err))
            self.rt.stop.wait(self.settings.engine_retry_s)
            return 0
        self.rt.health.set("engine", True)
        seconds = time.perf_counter() - t0

        now = time.time()
        stats: dict[str, JobBatchStats] = defaultdict(JobBatchStats)
        units: list[tuple[Entry, list[tuple[str, bytes]], dict[str, int]]] = []
        for (e, g, seqs), res in zip(todo, results, strict=True):
            if isinstance(res, Rejected):
                self._reject(e, res.kind, str(res))
                continue
            st = stats[e.job_id]
            for c, lp in zip(g.completions, res, strict=True):
                c.ref_logprobs = pack_f32(lp)
                mask = unpack_u8(c.loss_mask).astype(bool)
                if len(mask) == len(lp):
                    d = (unpack_f32(c.logprobs) - np.asarray(lp, dtype=np.float32))[mask]
                    st.kl_sum += float(d.sum())
                    st.kl_tokens += int(mask.sum())
                st.tokens += len(lp)
            st.groups += 1
            st.sequences += len(seqs)
            if g.sampled_at:
                st.lags.append(max(0.0, now - g.sampled_at))
            st.versions.append(g.policy_version)
            g.stage = "ready"
            units.append((e, [(keys.ready(e.job_id), encode(g))], {"refd": 1}))
        # One round trip for the batch; each group still hands on atomically and at most once.
        done = self.bus.settle(units)
        self._record(stats, seconds)
        return done

    def _record(self, stats: dict[str, JobBatchStats], seconds: float) -> None:
        tokens = sum(s.tokens for s in stats.values())
        groups = sum(s.groups for s in stats.values())
        tps = tokens / seconds if seconds > 0 else 0.0
        lags = [x for s in stats.values() for x in s.lags]
        self.m_groups.inc(groups)
        self.m_tokens.inc(tokens)
        self.g_tps.set(tps)
        self.g_batch.set(groups)
        self.g_seqs.set(sum(s.sequences for s in stats.values()))
        self.g_lag.set(max(lags, default=0.0))
        for job_id, s in stats.items():
            point: dict[str, Any] = {
                "groups": s.groups,
                "sequences": s.sequences,
                "tokens": s.tokens,
                "batch_groups": groups,  # the whole batch, all jobs together
                "score_s": round(seconds, 4),
                "tokens_per_s": round(tps, 1),
                "queue_lag_s": round(sum(s.lags) / len(s.lags), 3) if s.lags else None,
                "queue_lag_max_s": round(max(s.lags), 3) if s.lags else None,
                # Mean over trained tokens of log p_sampler - log p_ref: a k1 estimate of
                # KL(sampler || reference) per token (exact in expectation at temperature 1,
                # top_p 1). Under a teacher this is the student-teacher KL distillation lowers.
                "kl_sampler_ref": s.kl_sum / s.kl_tokens if s.kl_tokens else None,
                "policy_version_min": min(s.versions),
                "policy_version_max": max(s.versions),
            }
            record_point(self.rt.redis, job_id, "ref", point)
