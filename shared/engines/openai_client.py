"""The plumbing of a client of an OpenAI-compatible vLLM server, shared by the rollout
engine and the ref scorer in remote mode (an MI50 box's gfx906 fork, or any vLLM).

Transport failures (refused, timed out, reset) and 5xx become the caller's own
"engine away" error, so each service keeps its retry logic; 4xx is left to the caller,
since what a refused request means differs (a bad input for ref, a lost adapter for rollout).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from shared.redact import redact_url


class OpenAIClient:
    def __init__(
        self, *, url: str, api_key: str, timeout_s: float, concurrency: int, thread_name: str, away: type[Exception]
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        base = url.rstrip("/").removesuffix("/v1")  # a base URL; a trailing /v1 is tolerated
        self.http = httpx.Client(base_url=base, headers=headers, timeout=timeout_s)
        self.url = redact_url(base)  # what messages (and /readyz, which needs no token) show: never a password
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=thread_name)
        self._away = away

    def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            return self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise self._away(f"remote engine {self.url} unreachable: {type(e).__name__}: {e}") from e

    def base_models(self) -> list[dict[str, Any]]:
        """The server's base-model cards (`/v1/models` minus LoRA cards, which name a parent)."""
        try:
            resp = self.http.get("/v1/models")
        except httpx.HTTPError as e:
            raise self._away(f"remote engine {self.url} unreachable: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise self._away(f"remote engine {self.url}/v1/models: HTTP {resp.status_code}: {resp.text[:200]}")
        return [m for m in resp.json().get("data", []) if not m.get("parent")]

    def check(self) -> None:
        try:
            resp = self.http.get("/health", timeout=5)
        except httpx.HTTPError as e:
            raise self._away(f"remote engine {self.url} unreachable: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise self._away(f"remote engine {self.url}/health: HTTP {resp.status_code}")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
