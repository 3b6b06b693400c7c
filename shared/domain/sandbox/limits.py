"""Per-run Limits and the process's SandboxSettings (`BURSTRL_SANDBOX_*`)."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SandboxSettings(BaseSettings):
    """`BURSTRL_SANDBOX_*`: where the sandbox finds its interpreter and its uids."""

    model_config = SettingsConfigDict(env_prefix="BURSTRL_SANDBOX_", extra="ignore", hide_input_in_errors=True)

    python: str = Field(
        "/usr/bin/python3",
        description="Interpreter run inside the sandbox; must be readable and executable by an unprivileged "
        "uid (a pyenv under /root is not). Only it, its stdlib and its libraries are visible there.",
    )
    proc: Literal["private", "off"] = Field(
        "private",
        description="private: the sandbox gets a /proc of its own pid namespace, and a host where that cannot "
        "be mounted (Docker's masked /proc) refuses to run code; off: no /proc in the sandbox at all "
        "(docs/sandbox.md). Never the host's.",
    )
    uid_base: int = Field(2_100_000_000, ge=1000, description="First uid of the pool (when the service runs as root).")
    uid_count: int = Field(64, ge=1, le=4096, description="Pool size = most concurrent runs on this machine.")
    lock_dir: Path = Field(
        Path(tempfile.gettempdir()) / f"burstrl-sandbox-{os.geteuid()}",
        description="Where uid-slot locks live (shared by every process on the machine).",
    )


_settings: SandboxSettings | None = None


def settings() -> SandboxSettings:
    global _settings
    if _settings is None:
        _settings = SandboxSettings()
    return _settings


@dataclass(frozen=True)
class Limits:
    """Per-run limits. CPU applies per process (each test runs in a process of its own);
    wall to the whole run; nproc to the run's own processes (its user namespace)."""

    cpu_s: int = 2
    wall_s: float = 6.0
    memory_mb: int = 256
    nproc: int = 32
    nofile: int = 64
    fsize_mb: int = 4
    tmpfs_mb: int = 16
    max_output: int = 1 << 20  # characters of stdout kept per test
    max_report: int = 4 << 20  # bytes of the whole report

    @classmethod
    def for_program(cls, timeout_s: float, max_output: int, memory_mb: int = 256) -> Limits:
        """One tool-style program run: `timeout_s` of wall clock (and as much CPU, whole
        seconds), `max_output` characters of stdout, room in the report for them."""
        return cls(
            cpu_s=max(1, math.ceil(timeout_s)),
            wall_s=timeout_s,
            memory_mb=memory_mb,
            max_output=max_output,
            # The report carries the output JSON-escaped (up to 6 bytes per character) plus framing.
            max_report=max(cls.max_report, 6 * max_output + 4096),
        )

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The resource limits the harness sets inside the namespaces (soft, hard)."""
        mem, fsize = self.memory_mb << 20, self.fsize_mb << 20
        return {
            "cpu": (self.cpu_s, self.cpu_s + 1),  # soft first: SIGXCPU names the reason before the hard SIGKILL
            "as": (mem, mem),
            "nproc": (self.nproc, self.nproc),
            "nofile": (self.nofile, self.nofile),
            "fsize": (fsize, fsize),
            "core": (0, 0),
        }
