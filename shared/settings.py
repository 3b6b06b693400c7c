"""Settings shared by every service; each service extends `CommonSettings` with its own.

Filled from the environment (pydantic-settings). `REDIS_URL` and `STORE_URL` keep their
plain names because compose files and other tools use them; everything else is
prefixed `BURSTRL_` (and `BURSTRL_<ROLE>_` for a service's own fields).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.limits import Shown

PLACEHOLDER_TOKENS = {"", "changeme", "change-me", "secret", "token", "dev", "password"}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class CommonSettings(BaseSettings):
    """What every service needs: where Redis and the object store are, and the token."""

    # Common fields carry explicit aliases, so a service's own env_prefix
    # (BURSTRL_ROLLOUT_, ...) applies only to the fields it adds.
    # hide_input_in_errors: an error never echoes the settings it read (it printed the start of
    # the Redis password in REDIS_URL, and the token); every service's settings inherit it.
    model_config = SettingsConfigDict(
        env_prefix="BURSTRL_", extra="ignore", populate_by_name=True, hide_input_in_errors=True
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("REDIS_URL", "BURSTRL_REDIS_URL"),
        description="Redis DSN: redis:// or rediss:// (with a password for cross-site use) for one Redis; "
        "redis+cluster:// or rediss+cluster:// (any node) for a Redis Cluster.",
    )
    store_url: str = Field(
        "file://.burstrl/store",
        validation_alias=AliasChoices("STORE_URL", "BURSTRL_STORE_URL"),
        description="Object store: file://<dir> or s3://bucket/prefix.",
    )
    token: str = Field(
        "", validation_alias="BURSTRL_TOKEN", description="Bearer token for every HTTP endpoint but health."
    )
    dev: bool = Field(
        False, validation_alias="BURSTRL_DEV", description="Local-dev mode: placeholder token allowed, loopback only."
    )
    host: str = Field(
        "127.0.0.1", validation_alias="BURSTRL_HOST", description="Bind address of the service's HTTP server."
    )
    port: int = Field(
        0, validation_alias="BURSTRL_PORT", ge=0, le=65535, description="HTTP port; 0 uses the role's default."
    )
    replica: Annotated[str, Shown] = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        validation_alias="BURSTRL_REPLICA",
        description="Replica id shown in the service registry.",
    )
    data_dir: Path = Field(
        Path(".burstrl"), validation_alias="BURSTRL_DATA_DIR", description="Local scratch (adapter cache, logs)."
    )
    heartbeat_s: float = Field(
        2.0, validation_alias="BURSTRL_HEARTBEAT_S", gt=0, description="Heartbeat period into Redis."
    )
    claim_idle_s: float = Field(
        120.0,
        validation_alias="BURSTRL_CLAIM_IDLE_S",
        gt=0,
        le=86_400,
        description="An entry pending this long on a consumer that still heartbeats is taken over by another "
        "replica (XAUTOCLAIM); set it above the slowest stage's handling time (long completions on slow cards). "
        "Entries of a replica whose heartbeat expired are taken over at once.",
    )

    # The HTTP server's door (shared/http_door.py): what a client may hold of it, and for how long.
    http_max_connections: int = Field(
        2048,
        validation_alias="BURSTRL_HTTP_MAX_CONNECTIONS",
        ge=16,
        le=1_000_000,
        description="Open connections (or requests in flight) past which a request is answered 503 (uvicorn's "
        "limit_concurrency); the service raises its open-file limit to hold them (deploy/README.md).",
    )
    http_keep_alive_s: int = Field(
        5,
        validation_alias="BURSTRL_HTTP_KEEP_ALIVE_S",
        ge=1,
        le=600,
        description="An idle connection is closed this long after its last response (uvicorn's timeout_keep_alive).",
    )
    http_head_timeout_s: float = Field(
        10.0,
        validation_alias="BURSTRL_HTTP_HEAD_TIMEOUT_S",
        gt=0,
        le=600,
        description="A request's head (request line and headers) must arrive within this long of the connection "
        "opening or of the last response; else the connection is closed (slow-loris headers, idle sockets).",
    )
    http_header_max_bytes: int = Field(
        64 * 1024,
        validation_alias="BURSTRL_HTTP_HEADER_MAX_BYTES",
        ge=4096,
        le=16 * 1024 * 1024,
        description="A request head larger than this is answered 431 and its connection closed, unread "
        "(h11's max_incomplete_event_size).",
    )
    http_body_timeout_s: float = Field(
        30.0,
        validation_alias="BURSTRL_HTTP_BODY_TIMEOUT_S",
        gt=0,
        le=3600,
        description="A request body must arrive whole within this long of its head; else 408 and the connection "
        "is closed (slow-loris bodies).",
    )

    @model_validator(mode="after")
    def _token_required_outside_dev(self) -> Self:
        if self.dev:
            if self.host not in LOOPBACK_HOSTS:
                raise ValueError("BURSTRL_DEV=1 only binds to loopback; set BURSTRL_HOST=127.0.0.1")
        elif self.token.strip().lower() in PLACEHOLDER_TOKENS or len(self.token) < 16:
            raise ValueError(
                "BURSTRL_TOKEN must be a real secret (>= 16 chars, not a placeholder); "
                "for a laptop run set BURSTRL_DEV=1 instead"
            )
        return self


DEFAULT_PORTS = {"api": 8700, "rollout": 8701, "reward": 8702, "ref": 8703, "trainer": 8704}
