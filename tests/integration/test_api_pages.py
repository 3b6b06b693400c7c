"""Issue 47 item 1: the control plane at many jobs. GET /v1/jobs pages the job table newest first
(a signed cursor, a state filter), `burstrl jobs` follows the pages, and the dashboard reads the
active jobs and the newest few, never the whole table. The real api app over a real Redis.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest

from shared import keys
from shared.job import index_member
from tests.support.api import api_client
from tests.support.api import served as serve
from tests.support.cli import burstrl

TOKEN = "pages-test-token-0123456789ab"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(r, redis_server):
    with api_client(redis_server.url, TOKEN) as c:
        yield c


def _submit(client, n: int, name: str = "p") -> list[str]:
    """n jobs, oldest first."""
    ids = []
    for _ in range(n):
        resp = client.post("/v1/jobs", json={"name": name, "base_model": "m", "eval_size": 0})
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    return ids


def _pages(client, **params) -> list[list[str]]:
    """The ids of every page, following `Link: <...>; rel="next"`."""
    out = []
    resp = client.get("/v1/jobs", params=params)
    while True:
        assert resp.status_code == 200, resp.text
        out.append([j["id"] for j in resp.json()])
        nxt = resp.links.get("next")
        if nxt is None:
            return out
        resp = client.get(nxt["url"])


def _cursor(client, **params) -> str:
    return httpx.URL(client.get("/v1/jobs", params=params).links["next"]["url"]).params["cursor"]


def test_pages_are_newest_first_and_cover_every_job_once(client):
    ids = _submit(client, 7)
    pages = _pages(client, limit=3)
    assert [len(p) for p in pages] == [3, 3, 1]
    assert sum(pages, []) == ids[::-1]
    # A job deleted between two pages does not shift the next one (the cursor is a position, not an offset).
    first = client.get("/v1/jobs", params={"limit": 3})
    gone = ids[-4]  # the first job of the second page
    assert client.post(f"/v1/jobs/{gone}/cancel").status_code == 200
    assert client.delete(f"/v1/jobs/{gone}").status_code == 200
    second = client.get(first.links["next"]["url"]).json()
    assert [j["id"] for j in second] == ids[-5:-8:-1]


def test_the_state_filter_pages_only_that_state(client):
    ids = _submit(client, 6)
    for job in ids[:4]:
        client.post(f"/v1/jobs/{job}/cancel")
    client.post(f"/v1/jobs/{ids[4]}/pause")
    assert sum(_pages(client, state="cancelled", limit=3), []) == ids[3::-1]
    assert sum(_pages(client, state="running"), []) == [ids[5]]
    assert sum(_pages(client, state="paused"), []) == [ids[4]]
    client.post(f"/v1/jobs/{ids[4]}/resume")  # moves between the state indexes with the record
    assert sum(_pages(client, state="running"), []) == [ids[5], ids[4]]
    assert _pages(client, state="completed") == [[]]
    bad = client.get("/v1/jobs", params={"state": "sleeping"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "state"]


def _forge(cursor: str, member: str) -> str:
    body, _, sig = cursor.partition(".")
    fields = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    fields["m"] = member
    forged = base64.urlsafe_b64encode(json.dumps(fields, separators=(",", ":")).encode()).decode().rstrip("=")
    return f"{forged}.{sig}"


def test_a_forged_or_stale_cursor_is_a_422_naming_it(client, r):
    ids = _submit(client, 3)
    cursor = _cursor(client, limit=1)
    assert [j["id"] for j in client.get("/v1/jobs", params={"limit": 1, "cursor": cursor}).json()] == [ids[1]]
    newest = json.loads(r.hget(keys.jobs_index(), ids[2]))["created_at"]
    for bad in [
        _forge(cursor, index_member(ids[2], newest + 1)),  # a position it was not given
        cursor[:-2],  # cut
        "not-a-cursor",
        "a.b.c",
        "\u00e9t\u00e9",
    ]:
        resp = client.get("/v1/jobs", params={"limit": 1, "cursor": bad})
        assert resp.status_code == 422, (bad, resp.text)
        (err,) = resp.json()["detail"]
        assert err["loc"] == ["query", "cursor"] and "start again without it" in err["msg"]
    # Issued for another query: named as such.
    resp = client.get("/v1/jobs", params={"state": "running", "cursor": cursor})
    assert resp.status_code == 422 and "state" in resp.json()["detail"][0]["msg"]
    # Stale: Redis lost its data (the signing key went with it) since the cursor was issued.
    r.delete(keys.page_key())
    resp = client.get("/v1/jobs", params={"limit": 1, "cursor": cursor})
    assert resp.status_code == 422 and "stale" in resp.json()["detail"][0]["msg"]
    too_long = client.get("/v1/jobs", params={"cursor": "x" * 600})
    assert too_long.status_code == 422 and too_long.json()["detail"][0]["loc"] == ["query", "cursor"]


def test_the_indexes_are_rebuilt_from_the_records_when_missing(client, r):
    """A Redis written before the indexes existed (or a record written by hand): the listing
    rebuilds them from the records, and pages as before."""
    ids = _submit(client, 5)
    client.post(f"/v1/jobs/{ids[1]}/cancel")
    r.delete(keys.jobs_by_created(), *(keys.jobs_in_state(s) for s in ("running", "cancelled")))
    assert sum(_pages(client, limit=2), []) == ids[::-1]
    assert sum(_pages(client, state="cancelled"), []) == [ids[1]]
    assert r.zcard(keys.jobs_by_created()) == 5


def test_the_cli_follows_every_page(client, r):
    ids = _submit(client, 205, name="cli")  # three pages of the default 100
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    with serve(client.app) as url:

        def run(*args: str) -> list[str]:
            out = burstrl("jobs", "--api", url, *args, BURSTRL_TOKEN=TOKEN)
            assert out.returncode == 0, out.stderr
            return [line.split()[0] for line in out.stdout.splitlines() if line.startswith("cli-")]

        assert run() == ids[::-1]
        assert run("--state", "cancelled") == [ids[0]]


def test_the_dashboard_reads_the_active_jobs_and_the_newest_few(client, r):
    """O(active jobs): an old finished job is not read (an unreadable one among them is not
    reported), every active one is, however old, and so are the newest few of any state."""
    from services.api.jobs import DASHBOARD_RECENT

    old_running = _submit(client, 1, name="old")[0]
    finished = _submit(client, DASHBOARD_RECENT + 10, name="done")
    for job in finished:
        client.post(f"/v1/jobs/{job}/cancel")
    newest_running = _submit(client, 2, name="new")
    # An unreadable record among the old finished ones: the dashboard never reads it.
    rec = json.loads(r.hget(keys.jobs_index(), finished[0]))
    r.hset(keys.jobs_index(), finished[0], json.dumps({**rec, "spec": {**rec["spec"], "tis_cap": None}}))
    dash = client.get("/v1/dashboard").json()
    shown = [j["id"] for j in dash["jobs"]]
    want = [*newest_running[::-1], *finished[::-1][: DASHBOARD_RECENT - 2], old_running]
    assert shown == want
    assert dash["unreadable"] == {}
    # GET /v1/jobs names it, on the page that holds it.
    last = _pages(client, limit=100)
    assert finished[0] not in sum(last, [])
    resp = client.get("/v1/jobs", params={"state": "cancelled", "limit": 100})
    assert resp.headers["x-burstrl-unreadable-jobs"] == finished[0]


def test_jobs_registered_again_after_redis_lost_them_are_paged(r, redis_server, tmp_path):
    """`burstrl recover` after Redis came back empty: the recovered jobs are in the indexes, in
    their first order (their records keep their creation time)."""
    store_url = f"file://{tmp_path / 'store'}"
    with api_client(redis_server.url, TOKEN, store_url) as c:
        ids = _submit(c, 4)
        c.post(f"/v1/jobs/{ids[0]}/cancel")  # cancelled after its copy was saved: recovered as running
        r.flushall()  # Redis lost everything; the store's copies remain
        assert _pages(c) == [[]]
        assert sorted(c.post("/v1/orphans/recover").json()["recovered"]) == sorted(ids)
        assert sum(_pages(c, limit=3), []) == ids[::-1]
        assert sum(_pages(c, state="running"), []) == ids[::-1]
