"""Where a benchmark's report goes: the terminal, and (with --out) a Markdown file beside which
its raw numbers are kept as JSON, for docs/bench/ and for comparing runs later."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(text: str, out: Path | None, data: Any = None) -> None:
    """Print `text`; with `out`, also write it there (folders made) and `data`, when given, to the
    same name with .json (values JSON cannot take are written as their str)."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if data is not None:
            out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))


def repo_path(path: Path) -> Path:
    """`path` as a page names it: from the repository root when it is inside it."""
    root = Path(__file__).resolve().parents[1]
    path = path.resolve()
    return path.relative_to(root) if path.is_relative_to(root) else path
