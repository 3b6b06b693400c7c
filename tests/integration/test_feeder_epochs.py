"""The feeder's durable position across api restarts, including at a dataset-epoch boundary.

The prompt order of a file task is a seeded shuffle per epoch; the position is the ledger's
`fed` counter. A new Feeder (what an api restart gives) must continue exactly where the
old one stopped — at an epoch boundary too — so no prompt is skipped or fed twice.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.api.feeder import Feeder
from services.api.jobs import create_job
from shared import keys
from shared.bus import FIELD, Bus
from shared.job import JobSpec
from shared.ledger import init_ledger
from shared.schema import PromptMsg, decode

ROWS = 7


def _job(r, tmp_path: Path) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(ROWS))
    )
    spec = JobSpec(
        name="epochs",
        base_model="m",
        batch_size=ROWS,  # window = (1 + 1) x 7: each tick feeds exactly two epochs
        max_staleness=1,
        task_spec={
            "source": {"kind": "jsonl", "path": str(data), "id_field": "id", "heldout_fraction": 0.0},
            "verifiers": [{"name": "exact"}],
        },
    )
    return create_job(r, spec=spec).id  # running and active from the start


def _drain(r, job_id: str, n: int) -> list[str]:
    """Consume n prompts as rollout + trainer would (acked and counted as trained)."""
    bus = Bus(r, keys.GROUP_ROLLOUT, "c")
    entries = bus.read([keys.prompts(job_id)], count=n, block_ms=100)
    assert len(entries) == n
    bus.ack(entries, {job_id: {"trained": n}})
    return [decode(e.data, PromptMsg).item_id for e in entries]


def test_feeding_resumes_exactly_across_restarts_and_epoch_boundaries(r, tmp_path):
    job_id = _job(r, tmp_path)
    # Uninterrupted: one feeder feeds and we drain 4 epochs.
    straight = Feeder(r)
    order: list[str] = []
    while len(order) < 4 * ROWS:
        straight.tick()
        order += _drain(r, job_id, _pending(r, job_id))
    first_epoch = order[:ROWS]
    assert sorted(first_epoch) == sorted(f"r{i}" for i in range(ROWS))  # an epoch is every row once

    # Again, from scratch, with a new Feeder (an api restart) after every tick: the same order.
    for k in keys.job_streams(job_id):
        r.delete(k)
    r.delete(keys.ledger(job_id))
    pipe = r.pipeline(transaction=True)
    init_ledger(pipe, job_id)  # as at creation: a feeder never feeds a job without its ledger
    pipe.execute()
    Bus.ensure_groups(r, job_id)
    restarted: list[str] = []
    while len(restarted) < 4 * ROWS:
        Feeder(r).tick()
        restarted += _drain(r, job_id, _pending(r, job_id))
    assert restarted[: 4 * ROWS] == order[: 4 * ROWS]
    # The fed position sits on epoch boundaries here (the window is 2 epochs): still exact.
    assert r.hget(keys.ledger(job_id), "fed") == str(len(restarted)).encode()


def _pending(r, job_id: str) -> int:
    """Prompts in the stream not yet read by rollout."""
    info = {g["name"].decode(): g for g in r.xinfo_groups(keys.prompts(job_id))}[keys.GROUP_ROLLOUT]
    return len(r.xrange(keys.prompts(job_id), f"({info['last-delivered-id'].decode()}", "+"))


def test_prompt_payload_is_the_row(r, tmp_path):
    job_id = _job(r, tmp_path)
    Feeder(r).tick()
    [(_, f)] = r.xrange(keys.prompts(job_id), count=1)
    msg = decode(f[FIELD], PromptMsg)
    assert msg.prompt.startswith("q") and msg.fields["answer"] == msg.prompt[1:]
