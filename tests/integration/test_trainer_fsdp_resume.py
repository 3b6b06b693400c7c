"""A job trained under FSDP on 2 processes and on 1, alternately, from one store: the same
weights as one uninterrupted run, and every group counted once (real Redis, a file:// store,
`torchrun --nproc-per-node=2 -m services.trainer` with sharding=fsdp on gloo).

The burst pattern: several GPUs for a while, then the dev card (2 -> 1), and back (1 -> 2).
FSDP checkpoints hold full tensors in the one-process format (services/trainer/sharding.py),
so the one-process trainer loads a checkpoint 2 ranks wrote, and 2 ranks each keep their
shard of one that 1 process wrote.

- 2 -> 1: the 2-rank session trains 3 steps of the data it finds, is pre-empted (SIGTERM)
  with the exit checkpoint at step 3; a one-process trainer resumes and finishes.
- 1 -> 2: a one-process trainer crashes after storing checkpoint 4 and before acknowledging
  its groups; the 2-rank session resumes from it, gets those groups redelivered, acknowledges
  them as trained without training them again, and trains step 5.

Tolerance, fp32: tests/support/numerics.py ADAM_TRAJECTORY_TOL, 90% of the adapter's entries
within 10% of one AdamW step of the uninterrupted run's (the step measured in the same run:
the median of |checkpoint 5 - checkpoint 4|). The sharded steps sum gradients in another order
(tests/integration/test_trainer_fsdp.py), and AdamW turns that noise into lr-sized moves for the
entries whose gradient is near zero; how many there are depends on the build of the tiny model
(0.7% of all entries beyond 1e-3 on the build of a CI run, 2026-12-04, none on this AMD EPYC's),
so a bound on their share failed there. An extra step or lost optimizer states move most entries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from services.cli.launch import free_port
from services.trainer.checkpoint import checkpoint_steps, load_checkpoint
from services.trainer.policy import ADAPTER_WEIGHTS
from shared import keys
from shared.bus import FIELD
from shared.folders import MANIFEST
from shared.job import JobState, load_job
from shared.ledger import audit
from shared.metrics import read_ledger, read_points
from shared.schema import encode
from tests.support import ROOT
from tests.support.numerics import assert_same_adam_trajectory
from tests.support.trainer_resume import BATCH, JOB, STEPS, ZERO_VAR, Run, crash_before_ack, resume_groups
from tests.support.waits import Deadline

pytestmark = pytest.mark.slow  # torchrun sessions: minutes


def _run(r, tmp: Path, model_dir: Path, **kw) -> Run:  # noqa: ANN001
    run = Run(r, tmp, model_dir, **kw)
    # The in-process trainers here run without a LeaseKeeper; the tiny SFT model's steps on a
    # busy machine can outlast the default 30 s lease, and another "trainer" would take it.
    run.settings.lease_s = 900
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, redis_server, tiny_model):  # noqa: ANN001, ANN201
    """One process, uninterrupted: the final adapter and LR, and how far one AdamW step moves an
    entry (the median of |checkpoint 5 - checkpoint 4|)."""
    client = redis_server.client()
    run = _run(client, tmp_path_factory.mktemp("ref"), tiny_model, checkpoint_every=2)
    run.trainer().run()
    out = run.final()
    before = load(load_checkpoint(run.store, JOB, STEPS - 1).files[ADAPTER_WEIGHTS])
    step = torch.cat([(out[0][k] - before[k]).abs().flatten() for k in before]).median()
    client.close()
    return out, float(step)


def _feed(run: Run, upto: int) -> None:
    """Append the job's groups [already fed, upto) to its ready stream, counted as fed."""
    groups = resume_groups()
    start = int(run.r.hget(keys.ledger(JOB), "fed") or 0)
    for g in groups[start:upto]:
        run.r.xadd(keys.ready(JOB), {FIELD: encode(g)})
    run.r.hset(keys.ledger(JOB), "fed", max(start, upto))


def _torchrun(run: Run, redis_url: str, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "STORE_URL": run.store.url,
        "BURSTRL_DEV": "1",
        "BURSTRL_PORT": str(free_port()),
        "BURSTRL_TRAINER_JOB": JOB,
        "BURSTRL_TRAINER_DEVICE": "cpu",
        "BURSTRL_TRAINER_CHECKPOINT_EVERY": str(run.settings.checkpoint_every),
        "BURSTRL_TRAINER_BUDGET_MARGIN_S": "0",
        "BURSTRL_TRAINER_THREADS": "1",
        "BURSTRL_TRAINER_SHARDING": "fsdp",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    cmd += [f"--master-port={free_port()}", "-m", "services.trainer"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path, done, what: str, timeout: float = 400) -> None:  # noqa: ANN001
    deadline = Deadline(timeout)
    while not done():
        assert proc.poll() is None, f"torchrun exited {proc.returncode} before {what}:\n{log.read_text()[-4000:]}"
        assert deadline, f"no {what} within {timeout}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen, log: Path) -> None:
    """Pre-empt the session as a rental ends: SIGTERM to the launcher, which passes it on."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text or "SignalException" in text, text[-4000:]


def _close_to(got: tuple[dict[str, torch.Tensor], float], reference: tuple[tuple, float]) -> None:
    (a, lr_a), ((b, lr_b), step) = got, reference
    assert_same_adam_trajectory(a, b, step)
    assert lr_a == pytest.approx(lr_b)  # the scheduler neither skipped nor double-stepped


def _exactly_once(r) -> None:  # noqa: ANN001
    led = read_ledger(r, JOB)
    assert led["trained"] == STEPS * BATCH, led
    assert led["dropped_zero_variance"] == len(ZERO_VAR), led
    a = audit(r, JOB)
    assert a.balanced and a.in_flight == 0, (a.problems, a.counters)
    assert r.xpending(keys.ready(JOB), keys.GROUP_TRAINER)["pending"] == 0


def _safetensors_and_json_only(run: Run, step: int) -> None:
    names = {k.rsplit("/", 1)[1] for k in run.store.list(f"jobs/{JOB}/trainer/step-{step:08d}/")}
    assert MANIFEST in names and all(n.endswith((".safetensors", ".json")) for n in names), names


def test_two_ranks_then_one_process(r, redis_server, tmp_path, tiny_model, reference):
    run = _run(r, tmp_path, tiny_model, checkpoint_every=2, data_steps=0)
    # Data for 3 steps only (group 3 has no reward spread and is dropped): the session
    # trains them, then waits for more until it is pre-empted.
    _feed(run, 3 * BATCH + 1)
    log = tmp_path / "torchrun-1.log"
    proc = _torchrun(run, redis_server.url, log)
    try:
        _wait(proc, log, lambda: len(read_points(r, JOB, "trainer")) >= 3, "3 steps")
        assert checkpoint_steps(run.store, JOB) == [2]
        time.sleep(1.0)  # past the step's publish and ack, into the wait for data
    finally:
        _stop(proc, log)
    assert checkpoint_steps(run.store, JOB) == [2, 3], log.read_text()[-4000:]  # the exit checkpoint
    assert read_ledger(r, JOB)["trained"] == 3 * BATCH
    _safetensors_and_json_only(run, 3)
    ck = load_checkpoint(run.store, JOB, 3)
    assert {k for k in ck.opt_tensors if k.startswith("state.")}  # the optimizer, gathered in full
    _feed(run, len(resume_groups()))
    t = run.trainer()  # one process, no sharding: the plain loader reads what 2 ranks wrote
    assert t.state.step == 3 and t.learner.sched.last_epoch == 3
    t.run()
    _close_to(run.final(), reference)
    _exactly_once(r)


def test_one_process_then_two_ranks_across_a_crash_before_the_ack(
    r, redis_server, tmp_path, tiny_model, reference, monkeypatch
):
    run = _run(r, tmp_path, tiny_model, checkpoint_every=2)
    crash_before_ack(monkeypatch, 4)
    with pytest.raises(RuntimeError, match="injected"):
        run.trainer().run()
    monkeypatch.undo()
    assert checkpoint_steps(run.store, JOB) == [2, 4]
    assert read_ledger(r, JOB)["trained"] == 2 * BATCH  # the interval 3..4 is stored, not acknowledged
    run.lease.release()  # as the crashed service's exit does
    log = tmp_path / "torchrun-2.log"
    proc = _torchrun(run, redis_server.url, log)
    try:
        _wait(proc, log, lambda: load_job(r, JOB).state == JobState.completed, "the job completing")
    finally:
        _stop(proc, log)
    assert max(checkpoint_steps(run.store, JOB)) == STEPS
    _safetensors_and_json_only(run, STEPS)
    # Step 5 was the only step the 2 ranks trained: the redelivered groups were acknowledged.
    assert [p["step"] for p in read_points(r, JOB, "trainer")][-1] == STEPS
    _close_to(run.final(), reference)
    _exactly_once(r)
