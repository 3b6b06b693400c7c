"""The control plane at 10,000 jobs, ids under contention, and the HTTP door (issue 47 items 1-3),
this tree's api against an older revision's, side by side on one Redis.

    .venv/bin/python bench/control_plane.py [--jobs 10000] [--old-rev main] [--out bench/results/control_plane.md]

A redis-server of its own (tests/support/servers.py) and the services as real processes
(`python -m services.<role>`, run from this tree, and from `--old-rev` extracted with `git archive`),
one api at a time; the feeder is left idle (a long feed interval, no trainer) so the timings are
the request paths alone.

1. ids: `--jobs` submissions of one job name over HTTP, 16 at a time, to each api on a Redis
   database of its own: answered 201 against jobs stored (overwritten = the difference);
2. many jobs: on the database this tree's api filled, all but 50 jobs cancelled; then a page of
   `GET /v1/jobs` (the first and one from the middle, and `?state=running`) and `/v1/dashboard`,
   timed on this tree's api, and the old api's whole `GET /v1/jobs` and `/v1/dashboard` on the
   same data;
3. the door, for each tree, with the services started under a soft open-file limit of 1,024 (the
   common default): 1,100 idle connections held while 20 requests are timed; a 100 MiB header to
   the api; an unauthenticated 200 MiB body to the api and to the reward service: each process's
   RSS and peak RSS growth (/proc).

With `--out`, its page there and its results (with its headline figures) beside it as JSON
(tests/support/lab/results.py); `--report-only JSON` rebuilds both from such results. Imports only
the product and tests/support.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis as redis_lib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.api import jobs  # noqa: E402
from services.cli.launch import free_port, terminate  # noqa: E402
from shared import keys  # noqa: E402
from shared.job import JobSpec, JobState  # noqa: E402
from tests.support.lab.results import Figure, emit, figure, shown_command, table  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

TOKEN = "bench-control-plane-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIB = 1 << 20
ACTIVE = 50
IDLE = 1100


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _timed(fn: Callable[[], httpx.Response], n: int) -> dict[str, Any]:
    took, statuses, size = [], set(), 0
    for _ in range(n):
        t0 = time.perf_counter()
        resp = fn()
        took.append(time.perf_counter() - t0)
        statuses.add(resp.status_code)
        size = len(resp.content)
    took.sort()
    return {
        "n": n,
        "median_ms": round(1000 * statistics.median(took), 1),
        "p95_ms": round(1000 * took[min(n - 1, int(0.95 * n))], 1),
        "max_ms": round(1000 * took[-1], 1),
        "statuses": sorted(statuses),
        "bytes": size,
    }


class Tree:
    """A source tree to run services from: this one, or an old revision extracted from git."""

    def __init__(self, name: str, path: Path, rev: str) -> None:
        self.name, self.path, self.rev = name, path, rev

    @contextmanager
    def service(
        self, role: str, redis_url: str, home: Path, *, soft_files: int | None = None, **env: str
    ) -> Iterator[tuple[int, str]]:
        """`python -m services.<role>` run from this tree (its cwd and PYTHONPATH: the tree's code,
        not the installed one); yields (pid, base URL) once ready; stopped by its pid."""
        port = free_port()
        full = {
            **os.environ,
            "PYTHONPATH": str(self.path),
            "REDIS_URL": redis_url,
            "STORE_URL": f"file://{home / 'store'}",
            "BURSTRL_TOKEN": TOKEN,
            "BURSTRL_PORT": str(port),
            "BURSTRL_DATA_DIR": str(home / role),
            "BURSTRL_API_FEED_INTERVAL_S": "3600",
            "BURSTRL_REPLICA": f"bench-{self.name}-{role}",
            "BURSTRL_ROLLOUT_MODEL": "m",
            **env,
        }

        def limit() -> None:
            if soft_files is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        log = open(home / f"{self.name}-{role}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{role}"],
            cwd=self.path,
            env=full,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=limit,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                try:
                    if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{self.name} {role} did not start: see {log.name}")
                time.sleep(0.3)
            yield proc.pid, url
        finally:
            terminate(proc.pid, 20)
            log.close()


def submissions(api: str, n: int) -> dict[str, Any]:
    """n same-name submissions, 16 at a time."""
    body = {"name": "same", "base_model": "m", "eval_size": 0}

    def one(_: int) -> tuple[int, str]:
        with httpx.Client(headers=AUTH, timeout=120) as c:
            resp = c.post(f"{api}/v1/jobs", json=body)
            return resp.status_code, resp.json().get("id", "") if resp.status_code == 201 else ""

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(n)))
    created = [i for s, i in got if s == 201]
    return {
        "submitted": n,
        "answered_201": len(created),
        "distinct_ids": len(set(created)),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def many_jobs(new: Tree, old: Tree | None, redis: RedisServer, db: int, home: Path) -> dict[str, Any]:
    url = f"{redis.url.rsplit('/', 1)[0]}/{db}"
    out: dict[str, Any] = {}
    with new.service("api", url, home) as (_, api):
        with httpx.Client(base_url=api, headers=AUTH, timeout=300) as c:
            first = c.get("/v1/jobs", params={"limit": 100})
            cursor = None
            resp = first
            for _ in range(50):  # the middle of 10,000 at 100 a page
                nxt = resp.links.get("next")
                if not nxt:
                    break
                cursor = httpx.URL(nxt["url"]).params["cursor"]
                resp = c.get("/v1/jobs", params={"limit": 100, "cursor": cursor})
            out["new"] = {
                "jobs_first_page": _timed(lambda: c.get("/v1/jobs", params={"limit": 100}), 30),
                "jobs_page_50": _timed(lambda: c.get("/v1/jobs", params={"limit": 100, "cursor": cursor}), 30),
                "jobs_running": _timed(lambda: c.get("/v1/jobs", params={"state": "running", "limit": 100}), 30),
                "dashboard": _timed(lambda: c.get("/v1/dashboard"), 30),
            }
    if old is not None:
        with old.service("api", url, home) as (_, api), httpx.Client(base_url=api, headers=AUTH, timeout=600) as c:
            out["old"] = {
                "jobs_all": _timed(lambda: c.get("/v1/jobs"), 3),
                "dashboard": _timed(lambda: c.get("/v1/dashboard"), 2),
            }
    return out


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _status(s: socket.socket) -> int | str:
    try:
        head = s.recv(4096)
        return int(head.split(b" ", 2)[1]) if head else "closed"
    except (OSError, IndexError, ValueError) as e:
        return type(e).__name__


def door(tree: Tree, redis_url: str, home: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with (
        tree.service("api", redis_url, home, soft_files=1024) as (api_pid, api),
        tree.service("reward", redis_url, home, soft_files=1024) as (reward_pid, reward),
    ):
        limits = Path(f"/proc/{api_pid}/limits").read_text().splitlines()
        out["api_soft_open_files"] = int(next(x for x in limits if "open files" in x).split()[3])
        # 1,100 idle connections, then 20 normal requests.
        idle = []
        for _ in range(IDLE):
            try:
                idle.append(_connect(api))
            except OSError:
                break
        took, failed = [], 0
        for i in range(20):
            t0 = time.perf_counter()
            try:
                resp = (
                    httpx.get(f"{api}/v1/jobs", headers=AUTH, timeout=5)
                    if i % 2
                    else httpx.get(f"{api}/readyz", timeout=5)
                )
                failed += resp.status_code >= 400
            except httpx.HTTPError:
                failed += 1
            took.append(time.perf_counter() - t0)
        for s in idle:
            s.close()
        out["idle_connections"] = {
            "held": len(idle),
            "requests": 20,
            "failed": failed,
            "median_ms": round(1000 * statistics.median(took), 1),
            "max_ms": round(1000 * max(took), 1),
        }
        time.sleep(2)
        # A 100 MiB header to the api.
        before = (_status_mb(api_pid, "VmRSS"), _status_mb(api_pid, "VmHWM"))
        s, sent = _connect(api), 0
        s.settimeout(60)
        try:
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while sent < 100 * MIB:
                s.sendall(b"a" * MIB)
                sent += MIB
            s.sendall(b"\r\n\r\n")
        except OSError:
            pass
        answer = _status(s)
        s.close()
        time.sleep(1)
        out["header_100mib"] = {
            "sent_mib": sent // MIB,
            "answer": answer,
            "rss_growth_mb": round(_status_mb(api_pid, "VmRSS") - before[0], 1),
            "peak_growth_mb": round(_status_mb(api_pid, "VmHWM") - before[1], 1),
        }
        # An unauthenticated 200 MiB body to each.
        for role, pid, url, path in (
            ("api", api_pid, api, "/v1/jobs"),
            ("reward", reward_pid, reward, "/v1/sandbox/run"),
        ):
            before = (_status_mb(pid, "VmRSS"), _status_mb(pid, "VmHWM"))
            s = _connect(url)
            s.settimeout(120)
            try:
                s.sendall(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {200 * MIB}\r\n\r\n".encode()
                )
                chunk = b"{" + b" " * (MIB - 1)
                for _ in range(200):
                    s.sendall(chunk)
            except OSError:
                pass
            answer = _status(s)
            s.close()
            time.sleep(1)
            out[f"unauthenticated_body_200mib_{role}"] = {
                "answer": answer,
                "rss_growth_mb": round(_status_mb(pid, "VmRSS") - before[0], 1),
                "peak_growth_mb": round(_status_mb(pid, "VmHWM") - before[1], 1),
            }
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    skip = set(filter(None, args.skip.split(",")))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the 1,100 sockets
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result: dict[str, Any] = {
        "bench": "control_plane",
        "commit": here.strip(),
        "old_rev": args.old_rev or None,
        "jobs": args.jobs,
        "active": ACTIVE,
    }
    with tempfile.TemporaryDirectory(prefix="burstrl-cp-") as tmp:
        home = Path(tmp)
        new = Tree("new", ROOT, result["commit"])
        old = None
        if args.old_rev:
            (home / "old").mkdir()
            archive = subprocess.run(["git", "archive", args.old_rev], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(home / "old")], input=archive, check=True)
            old = Tree("old", home / "old", args.old_rev)
        (home / "redis").mkdir()
        redis = RedisServer(home / "redis")
        redis.start()
        try:
            base = redis.url.rsplit("/", 1)[0]
            if "ids" not in skip:
                result["ids"] = {}
                for tree, db in ((new, 1), (old, 2)):
                    if tree is None:
                        continue
                    with tree.service("api", f"{base}/{db}", home) as (_, api):
                        got = submissions(api, args.jobs)
                    r = redis_lib.Redis.from_url(f"{base}/{db}")
                    got["stored"] = int(r.hlen(keys.jobs_index()))
                    got["overwritten"] = got["answered_201"] - got["stored"]
                    result["ids"][tree.name] = got
                    print(tree.name, "ids:", got, flush=True)
            if "many" not in skip:
                r = redis_lib.Redis.from_url(f"{base}/1")
                ids = sorted(m.decode() for m in r.hkeys(keys.jobs_index()))
                if len(ids) < args.jobs:  # the ids part was skipped: fill through the domain function
                    for _ in range(args.jobs - len(ids)):
                        jobs.create_job(r, spec=JobSpec(name="same", base_model="m", eval_size=0))
                    ids = sorted(m.decode() for m in r.hkeys(keys.jobs_index()))
                for job_id in ids[ACTIVE:]:
                    if jobs.get_job(r, job_id=job_id).state != JobState.cancelled:
                        jobs.transition(r, job_id=job_id, action="cancel")
                result["many_jobs"] = many_jobs(new, old, redis, 1, home)
                print("many jobs:", json.dumps(result["many_jobs"]), flush=True)
            if "door" not in skip:
                result["door"] = {}
                for i, tree in enumerate((new, old)):
                    if tree is not None:
                        result["door"][tree.name] = door(tree, f"{base}/{3 + i}", home)
                        print(tree.name, "door:", json.dumps(result["door"][tree.name]), flush=True)
        finally:
            redis.kill()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return result


def _ms(x: dict[str, Any] | None) -> str:
    return f"{x['median_ms']:g} ms (p95 {x['p95_ms']:g})" if x else "-"


def figures(d: dict[str, Any]) -> list[Figure]:
    """The issue's targets, this tree against the old revision where it ran."""
    out: list[Figure] = []
    n, many = d["jobs"], d.get("many_jobs") or {}
    new, old = many.get("new") or {}, many.get("old") or {}
    if new:
        page, dash = new["jobs_first_page"], new["dashboard"]
        whole, old_dash = old.get("jobs_all"), old.get("dashboard")
        out.append(
            figure(
                f"GET /v1/jobs at {n:,} jobs: a page of 100 (median), against the whole list",
                f"{page['median_ms']:g} ms",
                f"{whole['median_ms']:g} ms" if whole else None,
                whole["median_ms"] / page["median_ms"] if whole else None,
                "<= 100 ms",
            )
        )
        out.append(
            figure(
                f"/v1/dashboard at {n:,} jobs, {d['active']} active (median)",
                f"{dash['median_ms']:g} ms",
                f"{old_dash['median_ms']:g} ms" if old_dash else None,
                old_dash["median_ms"] / dash["median_ms"] if old_dash else None,
                "<= 200 ms",
            )
        )
    ids = d.get("ids") or {}
    if "new" in ids:
        o = ids.get("old")
        out.append(
            figure(
                f"jobs overwritten in {ids['new']['submitted']:,} same-name submissions",
                str(ids["new"]["overwritten"]),
                str(o["overwritten"]) if o else None,
                None,
                "0",
            )
        )
    door_new, door_old = (d.get("door") or {}).get("new"), (d.get("door") or {}).get("old")
    if door_new:
        idle, idle_old = door_new["idle_connections"], (door_old or {}).get("idle_connections")
        out.append(
            figure(
                f"normal requests with {idle['held']:,} idle connections held: failed, slowest",
                f"{idle['failed']}/{idle['requests']} failed, slowest {idle['max_ms']:g} ms",
                f"{idle_old['failed']}/{idle_old['requests']} failed" if idle_old else None,
                None,
                "served within 2 s",
            )
        )
        for key, what in (
            ("header_100mib", "a 100 MiB header: the api's peak RSS growth"),
            (
                "unauthenticated_body_200mib_reward",
                "an unauthenticated 200 MiB body: the reward service's peak RSS growth",
            ),
        ):
            mine, theirs = door_new[key], (door_old or {}).get(key)
            out.append(
                figure(
                    what,
                    f"{mine['peak_growth_mb']:g} MB ({mine['answer']})",
                    f"{theirs['peak_growth_mb']:g} MB ({theirs['answer']})" if theirs else None,
                    None,
                    "<= 10 MB",
                )
            )
    return out


def report(d: dict[str, Any], cmd: str) -> str:
    old = d.get("old_rev") or "none"
    lines = [
        "# The control plane at many jobs, ids under contention, and the HTTP door",
        "",
        f"`{cmd}`: this tree's services (commit {d['commit']}) against those of `{old}`, on one redis-server, as "
        "real processes (bench/control_plane.py says how each part runs).",
        "",
    ]
    lines += table(
        ["figure", "this tree", old, "target"],
        [(f["figure"], f["value"], f["baseline"] or "-", f["target"] or "-") for f in figures(d)],
    )
    many = d.get("many_jobs") or {}
    if many:
        lines += ["", f"## {d['jobs']:,} jobs, {d['active']} active", ""]
        rows = [(f"{side}: {what}", _ms(x), x["bytes"]) for side, got in many.items() for what, x in got.items()]
        lines += table(["request", "median (p95)", "bytes"], rows)
    if d.get("ids"):
        lines += ["", "## Same-name submissions (16 at a time, over HTTP)", ""]
        lines += table(
            ["api", "answered 201", "distinct ids", "stored", "overwritten", "seconds"],
            [
                (side, x["answered_201"], x["distinct_ids"], x["stored"], x["overwritten"], x["seconds"])
                for side, x in d["ids"].items()
            ],
        )
    if d.get("door"):
        lines += ["", "## The door (services started with a soft open-file limit of 1,024)", ""]
        rows = []
        for side, x in d["door"].items():
            i = x["idle_connections"]
            rows.append(
                (
                    side,
                    x["api_soft_open_files"],
                    f"{i['held']} held: {i['failed']}/{i['requests']} failed, median {i['median_ms']:g} ms, "
                    f"max {i['max_ms']:g} ms",
                    *(
                        f"{x[k]['answer']}, RSS +{x[k]['rss_growth_mb']:g} MB, peak +{x[k]['peak_growth_mb']:g} MB"
                        for k in (
                            "header_100mib",
                            "unauthenticated_body_200mib_api",
                            "unauthenticated_body_200mib_reward",
                        )
                    ),
                )
            )
        lines += table(
            [
                "tree",
                "api open files",
                "idle connections",
                "100 MiB header (api)",
                "200 MiB body (api)",
                "200 MiB body (reward)",
            ],
            rows,
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--old-rev", default="main", help="the revision to compare with ('' for none)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: ids, many, door")
    ap.add_argument("--out", type=Path, default=None, help="The page (and its .json beside it); default: stdout only.")
    ap.add_argument("--report-only", type=Path, default=None, help="Rebuild the page from this results JSON.")
    args = ap.parse_args()
    if args.report_only:
        data = json.loads(args.report_only.read_text())
        cmd = data.get("command") or shown_command(
            __file__, ["--jobs", str(data["jobs"]), "--old-rev", data["old_rev"] or ""]
        )
        data = {k: v for k, v in data.items() if k not in ("command", "headline")}
    else:
        cmd = shown_command(__file__)
        data = measure(args)
    emit(report(data, cmd), args.out, data, figures=figures(data), command=cmd)


if __name__ == "__main__":
    main()
