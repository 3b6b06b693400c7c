"""What every service process shares: health, metrics, heartbeat, HTTP server, stop.

A service's `__main__` builds its settings, a `ServiceRuntime`, and runs its worker
loop in the main thread (vLLM and torch want the main thread); the HTTP server
(/healthz, /readyz, /metrics plus the service's own routes) runs in a daemon thread.
Readiness is a set of named checks the worker updates ("redis", "model", ...), so
/readyz can say exactly why a service is not ready while it keeps running.
"""

from __future__ import annotations

import hmac
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import redis
import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

from shared import __version__, http_errors, keys, redact
from shared.bus import Bus
from shared.dataset import DatasetGuard
from shared.http_door import (
    FILES_BESIDE_CONNECTIONS,
    BodyDeadline,
    TokenGate,
    public_paths,
    raise_open_files,
    server_config,
)
from shared.http_errors import SafeJSONResponse
from shared.redis_conn import RedisPolicyError, check_server, connect, refusal
from shared.schema import Heartbeat, encode_heartbeat
from shared.settings import DEFAULT_PORTS, CommonSettings

log = logging.getLogger(__name__)


def setup_logging(role: str) -> None:
    """The service's log format, with its secrets masked in every line and traceback (shared/redact.py)."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {role:<7} %(levelname)-5s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    redact.install()


class Health:
    """Named readiness checks, updated by the worker, read by /readyz and the heartbeat."""

    def __init__(self) -> None:
        self._checks: dict[str, tuple[bool, str, str]] = {}  # name -> (ok, reason, scope)
        self._lock = threading.Lock()

    def set(self, name: str, ok: bool, reason: str = "", *, scope: str = "service") -> None:
        """`scope="job"`: a problem of one job (say, a refused policy version), shown in the
        checks and as `degraded`, but not a reason to call the whole service unready: its
        other jobs are served, and an orchestrator restarting it would fix nothing."""
        reason = redact.scrub(reason)  # /readyz and the heartbeat show it to anyone
        with self._lock:
            prev = self._checks.get(name)
            self._checks[name] = (ok, reason, scope)
        if prev is None or prev[0] != ok:
            (log.info if ok else log.warning)(
                "%s: %s%s",
                name,
                "ok" if ok else ("NOT ready" if scope == "service" else "degraded"),
                f" ({reason})" if reason else "",
            )

    def snapshot(self) -> tuple[bool, dict[str, dict[str, Any]]]:
        """(ready, checks): ready when every service-scoped check is ok."""
        with self._lock:
            checks = {k: {"ok": ok, "reason": r, "scope": sc} for k, (ok, r, sc) in self._checks.items()}
        return all(c["ok"] for c in checks.values() if c["scope"] == "service") and bool(checks), checks

    def degraded(self) -> bool:
        with self._lock:
            return any(not ok for ok, _, _ in self._checks.values())


# Probes and scrapers carry no secrets: these answer without the token, in every service.
HEALTH_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def token_ok(settings: CommonSettings, authorization: str | None) -> bool:
    """Whether an `Authorization` header holds `Bearer <the token>` (compared in constant time)."""
    if settings.dev and not settings.token:
        return True  # local-dev mode binds to loopback only (enforced by settings)
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), settings.token.encode())


def token_refusal(settings: CommonSettings, authorization: str | None) -> HTTPException | None:
    """The 401 for a request without the token (None: it has it)."""
    if token_ok(settings, authorization):
        return None
    return HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})


def bearer_auth(settings: CommonSettings) -> Callable[..., None]:
    """A dependency that checks the token (the door's TokenGate has checked it already, before
    the body; this keeps a route closed whatever the gate's public paths say, and documents the
    header in the OpenAPI document)."""

    def check(authorization: Annotated[str | None, Header()] = None) -> None:
        if (refused := token_refusal(settings, authorization)) is not None:
            raise refused

    return check


class ServiceRuntime:
    def __init__(self, role: str, settings: CommonSettings) -> None:
        self.role = role
        self.settings = settings
        self.port = settings.port or DEFAULT_PORTS[role]
        self.health = Health()
        self.stop = threading.Event()
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Any] = {}  # extra fields for the heartbeat (e.g. versions)
        self.errors = Counter("burstrl_errors", "Errors survived by the worker loop", ["kind"], registry=self.registry)
        self.up = Gauge("burstrl_ready", "1 when /readyz is ok", registry=self.registry)
        self._threads: list[threading.Thread] = []  # the HTTP server's and the heartbeat's, once started
        try:
            self.redis = connect(settings.redis_url)
        except RedisPolicyError as e:  # REDIS_URL names a cluster, the server is one Redis
            log.critical("%s", e)
            raise SystemExit(2) from e
        self.dataset = DatasetGuard(self.redis)
        self.auth = Depends(bearer_auth(settings))
        # Served without the token (a service adds its own with `publish`).
        self._public_paths = set(HEALTH_PATHS)
        self._public_mounts: set[str] = set()
        self._is_public = public_paths(self._public_paths)
        self._guards: list[tuple[str, Callable[[Headers], HTTPException | None]]] = []
        self.app = self._build_app()
        self.started_at = time.time()

    def _build_app(self) -> FastAPI:
        # Every answer encodes, and every error answer is small (shared/http_errors.py).
        app = FastAPI(title=f"burstrl {self.role}", version=__version__, default_response_class=SafeJSONResponse)
        http_errors.install(app)
        # The door (shared/http_door.py): the token from the head before any body is read, and a
        # deadline for the body. Middleware added last runs first: the gate, then the deadline.
        app.add_middleware(BodyDeadline, timeout_s=self.settings.http_body_timeout_s)
        app.add_middleware(TokenGate, refusal=self._refusal)

        @app.get("/healthz", tags=["health"])
        def healthz() -> dict[str, Any]:
            return {
                "status": "alive",
                "role": self.role,
                "replica": self.settings.replica,
                "version": __version__,
                "uptime_s": round(time.time() - self.started_at, 1),
            }

        @app.get("/readyz", tags=["health"])
        def readyz() -> JSONResponse:
            ok, checks = self.health.snapshot()
            body = {"ready": ok, "degraded": not all(c["ok"] for c in checks.values()), "role": self.role}
            return JSONResponse({**body, "checks": checks}, status_code=200 if ok else 503)

        @app.get("/metrics", tags=["health"])
        def metrics() -> Response:
            self.up.set(1 if self.health.snapshot()[0] else 0)
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return app

    def guard(self, prefix: str, check: Callable[[Headers], HTTPException | None]) -> None:
        """Check requests under `prefix` with `check(headers)`, the refusal to answer or None
        (another credential than the token: the Tinker API's key), instead of the token."""
        self._guards.append((prefix, check))

    def _refusal(self, path: str, headers: Headers) -> HTTPException | None:
        """What the door answers a request for `path` before its body (None: let it in)."""
        if self._is_public(path):
            return None
        for prefix, check in self._guards:
            if path.startswith(prefix):
                return check(headers)
        return token_refusal(self.settings, headers.get("authorization"))

    def publish(self, *paths: str, mounts: tuple[str, ...] = ()) -> None:
        """Serve `paths` (exactly) and everything under `mounts` without the token."""
        self._public_paths.update(paths)
        self._public_mounts.update(mounts)
        self._is_public = public_paths(self._public_paths, self._public_mounts)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        """Start the HTTP server and heartbeat threads; SIGTERM/SIGINT set `stop`."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        raise_open_files(self.settings.http_max_connections + FILES_BESIDE_CONNECTIONS)
        config = server_config(self.app, self.settings, host=self.settings.host, port=self.port)
        self._server = uvicorn.Server(config)
        self._threads = [
            threading.Thread(target=self._server.run, name="http", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("%s listening on http://%s:%d", self.role, self.settings.host, self.port)

    def shutdown(self) -> None:
        self.stop.set()
        try:
            self.redis.delete(keys.service(self.role, self.settings.replica))
        except redis.RedisError:
            pass
        if hasattr(self, "_server"):
            self._server.should_exit = True

    def _heartbeat_loop(self) -> None:
        period = self.settings.heartbeat_s
        while not self.stop.is_set():
            try:
                self.redis.ping()
                lost = self.dataset.check()
                self.health.set("redis", not lost, lost)
                ok, checks = self.health.snapshot()
                beat = Heartbeat(
                    role=self.role,
                    replica=self.settings.replica,
                    host=socket.gethostname(),
                    port=self.port,
                    version=__version__,
                    ready=ok,
                    reasons={k: c["reason"] for k, c in checks.items() if not c["ok"]},
                    at=time.time(),
                    dataset=self.dataset.id,
                    **self.gauges,
                )
                key = keys.service(self.role, self.settings.replica)
                self.redis.set(key, encode_heartbeat(beat), ex=int(period * 5) + 1)
            except redis.RedisError as e:
                self.health.set("redis", False, f"{type(e).__name__}: {e}")
            self.stop.wait(period)

    def preflight(self) -> None:
        """Wait for Redis (not-ready meanwhile), then refuse to run on an evicting server, or with
        credentials or a certificate that waiting cannot make good (exit 2, the fix in the log)."""
        delay = 0.25
        while not self.stop.is_set():
            try:
                self.redis.ping()
                break
            except redis.ConnectionError as e:
                if why := refusal(e):
                    self._refuse(why, e)
                self.health.set("redis", False, f"unreachable: {e}")
                self.stop.wait(delay)
                delay = min(10.0, delay * 2)
        try:
            for w in check_server(self.redis):
                log.warning("%s", w)
        except RedisPolicyError as e:
            self._refuse(str(e), e)
        log.info("redis: dataset %s", self.dataset.attach())
        self.health.set("redis", True)

    def _refuse(self, why: str, e: Exception) -> NoReturn:
        """Exit 2 with the fix in the log, once the HTTP server and the heartbeat have stopped.
        Raised with them still running, the interpreter's exit raced a live uvicorn thread: a
        refused service died of SIGSEGV (-11) instead of exiting 2, once in CI."""
        log.critical("%s", why)
        self.shutdown()
        for t in self._threads:
            t.join(timeout=10)
        raise SystemExit(2) from e

    # -- worker helpers ------------------------------------------------------------
    def stage_bus(self, group: str) -> Bus:
        """This replica as a consumer of `group` (its stage's consumer group), named by the replica id:
        it takes over entries pending past claim_idle_s, and at once those of a replica of this role
        whose heartbeat expired."""
        return Bus(
            self.redis,
            group,
            self.settings.replica,
            heartbeat_role=self.role,
            claim_idle_ms=int(self.settings.claim_idle_s * 1000),
        )

    def run(
        self,
        tick: Callable[[], None],
        *,
        close: Callable[[], None] | None = None,
        watch: Callable[[], None] | None = None,
    ) -> None:
        """A service's main loop: `tick` under `survive` until stopped (SIGTERM), then `close`
        (what the worker holds: an engine, scoring processes) and `shutdown`, which runs even if
        `close` raises: the replica's heartbeat and HTTP server must not outlive its worker.

        `watch`: read-only checks run before every tick, also while the worker pauses because
        Redis lost its dataset (the api's orphan check: it is how the loss shows from the store,
        and it stayed `ok` while paused with the rest)."""
        try:
            while not self.stop.is_set():
                if watch is not None:
                    self._watch(watch)
                self.survive(tick)
            if close is not None:
                close()
        finally:
            self.shutdown()

    def _watch(self, watch: Callable[[], None]) -> None:
        try:
            watch()
        except Exception as e:  # a check that cannot run says so in the log; the worker goes on
            self.errors.labels("watch").inc()
            log.warning("check failed: %s: %s", type(e).__name__, e)

    def survive(self, fn: Callable[[], None], *, backoff_s: float = 1.0) -> None:
        """Run one worker iteration; on error, report it and back off instead of dying.

        A lost Redis makes the service not-ready (with the reason) until it is back;
        any other error is logged and counted, and the loop goes on. While Redis has lost
        the dataset this service started on, the worker pauses: acting on an emptied Redis
        would only recreate state that hides the loss.
        """
        try:
            if lost := self.dataset.check():
                self.health.set("redis", False, lost)
                self.stop.wait(max(backoff_s, 2.0))
                return
            fn()
        except redis.ConnectionError as e:
            self.health.set("redis", False, f"unreachable: {e}")
            self.errors.labels("redis").inc()
            self.stop.wait(backoff_s)
        except redis.RedisError as e:
            self.errors.labels("redis").inc()
            log.warning("redis error: %s", e)
            self.stop.wait(backoff_s)
        except Exception:
            self.errors.labels("worker").inc()
            log.exception("worker iteration failed; carrying on")
            self.stop.wait(backoff_s)


def active_job_ids(r: redis.Redis) -> list[str]:
    return sorted(m.decode() for m in r.smembers(keys.active_jobs()))
