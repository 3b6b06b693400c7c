"""Tinker sample calls, served by this rollout replica's engine (docs/tinker.md).

A Tinker sampling client samples one policy version of a Tinker model: the version its
`save_weights_for_sampler` published, which this replica adopts as it adopts any job's
(services/rollout/adoption.py: every file's sha256, then the log-prob probe). The api queues
each call (shared/tinker_queue.py); each tick this replica takes the calls of the Tinker
models it serves, runs those whose version it serves (the current one, or a replaced one
still loaded), batched by sampling parameters, and writes each result and acknowledges its
entry in one script. A call on a version not adopted yet stays pending for a later tick; one
on a version this replica refused, or has unloaded, fails with the reason.

The engine belongs to the worker's thread, which also adopts and unloads versions: a version
used here cannot be unloaded under the call.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import numpy as np
from prometheus_client import Counter

from services.rollout.engine import SamplingConfig
from services.rollout.errors import EngineUnavailable, RequestFailed
from services.rollout.served import Leases, ServedJob, ServedVersion
from shared import tinker_queue
from shared.schema import SampleCall, SampleResult
from shared.service import ServiceRuntime

log = logging.getLogger(__name__)
READ_COUNT = 256  # sample calls taken per tick: one engine call per batch of them
# Gathering calls that arrive together: wait this long for the next one, this long in all.
GATHER_WAIT_MS = 25
GATHER_MAX_S = 0.25


class TinkerSampler:
    def __init__(self, rt: ServiceRuntime, leases: Leases, jobs: dict[str, ServedJob], consumer: str) -> None:
        self.rt, self.leases, self.jobs, self.consumer = rt, leases, jobs, consumer
        self.m_calls = Counter(
            "burstrl_tinker_sample_calls", "Tinker sample calls answered, by outcome", ["outcome"], registry=rt.registry
        )

    @property
    def active(self) -> bool:
        """Whether this replica serves a Tinker model (the worker then polls for calls often)."""
        return any(v.rec.spec.tinker for v in self.jobs.values())

    def step(self) -> int:
        """Serve the sample calls that can run now; how many were answered."""
        jobs = sorted(j for j, v in self.jobs.items() if v.rec.spec.tinker)
        if not jobs:
            return 0
        r = self.rt.redis
        for job in jobs:
            tinker_queue.ensure_sample_group(r, job)
        taken = tinker_queue.read_samples(r, jobs, self.consumer, count=READ_COUNT)
        # A client sends its sample calls together (one per prompt of a batch) but they arrive over
        # a few ms: while more keep coming, gather them, so one engine call serves them all.
        deadline = time.monotonic() + GATHER_MAX_S
        while taken and len(taken) < READ_COUNT and time.monotonic() < deadline:
            more = tinker_queue.read_samples(r, jobs, self.consumer, count=READ_COUNT, new_block_ms=GATHER_WAIT_MS)
            fresh = [q for q in more if q.entry_id not in {t.entry_id for t in taken}]
            if not fresh:
                break
            taken += fresh
        batches: dict[tuple, list[tuple[str, SampleCall, ServedVersion]]] = defaultdict(list)
        answered = 0
        for q in taken:
            entry, call = q.entry_id, q.call
            if call is None:  # names no request to answer: out of the stream, with why in the log
                log.error("Tinker sample call %s of %s does not decode (%s); dropped", entry, q.job_id, q.problem)
                tinker_queue.drop_sample(r, q.job_id, entry)
                self.m_calls.labels("undecodable").inc()
                continue
            view = self.jobs.get(q.job_id)
            where, why = self._version(view, call.version) if view is not None else (None, "not served here")
            if where is None and not why:
                continue  # not adopted yet: stays pending for a later tick
            if where is None:
                res = SampleResult(job_id=q.job_id, request_id=call.request_id, error=why, category="server")
                self._answer(q.job_id, entry, res)
                answered += 1
                continue
            batches[_config_key(call)].append((entry, call, where))
        for items in batches.values():
            try:
                answered += self._run(items)
            except (RequestFailed, EngineUnavailable):
                raise  # the worker's: the engine is down, the calls stay pending for later
            except Exception as e:  # a fault of ours must not stop the replica's other work each tick
                log.exception("Tinker sample calls failed")
                answered += sum(
                    self._fail(entry, call, f"{type(e).__name__}: {e}", "server") for entry, call, _ in items
                )
        return answered

    def _version(self, view: ServedJob, version: int) -> tuple[ServedVersion | None, str]:
        """The loaded version a call samples, or (None, why it never will), or (None, "") to wait."""
        for x in [view.current, *view.retiring]:
            if x.version == version:
                return x, ""
        if version in view.refused:
            return None, f"policy v{version} was refused by this rollout replica: {view.refused[version].reason}"
        if version < view.version:
            return None, f"policy v{version} is no longer served (v{view.version} is): sample with a newer sampler"
        return None, ""

    def _run(self, items: list[tuple[str, SampleCall, ServedVersion]]) -> int:
        first = items[0][1]
        cfg = SamplingConfig(
            n=first.num_samples,
            temperature=first.temperature,
            top_p=first.top_p,
            max_tokens=first.max_tokens,
            stop=tuple(first.stop),
            stop_token_ids=tuple(first.stop_tokens),
            top_k=first.top_k,
            seed=first.seed,
        )
        prompts = [np.frombuffer(c.prompt, dtype="<i4").tolist() for _, c, _ in items]
        try:
            gens = self.leases.engine.generate_ids(prompts, [x.adapter for _, _, x in items], cfg)
        except RequestFailed as e:
            if e.index is None or len(items) == 1:
                return sum(self._fail(entry, call, str(e)) for entry, call, _ in items)
            # One request's fault: it fails, the others run again without it.
            entry, call, _ = items[e.index]
            return self._fail(entry, call, str(e)) + self._run(items[: e.index] + items[e.index + 1 :])
        for (entry, call, x), prompt, gen in zip(items, prompts, gens, strict=True):
            plp = b""
            if call.prompt_logprobs:  # compute_logprobs: position 0 has none (NaN, as the SDK reads it)
                values = [float("nan"), *self.leases.engine.prompt_logprobs(prompt, x.adapter)]
                plp = np.asarray(values, dtype="<f4").tobytes()
            res = SampleResult(
                job_id=call.job_id,
                request_id=call.request_id,
                tokens=[np.asarray(s.token_ids, dtype="<i4").tobytes() for s in gen.samples],
                logprobs=[np.asarray(s.logprobs, dtype="<f4").tobytes() for s in gen.samples],
                stop_reasons=["length" if s.finish_reason == "length" else "stop" for s in gen.samples],
                prompt_logprobs=plp,
            )
            self._answer(call.job_id, entry, res)
        return len(items)

    def _fail(self, entry: str, call: SampleCall, why: str, category: str = "user") -> int:
        res = SampleResult(job_id=call.job_id, request_id=call.request_id, error=why, category=category)
        self._answer(call.job_id, entry, res)
        return 1

    def _answer(self, job_id: str, entry: str, res: SampleResult) -> None:
        tinker_queue.write_sample_result(self.rt.redis, job_id, entry, res)
        self.m_calls.labels("failed" if res.error else "ok").inc()


def _config_key(c: SampleCall) -> tuple:
    return (
        c.num_samples,
        c.temperature,
        c.top_p,
        c.max_tokens,
        tuple(c.stop),
        tuple(c.stop_tokens),
        c.top_k,
        c.seed,
    )
