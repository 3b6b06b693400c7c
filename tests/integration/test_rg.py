"""Tasks from reasoning-gym (`rg:<dataset>`): options, split, scoring, and the real reward service."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from shared.domain.tasks import get_task, make_task, task_for_job
from shared.domain.tasks import rg as rgmod
from shared.domain.tasks.rg import RgTask, dataset_names
from shared.job import JobSpec
from shared.task_spec import TaskSpec

# A small problem space (single-digit a+b / a-b: ~200 questions), where a split that relied on
# separate seeds alone would leak held-out questions into training.
SMALL = {"min_terms": 2, "max_terms": 2, "max_digits": 1}


def questions(items: object) -> set[str]:
    return {it.fields["question"] for it in items}  # type: ignore[attr-defined]


def test_unknown_dataset_and_options_name_the_choices() -> None:
    with pytest.raises(KeyError, match=r"did you mean rg:chain_sum.*known: \[.*'basic_arithmetic'"):
        make_task("rg:chain_sun")
    with pytest.raises(KeyError, match="not supported"):
        make_task("rg:composite")
    with pytest.raises(ValueError, match=r"unknown option 'terms' for rg:chain_sum; valid: \[.*'max_terms'"):
        make_task("rg:chain_sum", {"terms": 3})
    with pytest.raises(ValueError, match="seed is set by burstrl"):
        make_task("rg:chain_sum", {"seed": 3})
    with pytest.raises(ValueError, match="min_terms must be an integer"):
        make_task("rg:chain_sum", {"min_terms": "2"})
    with pytest.raises(ValueError, match="min_terms must be an integer"):
        make_task("rg:chain_sum", {"min_terms": True})
    with pytest.raises(ValueError, match="rejects these options: AssertionError: min_terms must be positive"):
        make_task("rg:chain_sum", {"min_terms": 0})
    with pytest.raises(ValueError, match="out of range"):
        make_task("rg:chain_sum", {"max_terms": 10**12})
    with pytest.raises(ValueError, match=r"whitespace must be one of \['no_space', 'single', 'random'\]"):
        make_task("rg:basic_arithmetic", {"whitespace": "none"})
    with pytest.raises(ValueError, match="answer_format must be one of"):
        make_task("rg:chain_sum", {"answer_format": "boxed"})
    with pytest.raises(ValueError, match="heldout_fraction"):
        make_task("rg:chain_sum", {"heldout_fraction": 0.9})
    with pytest.raises(ValueError, match="task 'arith' takes no options"):
        make_task("arith", {"max_operand": 5})
    with pytest.raises(KeyError, match=r"or rg:<name>"):
        get_task("nope")
    with pytest.raises(ValueError, match="a task_spec.source task has none"):
        TaskSpec.model_validate(
            {"source": {"kind": "jsonl", "path": "x"}, "verifiers": [{"name": "exact"}], "args": {"a": 1}}
        )
    with pytest.raises(ValueError, match="at most 64 items"):
        TaskSpec(args={"a": [1] * 65})
    # A JSON list becomes the tuple the config's default is.
    assert make_task("rg:simple_equations", {"operators": ["+"]}).config["operators"] == ("+",)


def test_missing_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # import now raises ImportError
    with pytest.raises(KeyError, match="need the reasoning-gym package"):
        make_task("rg:chain_sum")


def test_our_option_names_are_no_datasets_config_field() -> None:
    from reasoning_gym.factory import DATASETS

    for name in dataset_names():
        fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
        assert not fields & set(rgmod.OWN_OPTIONS), name
        assert set(rgmod.RESERVED) <= fields, name  # every dataset is seeded and sized through its config


def test_split_is_disjoint_seeded_and_fixed_even_on_a_small_space() -> None:
    t = make_task("rg:chain_sum", SMALL)
    held = t.heldout_items(64)
    # ~200 questions, 10% held out: fewer than asked, but some, all distinct.
    assert 5 <= len(held) < 64 and len(questions(held)) == len(held)
    for seed in (0, 1, 7):
        train = list(itertools.islice(t.train_items(seed), 3000))
        assert not questions(train) & questions(held), seed
        assert len(questions(train)) > 100  # the stream does cover the space
    first = [i.item_id for i in itertools.islice(t.train_items(3), 50)]
    assert first == [i.item_id for i in itertools.islice(make_task("rg:chain_sum", SMALL).train_items(3), 50)]
    assert first != [i.item_id for i in itertools.islice(t.train_items(4), 50)]
    # The held-out set is the same whatever the job, the process or the order of calls.
    fresh = make_task("rg:chain_sum", SMALL)
    assert [i.item_id for i in fresh.heldout_items(3)] == [i.item_id for i in held[:3]]
    assert [i.item_id for i in fresh.heldout_items(64)] == [i.item_id for i in held]
    assert all(rgmod._is_heldout("chain_sum", q, 0.1) for q in questions(held))


def test_scores_with_the_datasets_own_scorer_from_json_fields() -> None:
    t = make_task("rg:chain_sum", SMALL)
    item = next(iter(t.train_items(0)))
    assert item.prompt == item.fields["question"] + "\n" + rgmod.INSTRUCTION
    assert json.loads(item.fields["rg_entry"])["answer"] == item.fields["answer"]
    gold = item.fields["answer"]
    assert t.score(f"think... <answer>{gold}</answer>", item.fields) == {"correct": 1.0}
    assert t.score(f"<answer>0</answer><answer> {gold} </answer>", item.fields) == {"correct": 1.0}  # the last one
    assert t.score(f"<answer>{int(gold) + 1}</answer>", item.fields)["correct"] < 1.0
    assert t.score(gold, item.fields) == {"correct": 0.0, "correct!no_answer": 0.0}
    assert t.score("<answer>" + "9" * 9000 + "</answer>", item.fields)["correct!answer_too_long"] == 0.0
    assert t.score("<answer>1</answer>", {"answer": "1"}) == {"correct": 0.0, "correct!no_entry": 0.0}
    raw = make_task("rg:chain_sum", {**SMALL, "answer_format": "raw"})
    item = next(iter(raw.train_items(0)))
    assert item.prompt == item.fields["question"]
    assert raw.score(f" {item.fields['answer']}\n", item.fields) == {"correct": 1.0}
    # Countdown's scorer evaluates the expression against the entry's metadata (numbers, target):
    # the metadata must survive the JSON trip.
    cd = make_task("rg:countdown")
    item = next(iter(cd.train_items(0)))
    assert cd.score(f"<answer>{item.fields['answer']}</answer>", item.fields) == {"correct": 1.0}
    assert cd.score("<answer>1+1</answer>", item.fields)["correct"] < 1.0


def test_entry_tuples_survive_the_json_fields() -> None:
    # ReARC's scorer compares the parsed board to the metadata's tuple of tuples; plain JSON
    # turned it into lists and the right answer scored 0.05 (docs/tasks.md's first table).
    t = make_task("rg:rearc")
    item = next(iter(t.train_items(0)))
    assert t.score(f"<answer>{item.fields['answer']}</answer>", item.fields) == {"correct": 1.0}
    assert rgmod.entry_from_json(rgmod.entry_to_json({"a": (1, [2, (3,)]), "b": [4]})) == {
        "a": (1, [2, (3,)]),
        "b": [4],
    }
    with pytest.raises(TypeError, match="keys must be strings"):
        rgmod.entry_to_json({"metadata": {1: "x"}})


def test_template_and_job_wiring() -> None:
    spec = JobSpec(
        base_model="m",
        task="rg:basic_arithmetic",
        task_spec={"args": {"operators": ["+"], "answer_format": "raw"}, "template": "{expression}="},
    )
    t = task_for_job(spec)
    item = t.heldout_items(1)[0]
    assert item.prompt == item.fields["expression"] + "="
    assert t.score(item.fields["answer"], item.fields) == {"correct": 1.0}
    assert get_task("rg:basic_arithmetic").heldout_items(1)[0].item_id.startswith("rg:basic_arithmetic:")


def test_submission_check_refuses_configs_that_do_not_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prompts over the bound: refused from the child process, with its reason.
    with pytest.raises(ValueError, match="could not generate items.*characters"):
        RgTask("chain_sum", {"min_terms": 5000, "max_terms": 5000}).check_generation()
    # A generator slower than the deadline: the child is killed, the job refused.
    monkeypatch.setattr(rgmod, "CHECK_TIMEOUT_S", 0.05)
    with pytest.raises(ValueError, match="took over"):
        RgTask("chain_sum", {"min_terms": 3}).check_generation()


def test_rg_tasks_stay_torch_free() -> None:
    # The api and the reward service build these tasks; they must start without torch.
    code = (
        "import sys, itertools\n"
        "from shared.domain.tasks import make_task\n"
        "t = make_task('rg:chain_sum')\n"
        "it = next(iter(t.train_items(0)))\n"
        "t.score('<answer>1</answer>', it.fields)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
