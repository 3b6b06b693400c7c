"""The api in-process for its tests: a TestClient with the token set, and the same app on a real
uvicorn server on a free port, configured as every service's is (the api's own HTTP stack, for
clients that speak real HTTP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from services.api.app import build_routes
from services.api.settings import ApiSettings
from services.cli.launch import free_port
from shared.service import ServiceRuntime
from shared.store import open_store


@contextmanager
def api_client(redis_url: str, token: str, store_url: str | None = None) -> Iterator[TestClient]:
    """The api app over `redis_url` (and the job copies in `store_url`, when given), token set."""
    if store_url is None:
        rt = ServiceRuntime("api", ApiSettings(redis_url=redis_url, token=token))
        build_routes(rt)
    else:
        rt = ServiceRuntime("api", ApiSettings(redis_url=redis_url, token=token, store_url=store_url))
        build_routes(rt, open_store(store_url))
    with TestClient(rt.app) as c:
        c.headers["Authorization"] = f"Bearer {token}"
        yield c


@contextmanager
def served(app: object) -> Iterator[str]:
    """`app` on uvicorn at 127.0.0.1:<free port>; yields its base URL."""
    import uvicorn

    from shared.http_door import server_config
    from shared.settings import CommonSettings

    port = free_port()
    # The door every service's server keeps, at its default settings (shared/http_door.py).
    server = uvicorn.Server(server_config(app, CommonSettings(dev=True), host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
