"""TagBudget (issue 47 item 4): reward tags drawn from completions, bounded per job."""

from __future__ import annotations

from shared.domain.verifiers import TagBudget


def test_tags_are_bounded_in_length_characters_and_number() -> None:
    b = TagBudget(per_job=2)
    assert b.bound("j", {"v": 1.0, "v!ok_1": 0.0, "v!" + "x" * 65: 0.0, "v!a b": 0.0}) == {
        "v": 1.0,
        "v!ok_1": 0.0,
        "v!other": 0.0,
    }
    assert b.bound("j", {"v!runtime_error:ValueError": 0.0}) == {"v!runtime_error:ValueError": 0.0}
    assert b.bound("j", {"v!new": 0.0, "v!ok_1": 0.0}) == {"v!other": 0.0, "v!ok_1": 0.0}  # the budget is spent
    assert b.bound("k", {"v!new": 0.0}) == {"v!new": 0.0}  # per job


def test_the_jobs_remembered_are_bounded() -> None:
    b = TagBudget(per_job=1, max_jobs=2)
    for job in ("a", "b", "c"):
        b.bound(job, {"v!first": 0.0})
    assert b.bound("a", {"v!second": 0.0}) == {"v!second": 0.0}  # "a" was forgotten: a fresh budget
    assert b.bound("c", {"v!second": 0.0}) == {"v!other": 0.0}
