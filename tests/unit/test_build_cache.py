"""The machine-wide cache of built tiny models (shared/ml/build_cache.py): what it keys on, that
an incomplete entry is never used, that "off" turns it off, and that only the builders that
ask for it read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.ml import build_cache
from shared.ml.models import DONE, _build_once


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(build_cache.CACHE_ENV, str(root))
    return root


def _fake_build(into: Path, text: str) -> None:
    into.mkdir(parents=True)
    (into / "model.safetensors").write_text(text)
    (into / DONE).write_text(json.dumps({"recipe": "r"}))


def test_a_stored_build_is_restored_into_another_folder(cache: Path, tmp_path: Path) -> None:
    _fake_build(tmp_path / "a", "weights")
    key = build_cache.build_key({"recipe": "r"})
    assert not build_cache.restore(key, tmp_path / "b")  # nothing stored yet
    build_cache.store(key, tmp_path / "a")
    assert build_cache.restore(key, tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([DONE, "model.safetensors"])


def test_an_entry_without_its_marker_is_not_used(cache: Path, tmp_path: Path) -> None:
    key = build_cache.build_key({"recipe": "r"})
    (cache / key).mkdir(parents=True)  # a copy cut short, as by a crash
    (cache / key / "model.safetensors").write_text("half")
    assert not build_cache.restore(key, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_the_key_follows_the_recipe_and_shared_source(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = build_cache.build_key({"recipe": "r"})
    assert a == build_cache.build_key({"recipe": "r"})
    assert a != build_cache.build_key({"recipe": "r2"})
    assert a != build_cache.build_key({"recipe": "r", "student": "abc"})
    src = tmp_path / "shared"
    (src / "ml").mkdir(parents=True)
    (src / "ml" / "sft.py").write_text("steps = 600\n")
    monkeypatch.setattr(build_cache, "_SHARED", src)
    before = build_cache.build_key({"recipe": "r"})
    (src / "ml" / "sft.py").write_text("steps = 601\n")  # a builder's code changed
    assert build_cache.build_key({"recipe": "r"}) != before


def test_off_turns_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build_cache.CACHE_ENV, "off")
    assert build_cache.cache_root() is None
    _fake_build(tmp_path / "a", "weights")
    build_cache.store("k", tmp_path / "a")  # a no-op
    assert not build_cache.restore("k", tmp_path / "b")


def test_an_unwritable_cache_costs_nothing_but_the_next_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(build_cache.CACHE_ENV, str(blocker / "cache"))
    _fake_build(tmp_path / "a", "weights")
    build_cache.store("k", tmp_path / "a")  # no exception
    assert not build_cache.restore("k", tmp_path / "b")


def test_only_builders_that_ask_read_the_cache(cache: Path, tmp_path: Path) -> None:
    calls: list[Path] = []

    def sft(_base: Path, into: Path) -> None:
        calls.append(into)
        into.mkdir(parents=True, exist_ok=True)
        (into / "model.safetensors").write_text(f"build {len(calls)}")

    def build(out: Path, *, cached: bool) -> str:
        _build_once(out, "cache-test", what="test", sft=("sft", sft), force=False, log=lambda _: None, cached=cached)
        return (out / "model.safetensors").read_text()

    assert build(tmp_path / "one", cached=True) == "build 1"
    assert build(tmp_path / "two", cached=True) == "build 1"  # copied: the SFT did not run again
    assert len(calls) == 1
    # a build with its own callable (cached=False, the default) always builds
    assert build(tmp_path / "three", cached=False) == "build 2"
    assert len(calls) == 2
