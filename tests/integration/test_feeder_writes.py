"""The feeder writes a job's prompts only from the position it read, into a Redis that still holds
the job: a flush landing between its read and its write (CI caught the api writing a job's
`prompts` and `ledger` into an emptied Redis) leaves nothing behind, and a second feeder that
read the same position feeds nothing twice."""

from __future__ import annotations

import pytest

from services.api import feeder as feeder_module
from services.api.feeder import Feeder
from services.api.jobs import create_job
from shared import keys
from shared.bus import feed
from shared.job import JobSpec
from shared.ledger import UnknownJob
from shared.metrics import read_ledger


def _job(r) -> str:  # noqa: ANN001
    spec = JobSpec(name="writes", base_model="m", batch_size=2, max_staleness=1, eval_size=0)
    return create_job(r, spec=spec).id


def test_a_flush_between_the_feeders_read_and_its_write_leaves_nothing_of_the_job(r, monkeypatch):
    job_id = _job(r)
    real = feeder_module.read_ledger

    def read_then_flush(rr, jid):  # noqa: ANN001, ANN202 (Redis loses everything right after the read)
        got = real(rr, jid)
        rr.flushall()
        return got

    monkeypatch.setattr(feeder_module, "read_ledger", read_then_flush)
    assert Feeder(r).tick() == 0
    assert list(r.scan_iter(match=keys.job_key_pattern(job_id))) == []


def test_two_feeders_that_read_one_position_feed_it_once(r):
    job_id = _job(r)
    window = 4  # (max_staleness + 1) x batch_size
    first, second = Feeder(r), Feeder(r)
    led = read_ledger(r, job_id)
    assert first.tick() == window
    # `second` read the same position before `first` wrote: its write is refused whole.
    assert feed(r, job_id, led["fed"], [b"stale"]) == 0
    assert second.tick() == 0  # the window is full now anyway
    assert read_ledger(r, job_id)["fed"] == window == r.xlen(keys.prompts(job_id))


def test_feeding_a_job_whose_ledger_is_gone_is_refused_by_name(r):
    with pytest.raises(UnknownJob, match="no ledger for job 'gone-000001'"):
        feed(r, "gone-000001", 0, [b"p"])
    assert list(r.scan_iter(match=keys.job_key_pattern("gone-000001"))) == []
