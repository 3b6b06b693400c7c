"""Prompts from local jsonl / parquet files or Hugging Face `datasets` (local only).

Rows are read once per file version (path + mtime) and split by a hash of each row's
id: a row is held out or not whatever the seed, the order or later appended rows.
Nothing is downloaded: hub names resolve only from the local cache (offline mode).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from shared.domain.tasks.base import TaskItem
from shared.task_spec import SourceSpec


class SourceError(ValueError):
    """A prompt source that cannot be read as configured; `field` is the SourceSpec field to fix."""

    def __init__(self, message: str, *, field: str = "path") -> None:
        super().__init__(message)
        self.field = field


def _heldout(item_id: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(item_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def _as_field(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    n = 0
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise SourceError(
                            f"{path}:{n} is a JSON {type(row).__name__}, not an object (JSONL: one per line)"
                        )
                    rows.append(row)
    except UnicodeDecodeError as e:
        raise SourceError(f"{path}:{n + 1} is not UTF-8 text: is it a JSONL file? ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{n} is not a JSON object ({e.msg}): is it a JSONL file?") from None
    except OSError as e:
        raise SourceError(f"{path} cannot be read: {e.strerror or e}") from None
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("parquet tasks need pyarrow: pip install 'pyarrow>=14'") from e
    try:
        return pq.read_table(path).to_pylist()
    except OSError as e:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        raise SourceError(f"{path} cannot be read as parquet: {e}") from None
    except ValueError as e:
        raise SourceError(f"{path} is not a parquet file: {e}") from None


def _read_hf(src: SourceSpec, split: str) -> list[dict[str, Any]]:
    # Offline before `datasets` is imported: a name not in the local cache fails, never downloads.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import datasets
    except ImportError as e:
        raise ImportError("hf tasks need the datasets package: pip install 'datasets>=3'") from e
    p = Path(src.path).expanduser()
    if p.is_dir() and (p / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(str(p))[split]
    elif p.is_dir() and (p / "dataset_info.json").exists():
        ds = datasets.load_from_disk(str(p))
    elif p.is_file():
        fmt = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(p.suffix)
        if fmt is None:
            raise ValueError(f"{p}: unknown data file type (use .jsonl, .json, .parquet or .csv)")
        ds = datasets.load_dataset(fmt, data_files={split: str(p)}, split=split)
    else:
        try:
            ds = datasets.load_dataset(src.path, src.config or None, split=split)
        except Exception as e:
            raise FileNotFoundError(
                f"dataset {src.path!r} (split {split!r}) is not in the local Hugging Face cache and downloads are "
                f"off at run time; fetch it beforehand (e.g. `datasets.load_dataset` once online) ({e})"
            ) from e
    return [dict(r) for r in ds]


@lru_cache(maxsize=16)
def _load(src_json: str, split: str, mtime: float) -> tuple[tuple[TaskItem, ...], tuple[TaskItem, ...]]:
    src = SourceSpec.model_validate_json(src_json)
    path = Path(src.path).expanduser()
    if src.kind == "jsonl":
        rows = _read_jsonl(path)
    elif src.kind == "parquet":
        rows = _read_parquet(path)
    else:
        rows = _read_hf(src, split)
    train: list[TaskItem] = []
    held: list[TaskItem] = []
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or src.prompt_field not in row:
            raise SourceError(
                f"{src.path}: row {n} has no {src.prompt_field!r} column (set source.prompt_field)",
                field="prompt_field",
            )
        missing = [f for f in src.fields if f not in row]
        if missing:
            raise SourceError(f"{src.path}: row {n} lacks columns {missing} (set source.fields)", field="fields")
        if src.id_field and src.id_field not in row:
            raise SourceError(
                f"{src.path}: row {n} has no {src.id_field!r} column (set source.id_field)", field="id_field"
            )
        prompt = str(row[src.prompt_field])
        if src.id_field:
            item_id = str(row[src.id_field])
        else:
            item_id = hashlib.sha256(prompt.encode()).hexdigest()[:16]
        item = TaskItem(item_id=item_id, prompt=prompt, fields={f: _as_field(row[f]) for f in src.fields})
        (held if _heldout(item_id, src.heldout_fraction) else train).append(item)
    return tuple(train), tuple(held)


class FileTask:
    """A task whose prompts are rows of a local dataset."""

    def __init__(self, name: str, source: SourceSpec) -> None:
        self.name = name
        self.source = source

    def _rows(self, split: str) -> tuple[tuple[TaskItem, ...], tuple[TaskItem, ...]]:
        p = Path(self.source.path).expanduser()
        mtime = p.stat().st_mtime if p.exists() else 0.0
        if self.source.kind != "hf" and not p.is_file():
            raise SourceError(f"task file {p} does not exist or is not a file (task_spec.source.path)")
        return _load(self.source.model_dump_json(), split, mtime)

    def train_items(self, seed: int) -> Iterator[TaskItem]:
        items = list(self._rows(self.source.split)[0])
        if not items:
            raise SourceError(f"{self.source.path}: no training rows (all held out?)", field="heldout_fraction")
        rng = random.Random(seed)
        while True:
            rng.shuffle(items)
            yield from items

    def heldout_items(self, n: int) -> list[TaskItem]:
        if self.source.kind == "hf" and self.source.heldout_split:
            train, held = self._rows(self.source.heldout_split)
            items = list(train + held)  # the whole held-out split
        else:
            items = list(self._rows(self.source.split)[1])
        random.Random(1234).shuffle(items)
        return items[:n]

    def score(self, completion: str, fields: dict[str, str]) -> dict[str, float]:
        raise NotImplementedError("a file task scores through task_spec.verifiers")
