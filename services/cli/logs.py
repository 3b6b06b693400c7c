"""`burstrl logs <service> [--follow]`: the log file of a process `burstrl up` started.

The launcher writes each process's stdout+stderr to <run_dir>/logs/<name>.log and records
the path in <run_dir>/procs.json; a stopped service keeps its log, so it is found by name
too. Lines are written as they are (no Rich markup: log lines contain brackets).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TextIO

from services.cli.launch import Launcher


def log_path(run_dir: Path, name: str) -> Path | None:
    procs = Launcher(run_dir).procs()
    if name in procs and procs[name].log.exists():
        return procs[name].log
    path = run_dir.resolve() / "logs" / f"{name}.log"
    return path if path.exists() else None


def available(run_dir: Path) -> list[str]:
    return sorted(p.stem for p in (run_dir / "logs").glob("*.log"))


def tail_lines(path: Path, n: int) -> tuple[list[bytes], int]:
    """The last `n` lines and the file size they end at (where following starts)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        if n <= 0:
            return [], end
        # Read backwards in blocks until enough newlines: service logs grow for days.
        pos, data = end, b""
        while pos > 0 and data.count(b"\n") <= n:
            step = min(64 * 1024, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
        return data.splitlines(keepends=True)[-n:], end


def show_log(
    run_dir: Path,
    name: str,
    *,
    follow: bool = False,
    lines: int = 50,
    out: TextIO | None = None,
    poll_s: float = 0.3,
    stop_after_s: float | None = None,
) -> int:
    """Print the log; with `follow`, keep printing what is appended (Ctrl-C stops). Returns an exit code."""
    out = out or sys.stdout
    path = log_path(run_dir, name)
    if path is None:
        known = ", ".join(available(run_dir)) or "none (start the stack with `burstrl up`)"
        print(f"no log for {name!r} under {run_dir / 'logs'}; logs there: {known}", file=sys.stderr)
        return 1
    chunk, pos = tail_lines(path, lines)
    _write(out, b"".join(chunk))
    if not follow:
        return 0
    deadline = time.monotonic() + stop_after_s if stop_after_s is not None else None
    try:
        while deadline is None or time.monotonic() < deadline:
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # removed (e.g. `make clean`): wait for it to come back
                size = 0
            if size < pos:  # truncated or replaced: start from its beginning
                pos = 0
            if size > pos:
                with open(path, "rb") as f:
                    f.seek(pos)
                    data = f.read(size - pos)
                pos += len(data)
                _write(out, data)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
    return 0


def _write(out: TextIO, data: bytes) -> None:
    if data:
        out.write(data.decode("utf-8", errors="replace"))
        out.flush()
