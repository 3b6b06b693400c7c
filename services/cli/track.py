"""A bridge from a job's metric points to an experiment tracker, all offline.

The stages already keep every metric durably in Redis (`shared.metrics`: the job's metrics
stream and its per-version evaluations). Rather than teaching each stage about trackers,
this bridge reads those points, through the api (`GET /v1/jobs/{id}/metrics?after=`) or
straight from Redis, and forwards the ones it has not forwarded yet to:

- TensorBoard: event files under <dir>/<job> (written with the `tensorboard` package
  alone; no torch, no TensorFlow);
- Weights & Biases in offline mode: a run under <dir>/wandb, to `wandb sync` later;
- MLflow: a file store (or any tracking URI you pass as --dir, e.g. sqlite:///m.db).

Each tracker library is imported only when chosen. The stream-id cursor and per-source
counters live in <dir>/.burstrl-track/<job>-<tracker>.json (MLflow: <dir>.burstrl-track/),
so re-running the bridge (after a crash, or `track` after `submit --follow --track`)
forwards nothing twice.

Scalars are named <source>/<metric> (trainer/reward_mean, rollout/groups, nested dicts
flattened: trainer/reward_parts/correct) and eval/<metric> per policy version. Trainer
points carry their optimizer step; points without a step get a per-source counter.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import httpx

TRACKERS = ("tensorboard", "wandb", "mlflow")
TERMINAL = {"completed", "cancelled", "failed"}
NOT_SCALARS = {"id", "at", "source", "step"}


# -- points -> scalars ---------------------------------------------------------------
def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a point, nested dicts joined with '/'; NaN/inf and text dropped."""
    out: dict[str, float] = {}
    for k, v in values.items():
        key = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, bool):
            out[key] = float(v)
        elif isinstance(v, int | float):
            if math.isfinite(v):
                out[key] = float(v)
        elif isinstance(v, dict):
            out.update(flatten(v, key))
    return out


class Sink(Protocol):
    def write(self, step: int, wall_time: float, scalars: dict[str, float], *, axis: str) -> None:
        """Record `scalars` at `step`; `axis` names the step's meaning (trainer, rollout, eval)."""

    def flush(self) -> None: ...

    def close(self) -> None: ...


# -- sinks ---------------------------------------------------------------------------
class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        # tensorboard's own writer: the same one torch.utils.tensorboard wraps.
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._w = EventFileWriter(str(logdir))

    def write(self, step: int, wall_time: float, scalars: dict[str, float], *, axis: str) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        self._w.add_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    def __init__(self, root: Path, job_id: str, project: str, config: dict[str, Any] | None = None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        root.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        # Offline always: machines may have no route out; `wandb sync <dir>/wandb/offline-run-*` uploads later.
        self.run = wandb.init(
            mode="offline",
            dir=str(root),
            project=project,
            name=job_id,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", job_id),
            config=config or {},
            resume="allow",
        )
        self._axes: set[str] = set()

    def write(self, step: int, wall_time: float, scalars: dict[str, float], *, axis: str) -> None:
        # W&B has one global, monotonic step; trainer steps, rollout counters and eval
        # versions are separate axes, so each gets its own step metric.
        if axis not in self._axes:
            self.run.define_metric(f"{axis}/step")
            self.run.define_metric(f"{axis}/*", step_metric=f"{axis}/step")
            self._axes.add(axis)
        self.run.log({f"{axis}/step": step, **scalars})

    def flush(self) -> None:
        pass  # the offline writer persists each record as it is logged

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, target: str, job_id: str, experiment: str) -> None:
        if "://" not in target and not target.startswith("sqlite:"):
            Path(target).mkdir(parents=True, exist_ok=True)
            target = Path(target).resolve().as_uri()
        if target.startswith("file:"):
            # MLflow 3 refuses its file store unless asked; it is the one that needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=target)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        # One run per job, found again by tag when the bridge restarts.
        found = self.client.search_runs([exp_id], filter_string=f"tags.`burstrl.job` = '{job_id}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(exp_id, run_name=job_id, tags={"burstrl.job": job_id}).info.run_id
        self._pending: list[Any] = []

    @staticmethod
    def key(tag: str) -> str:
        return re.sub(r"[^\w\-./ :]", "_", tag)  # MLflow's allowed metric-name characters

    def write(self, step: int, wall_time: float, scalars: dict[str, float], *, axis: str) -> None:
        ts = int(wall_time * 1000)
        self._pending += [self._metric(self.key(k), v, ts, step) for k, v in scalars.items()]

    def flush(self) -> None:
        for i in range(0, len(self._pending), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending = []

    def close(self) -> None:
        self.flush()


def make_sink(to: str, out: str, job_id: str, *, project: str = "burstrl", config: dict | None = None) -> Sink:
    if to == "tensorboard":
        return TensorBoardSink(Path(out) / job_id)
    if to == "wandb":
        return WandbSink(Path(out), job_id, project, config)
    if to == "mlflow":
        return MlflowSink(out, job_id, project)
    raise ValueError(f"unknown tracker {to!r}; choose one of {', '.join(TRACKERS)}")


def _state_dir(to: str, out: str) -> Path:
    if to != "mlflow":
        return Path(out) / ".burstrl-track"
    if "://" in out or out.startswith("sqlite:"):
        return Path(".burstrl-track")  # a tracking URI: keep the cursor in the cwd
    # Not inside an MLflow file store: it takes every folder there for an experiment.
    p = Path(out).resolve()
    return p.with_name(p.name + ".burstrl-track")


# -- sources -------------------------------------------------------------------------
class Source(Protocol):
    def points(self, after: str | None) -> list[dict[str, Any]]: ...

    def status(self) -> dict[str, Any]:
        """{"state": ..., "policy_version": int, "evals": [...], "spec": {...}}"""


class ApiSource:
    """Through the api: works from any machine that can reach it, with only the token."""

    def __init__(self, base: str, job_id: str, headers: dict[str, str], client: httpx.Client | None = None) -> None:
        self.base, self.job_id = base.rstrip("/"), job_id
        self.http = client or httpx.Client(timeout=30)
        self.http.headers.update(headers)

    def points(self, after: str | None) -> list[dict[str, Any]]:
        params = {"after": after} if after else {}
        resp = self.http.get(f"{self.base}/v1/jobs/{self.job_id}/metrics", params=params)
        resp.raise_for_status()
        return resp.json()

    def status(self) -> dict[str, Any]:
        resp = self.http.get(f"{self.base}/v1/jobs/{self.job_id}")
        resp.raise_for_status()
        s = resp.json()
        return {
            "state": s["job"]["state"],
            "policy_version": s["policy_version"],
            "evals": s["evals"],
            "spec": s["job"]["spec"],
        }


class RedisSource:
    """Straight from Redis (`shared.metrics`), for where the api is not running."""

    def __init__(self, redis_url: str, job_id: str) -> None:
        from shared.redis_conn import connect

        self.r, self.job_id = connect(redis_url), job_id

    def points(self, after: str | None) -> list[dict[str, Any]]:
        from shared.metrics import read_points

        return read_points(self.r, self.job_id, after=after, with_ids=True)

    def status(self) -> dict[str, Any]:
        from shared.job import load_job
        from shared.metrics import read_evals
        from shared.policy import read_pointer

        rec = load_job(self.r, self.job_id)
        if rec is None:
            raise KeyError(f"no job {self.job_id!r} in Redis")
        return {
            "state": rec.state.value,
            "policy_version": read_pointer(self.r, self.job_id),
            "evals": read_evals(self.r, self.job_id),
            "spec": rec.spec.model_dump(mode="json"),
        }


# -- the bridge ----------------------------------------------------------------------
class Bridge:
    """Forwards what a source has that the sink has not seen, remembering where it got to."""

    def __init__(self, source: Source, sink: Sink, state_file: Path) -> None:
        self.source, self.sink, self.state_file = source, sink, state_file
        self.state: dict[str, Any] = {"after": None, "counters": {}, "evals": []}
        if state_file.exists():
            self.state.update(json.loads(state_file.read_text()))

    def sync(self, status: dict[str, Any] | None = None) -> int:
        """Forward new points and evaluations; returns how many scalars were written."""
        n = 0
        while True:  # the api pages at `limit` points; drain them all
            points = self.source.points(self.state["after"])
            if not points:
                break
            n += self._forward(points)
            self.state["after"] = points[-1]["id"]
        status = status or self.source.status()
        done = set(self.state["evals"])
        for ev in sorted(status.get("evals", []), key=lambda e: e["version"]):
            if ev["version"] in done:
                continue
            scalars = {f"eval/{k}": v for k, v in flatten(ev).items() if k not in ("version", "at")}
            self.sink.write(int(ev["version"]), float(ev.get("at", time.time())), scalars, axis="eval")
            n += len(scalars)
            done.add(ev["version"])
        self.state["evals"] = sorted(done)
        self.sink.flush()
        self._save()  # after the flush: a crash in between re-sends, never skips
        return n

    def _forward(self, points: Iterable[dict[str, Any]]) -> int:
        n = 0
        for p in points:
            source = str(p.get("source", "unknown"))
            scalars = {f"{source}/{k}": v for k, v in flatten(p).items() if k not in NOT_SCALARS}
            if not scalars:
                continue
            step = p.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                step = self.state["counters"].get(source, 0)
                self.state["counters"][source] = step + 1
            self.sink.write(step, float(p.get("at", time.time())), scalars, axis=source)
            n += len(scalars)
        return n

    def _save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.state_file)

    def close(self) -> None:
        self.sink.close()


def open_bridge(
    source: Source, job_id: str, to: str, out: str, *, project: str = "burstrl", spec: dict | None = None
) -> Bridge:
    if to not in TRACKERS:
        raise ValueError(f"unknown tracker {to!r}; choose one of {', '.join(TRACKERS)}")
    sink = make_sink(to, out, job_id, project=project, config=spec)
    return Bridge(source, sink, _state_dir(to, out) / f"{job_id}-{to}.json")


def run_bridge(
    bridge: Bridge,
    *,
    follow: bool,
    interval_s: float = 5.0,
    on_sync: Callable[[int, dict[str, Any]], None] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Sync once, or with `follow` until the job is finished and its last version evaluated."""
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None
    try:
        while True:
            status = bridge.source.status()
            n = bridge.sync(status)
            if on_sync:
                on_sync(n, status)
            evaluated = any(e["version"] == status["policy_version"] for e in status["evals"])
            finished = status["state"] in ("cancelled", "failed") or (status["state"] == "completed" and evaluated)
            if not follow or finished or (deadline is not None and time.monotonic() > deadline):
                return status
            time.sleep(interval_s)
    finally:
        bridge.close()
