"""Scores groups in parallel worker processes, each group under its job's deadline.

Used by the reward service (every trajectory) and by rollout's held-out evaluation, so a
verifier that hangs or crashes on one answer costs its deadline, never a service's loop.

Processes, not threads: verifiers are mostly CPU-bound Python (math-verify, sympy), and
math-verify's own timeouts need a main thread. A group that misses its deadline, or a
verifier that raises, scores 0 with a tag; the stuck pool is replaced, the service goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from shared.domain.verifiers import TAG_SEP, error_tag, load_plugins
from shared.plugins import import_plugins

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupWork:
    """One group to score: the job's task configuration and the completions."""

    task: str
    verifier: str
    spec_json: str  # TaskSpec as JSON (plain data, never pickled objects)
    completions: list[str]
    fields: dict[str, str]
    prompt: str
    completion_tokens: list[int]
    max_tokens: int
    timeout_s: float


def group_work(
    spec: Any, completions: list[str], fields: dict[str, str], *, prompt: str, completion_tokens: list[int]
) -> GroupWork:
    """The work of scoring one group of a job (`spec`: its JobSpec) as its task and verifiers say."""
    ts = getattr(spec, "task_spec", None)
    return GroupWork(
        task=spec.task,
        verifier=spec.verifier,
        spec_json=ts.model_dump_json() if ts is not None else "{}",
        completions=completions,
        fields=fields,
        prompt=prompt,
        completion_tokens=completion_tokens,
        max_tokens=spec.sampling.max_tokens,
        timeout_s=ts.timeout_s if ts is not None else 60.0,
    )


def _init_worker(plugins: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s score-w %(levelname)-5s %(name)s: %(message)s")
    _exit_with_parent(os.getppid())
    load_plugins(plugins)


PARENT_POLL_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """Leave when the service that started this worker is gone.

    A worker of a SIGKILLed service (kill -9, the OOM killer) never learns it from its pool: it
    holds the call queue's write end itself, so its read never sees EOF, and it waited forever,
    reparented to init (three such processes outlived every `make test`). When the parent dies
    the worker is reparented, so a changed getppid() is the signal; PR_SET_PDEATHSIG is not used
    because it fires when the parent *thread* that spawned the worker exits, not the process."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def score_json(payload: str) -> str:
    """The process-pool entry: plain JSON in and out (invariant 1: no pickled objects)."""
    return json.dumps(score_work(GroupWork(**json.loads(payload))))


def score_work(w: GroupWork) -> list[dict[str, float]]:
    """Reward parts of each completion (runs in a worker process, or inline)."""
    from shared.domain.tasks.base import _task_for, score_many

    try:
        task = _task_for(w.task, w.verifier, w.spec_json)
        parts = score_many(
            task,
            w.completions,
            w.fields,
            prompt=w.prompt,
            completion_tokens=w.completion_tokens,
            max_tokens=w.max_tokens,
        )
    except Exception as e:  # task-level failure (unknown task, missing file, ...): every completion 0, tagged
        log.warning("task %s could not score a group: %s", w.task, e)
        return failed(len(w.completions), error_tag(e))
    if len(parts) != len(w.completions):
        return failed(len(w.completions), "error:wrong_count")
    return parts


def failed(n: int, tag: str) -> list[dict[str, float]]:
    return [{"verifier": 0.0, f"verifier{TAG_SEP}{tag}": 0.0} for _ in range(n)]


class Scorer:
    """Groups scored in `workers` processes (0: threads of this process, for debugging), each
    under min(its own timeout, `max_timeout_s`). One caller at a time (one thread)."""

    def __init__(
        self, workers: int, plugins: list[str], max_timeout_s: float = 120.0, *, setting: str = "BURSTRL_REWARD_PLUGINS"
    ) -> None:
        self.workers = workers
        self.plugins = plugins
        self.max_timeout_s = max_timeout_s
        self._pool: ProcessPoolExecutor | ThreadPoolExecutor | None = None
        import_plugins(plugins, setting=setting)  # fail at start, in the service, naming the setting to fix

    def _get_pool(self) -> ProcessPoolExecutor | ThreadPoolExecutor:
        if self._pool is None:
            if self.workers == 0:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="score")
            else:
                self._pool = ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded service
                    initializer=_init_worker,
                    initargs=(self.plugins,),
                )
        return self._pool

    def _recycle(self) -> None:
        """Drop a pool with a stuck or dead worker: kill its processes, start fresh next time."""
        pool, self._pool = self._pool, None
        if isinstance(pool, ProcessPoolExecutor):
            procs = list((getattr(pool, "_processes", None) or {}).values())  # no public kill in 3.11
            pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.kill()
        elif pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, w: GroupWork) -> Future | None:
        try:
            return self._get_pool().submit(score_json, json.dumps(dataclasses.asdict(w)))
        except RuntimeError:  # pool broken by an earlier crash
            return None

    def score(self, works: list[GroupWork]) -> list[list[dict[str, float]]]:
        """Parts for every group, in order. Never raises for a verifier's sake."""
        now = time.monotonic()
        futures = [self._submit(w) for w in works]
        starts = [now] * len(works)
        out: list[list[dict[str, float]]] = []
        for i, w in enumerate(works):
            n, fut = len(w.completions), futures[i]
            if fut is None:
                out.append(failed(n, "error:pool_broken"))
                continue
            deadline = starts[i] + min(w.timeout_s, self.max_timeout_s)
            try:
                out.append(json.loads(fut.result(timeout=max(0.0, deadline - time.monotonic()))))
                continue
            except FutureTimeout:
                log.warning("task %s: a group missed its %.1fs deadline; scoring it 0", w.task, w.timeout_s)
                out.append(failed(n, "timeout"))
            except Exception as e:  # a worker died (OOM, segfault in a C extension)
                log.warning("task %s: scoring process failed: %s", w.task, e)
                out.append(failed(n, error_tag(e)))
            # A worker is stuck or dead: replace the pool, and give every later group that
            # had not finished a fresh start there (it must not pay for this one's deadline).
            finished = [j for j in range(i + 1, len(works)) if futures[j] is not None and futures[j].done()]
            self._recycle()
            for j in range(i + 1, len(works)):
                if j not in finished:
                    futures[j], starts[j] = self._submit(works[j]), time.monotonic()
        return out

    def close(self) -> None:
        self._recycle()
