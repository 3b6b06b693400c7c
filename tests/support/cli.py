"""`burstrl ...` run as a user runs it: a separate process, from the repo root, output captured."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT


def burstrl(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with `args`; `env` adds to this process's environment. COLUMNS is wide, so rich
    writes one line per message and tests can match lines."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "400", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
