"""Tasks: built-in synthetic tasks, file/HF sources, templates, job wiring, the scorer."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from services.reward.scorer import GroupWork, Scorer
from shared.domain.sandbox import check_isolation
from shared.domain.tasks import get_task, score_many, task_for_job, task_names
from shared.domain.tasks.arith import ArithTask
from shared.job import JobSpec
from shared.task_spec import TaskSpec, render_template
from tests.support import ROOT
from tests.support.plugins import plugin_module


def job(**kw: object) -> JobSpec:
    return JobSpec(base_model="tiny", **kw)


def ids(items: object) -> set[str]:
    return {it.item_id for it in items}  # type: ignore[attr-defined]


def test_arith_is_unchanged_by_default() -> None:
    t = task_for_job(job())
    assert isinstance(t, ArithTask)
    assert t.score(" 12", {"answer": "12"}) == {"correct": 1.0}
    assert score_many(t, ["12", "120"], {"answer": "12"}) == [{"correct": 1.0}, {"correct": 0.0}]
    assert {"arith", "mathword", "code"} <= set(task_names())


def test_countup_scores_the_whole_count_and_its_demos_fit_the_budget() -> None:
    import random

    from shared.domain.tasks.countup import MAX_COMPLETION_TOKENS

    t = get_task("countup")
    f = {"answer": "12", "start": "9"}
    assert t.score(" 9 10 11 12\n", f) == {"correct": 1.0}
    for wrong in ["12", "9 10 11 12 13", "9 11 12", "10 11 12", ""]:
        assert t.score(wrong, f) == {"correct": 0.0}, wrong
    # Same problems and split as arith; the slip is one number too far, as arith's is one digit.
    assert ids(t.heldout_items(50)) == ids(get_task("arith").heldout_items(50))
    rng = random.Random(0)
    items = list(itertools.islice(t.train_items(0), 400))
    demos = [t.demonstration(it, rng, 0.25) for it in items]
    right = [t.score(d, it.fields)["correct"] for d, it in zip(demos, items, strict=True)]
    assert 0.15 < sum(right) / len(right) < 0.35
    for d, it in zip(demos, items, strict=True):
        assert d.split()[0] == it.fields["start"] and int(d.split()[-1]) - int(it.fields["answer"]) in (0, 1)
    # One byte-level token per character, plus EOS: the longest demo (29+29, slipped) fits.
    longest = t.demonstration(t._item(29, 29), random.Random(0), 0.0)
    assert len(longest) + 1 <= MAX_COMPLETION_TOKENS


@pytest.mark.parametrize("name", ["mathword", "code", "countup"])
def test_synthetic_splits_are_disjoint_and_seeded(name: str) -> None:
    t = get_task(name)
    train = list(itertools.islice(t.train_items(0), 300))
    assert [i.item_id for i in train[:20]] == [i.item_id for i in itertools.islice(t.train_items(0), 20)]
    held = t.heldout_items(20)
    assert len(held) == 20 and not ids(held) & ids(train)
    assert ids(t.heldout_items(20)) == ids(held)


def test_mathword_scores_with_math_equivalence() -> None:
    t = get_task("mathword")
    item = next(it for it in t.train_items(1) if "frac" in it.fields["answer"])
    num, den = item.fields["answer"][6:-1].split("}{")
    parts = t.score(f"so \\boxed{{{num}/{den}}}", item.fields)
    assert parts == {"correct": 1.0}
    assert t.score("\\boxed{123456}", item.fields) == {"correct": 0.0}


@pytest.mark.skipif(not check_isolation()[0], reason="sandbox unavailable here")
def test_code_task_scores_in_the_sandbox() -> None:
    t = get_task("code")
    item = next(it for it in t.train_items(0) if "sum of the squares" in it.prompt)
    fname = item.prompt.split("`")[1].split("(")[0]
    good = f"```python\ndef {fname}(xs):\n    return sum(x * x for x in xs)\n```"
    parts = score_many(t, [good, "```python\nimport os\nos._exit(0)\n```"], item.fields)
    assert parts[0] == {"tests_passed": 1.0}
    assert parts[1] == {"tests_passed": 0.0, "tests_passed!exited_early": 0.0}


def write_rows(tmp: Path, n: int = 200) -> list[dict]:
    rows = [
        {"id": f"r{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i), "meta": {"i": i}} for i in range(n)
    ]
    (tmp / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def file_job(path: Path, kind: str, **src: object) -> JobSpec:
    spec = {
        "source": {"kind": kind, "path": str(path), "prompt_field": "question", "id_field": "id", **src},
        "template": "Q: {prompt}\nA:",
        "verifiers": [
            {"name": "math", "part": "correct"},
            {"name": "regex", "weight": 0.1, "args": {"pattern": "boxed"}},
        ],
    }
    return job(task="sums", task_spec=spec)


def check_file_task(j: JobSpec) -> None:
    t = task_for_job(j)
    train = list(itertools.islice(t.train_items(3), 400))  # two epochs cover every training row
    held = t.heldout_items(1000)
    assert held and not ids(held) & ids(train) and len(ids(train)) + len(held) == 200
    item = train[0]
    assert item.prompt.startswith("Q: What is ") and item.prompt.endswith("\nA:")
    parts = t.score(f"\\boxed{{{item.fields['answer']}}}", item.fields)
    assert parts == {"correct": 1.0, "regex": 0.1}


def test_jsonl_task(tmp_path: Path) -> None:
    write_rows(tmp_path)
    check_file_task(file_job(tmp_path / "d.jsonl", "jsonl"))


def test_parquet_task(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = write_rows(tmp_path)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    check_file_task(file_job(tmp_path / "d.parquet", "parquet", fields=["answer", "meta"]))
    item = next(task_for_job(file_job(tmp_path / "d.parquet", "parquet", fields=["answer", "meta"])).train_items(0))
    assert json.loads(item.fields["meta"])["i"] >= 0  # non-string columns travel as JSON


def test_hf_datasets_from_local_files_only(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = write_rows(tmp_path)
    d = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:150]), "test": datasets.Dataset.from_list(rows[150:])}
    )
    d.save_to_disk(str(tmp_path / "saved"))
    j = file_job(tmp_path / "saved", "hf", split="train", heldout_split="test", heldout_fraction=0.0)
    t = task_for_job(j)
    assert len(ids(itertools.islice(t.train_items(0), 150))) == 150
    assert ids(t.heldout_items(100)) == {f"r{i}" for i in range(150, 200)}
    check_file_task(file_job(tmp_path / "d.jsonl", "hf"))  # a data file through `datasets`
    t0 = time.monotonic()
    missing = file_job(Path("burstrl-nobody/no-such-dataset"), "hf")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        next(task_for_job(missing).train_items(0))
    assert time.monotonic() - t0 < 30  # offline: no download attempt hanging on the network


def test_task_spec_validation() -> None:
    with pytest.raises(ValueError, match="needs task_spec.verifiers"):
        TaskSpec.model_validate({"source": {"kind": "jsonl", "path": "x.jsonl"}})
    with pytest.raises(ValueError, match="distinct"):
        TaskSpec.model_validate({"verifiers": [{"name": "exact"}, {"name": "exact"}]})
    with pytest.raises(ValueError, match="placeholders"):
        TaskSpec.model_validate({"template": "{prompt.__class__}"})
    with pytest.raises(ValueError, match="extra"):
        TaskSpec.model_validate({"verifiers": [{"name": "exact", "module": "os"}]})
    assert render_template("{{x}} {prompt} {answer}", {"prompt": "p", "answer": "4"}) == "{x} p 4"
    with pytest.raises(ValueError, match="either"):
        task_for_job(job(verifier="exact", task_spec={"verifiers": [{"name": "math"}]}))


def test_verifier_override_and_template_on_arith() -> None:
    t = task_for_job(job(verifier="math"))
    assert t.score("\\boxed{12}", {"answer": "12"}) == {"math": 1.0}
    t = task_for_job(job(task_spec={"template": "Compute {prompt}"}))
    item = next(t.train_items(0))
    assert item.prompt.startswith("Compute ") and t.score(item.fields["answer"], item.fields) == {"correct": 1.0}


# -- the reward service's scorer: real worker processes ---------------------------------
def work(task: str, completions: list[str], fields: dict[str, str], spec: dict | None = None, timeout: float = 30):
    ts = TaskSpec.model_validate(spec or {})
    return GroupWork(task, "", ts.model_dump_json(), completions, fields, "p", [1] * len(completions), 8, timeout)


def test_scorer_in_processes_with_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(
        tmp_path,
        monkeypatch,
        "slow_rm_plugin",
        "import time\nfrom shared.domain.verifiers import register_verifier\n"
        "@register_verifier('slow_test')\n"
        "def slow(completions, **_):\n    time.sleep(30)\n    return [1.0] * len(completions)\n",
    )
    scorer = Scorer(workers=1, plugins=["slow_rm_plugin"], max_timeout_s=60)
    try:
        good = work("arith", ["3", "4"], {"answer": "3"})
        slow = work("arith", ["3"], {"answer": "3"}, {"verifiers": [{"name": "slow_test"}]}, timeout=2)
        unknown = work("no-such-task", ["3"], {})
        t0 = time.monotonic()
        out = scorer.score([good, slow, unknown])
        assert time.monotonic() - t0 < 20
        assert out[0] == [{"correct": 1.0}, {"correct": 0.0}]
        assert out[1] == [{"verifier": 0.0, "verifier!timeout": 0.0}]
        assert out[2] == [{"verifier": 0.0, "verifier!error:KeyError": 0.0}]
        # the stuck pool was replaced; scoring goes on
        assert scorer.score([work("mathword", ["\\boxed{1/2}"], {"answer": "0.5"})]) == [[{"correct": 1.0}]]
    finally:
        scorer.close()


def test_reward_skips_an_unreadable_job_record_and_scores_the_rest(r) -> None:  # noqa: ANN001
    """Issue 18, item 12: one record no reader can parse fails neither the batch nor the others."""
    from services.reward.worker import handle
    from shared import keys
    from shared.bus import FIELD, Bus
    from shared.job import JobRecord, JobSpec, JobState, insert_job
    from shared.schema import Completion, GroupMsg, decode_dead, encode, pack_f32, pack_i32, pack_u8

    def group(job_id: str) -> GroupMsg:
        c = Completion(
            token_ids=pack_i32([1]), logprobs=pack_f32([-1.0]), loss_mask=pack_u8([1]), text="3", finish_reason="stop"
        )
        return GroupMsg(
            job_id=job_id,
            group_id=f"{job_id}:g0",
            item_id="i",
            prompt="p",
            prompt_ids=pack_i32([1]),
            fields={"answer": "3"},
            policy_version=0,
            completions=[c, c],
        )

    now = time.time()
    for job_id in ("good-000000", "bad-000000"):
        rec = JobRecord(
            id=job_id,
            spec=JobSpec(base_model="m", group_size=2),
            state=JobState.running,
            created_at=now,
            updated_at=now,
        )
        Bus.ensure_groups(r, job_id)
        insert_job(r, rec)
        r.xadd(keys.rollouts(job_id), {FIELD: encode(group(job_id))})
    r.hset(keys.jobs_index(), "bad-000000", json.dumps({"id": "bad-000000", "spec": {"tis_cap": None}}))
    bus = Bus(r, keys.GROUP_REWARD, "reward-0")
    entries = bus.read([keys.rollouts("good-000000"), keys.rollouts("bad-000000")], count=10, block_ms=100)
    assert len(entries) == 2
    scorer = Scorer(workers=0, plugins=[])
    try:
        assert handle(bus, entries, scorer) == 1
    finally:
        scorer.close()
    assert r.xlen(keys.ready("good-000000")) == 1
    (dead,) = [decode_dead(f[FIELD]).reason for _, f in r.xrange(keys.dead_letter("bad-000000"))]
    assert "unreadable" in dead


def test_a_process_that_never_imports_the_environments_finds_their_tasks() -> None:
    """The trainer imports no environment, yet probes jobs on "arith3" (the calc env's task): a
    regression from moving the spec shapes to the core, when nothing imported shared.domain.envs
    any more and the trainer failed every publish with `unknown task 'arith3'`."""
    import subprocess
    import sys

    code = (
        "import sys; from services.trainer.probe import probe_text; "
        "assert 'shared.domain.envs' not in sys.modules, 'imported too early to prove anything'; "
        "print(probe_text('arith3')); print(probe_text('guess'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
