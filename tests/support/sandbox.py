"""What the sandbox's isolation tests share: a host folder where a leak would show."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def host_folder(prefix: str) -> Iterator[Path]:
    """A world-readable (0755) folder in /var/tmp, removed afterwards. Not /tmp: the sandbox has
    always had a private /tmp, so a file there proves nothing about what else it can reach."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
