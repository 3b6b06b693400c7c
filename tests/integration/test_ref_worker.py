"""The ref stage against real Redis with the transformers engine on the tiny model.

Scored groups come out ready with reference log-probs equal to the engine's; groups that
cannot be scored (too long, a teacher with another tokenizer, ids outside the vocabulary)
go to the dead-letter stream with their reason while the rest of the batch goes on; a
replica never takes groups of a job whose reference is another model; metrics are
recorded per job and exported. Also: the trainer's log-probs under a zero LoRA adapter are
the reference's, the job-level teacher rules, and the distill advantage's reward mixing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from services.ref.engine import HFScorer
from services.ref.settings import RefSettings
from services.ref.worker import RefWorker
from services.trainer.advantages import compute_advantages, group_advantages
from shared import keys
from shared.bus import FIELD, Bus
from shared.job import JobRecord, JobSpec, JobState, insert_job
from shared.metrics import read_ledger, read_points
from shared.schema import Completion, GroupMsg, decode, decode_dead, encode, pack_f32, pack_i32, pack_u8, unpack_f32
from shared.service import ServiceRuntime
from tests.support.numerics import FP32_LOGPROB_TOL


def _job(r, **spec: object) -> JobRecord:  # noqa: ANN001
    now = time.time()
    rec = JobRecord(
        id=f"ref-{os.urandom(3).hex()}", spec=JobSpec(**spec), state=JobState.running, created_at=now, updated_at=now
    )
    Bus.ensure_groups(r, rec.id)
    insert_job(r, rec)
    r.sadd(keys.active_jobs(), rec.id)
    return rec


def _group(job_id: str, prompt: list[int], completions: list[list[int]], gid: str = "g") -> GroupMsg:
    return GroupMsg(
        job_id=job_id,
        group_id=gid,
        item_id="i",
        prompt="p",
        prompt_ids=pack_i32(prompt),
        policy_version=0,
        completions=[
            Completion(
                token_ids=pack_i32(c),
                logprobs=pack_f32([-1.0] * len(c)),
                loss_mask=pack_u8([1] * len(c)),
                text="",
                finish_reason="stop",
                reward=float(i % 2),
            )
            for i, c in enumerate(completions)
        ],
        stage="scored",
        sampled_at=time.time() - 2.0,
    )


def _push(r, g: GroupMsg) -> None:  # noqa: ANN001
    r.xadd(keys.scored(g.job_id), {FIELD: encode(g)})


def _dead(r, job_id: str) -> list[str]:  # noqa: ANN001
    return [decode_dead(f[FIELD]).reason for _, f in r.xrange(keys.dead_letter(job_id))]


@pytest.fixture(scope="module")
def scorer(tiny_model: Path) -> HFScorer:
    return HFScorer(str(tiny_model))


@pytest.fixture
def worker(tiny_model: Path, redis_server, r, scorer: HFScorer, tmp_path: Path) -> RefWorker:  # noqa: ANN001
    settings = RefSettings(model=str(tiny_model), redis_url=redis_server.url, dev=True, data_dir=tmp_path)
    return RefWorker(ServiceRuntime("ref", settings), settings, scorer)


@pytest.fixture(scope="module")
def other_tokenizer_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights with a tokenizer that swaps the ids of two special tokens."""
    import json

    out = tmp_path_factory.mktemp("teacher-other-tok")
    for f in tiny_model.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    tj = json.loads((out / "tokenizer.json").read_text())
    swap = {"<|im_start|>": "<|im_end|>", "<|im_end|>": "<|im_start|>"}
    vocab = tj["model"]["vocab"]
    a, b = vocab["<|im_start|>"], vocab["<|im_end|>"]
    vocab["<|im_start|>"], vocab["<|im_end|>"] = b, a
    for t in tj["added_tokens"]:
        t["content"] = swap.get(t["content"], t["content"])
    (out / "tokenizer.json").write_text(json.dumps(tj))
    return out


def test_scores_forwards_and_records(worker: RefWorker, r, tiny_model: Path, scorer: HFScorer) -> None:  # noqa: ANN001
    rec = _job(r, base_model=str(tiny_model), kl_coef=0.01, group_size=2)
    groups = [_group(rec.id, [49, 10, 50, 30], [[51, 0], [52, 53, 0]], f"g{i}") for i in range(3)]
    for g in groups:
        _push(r, g)
    assert worker.tick() == 3

    out = [decode(f[FIELD], GroupMsg) for _, f in r.xrange(keys.ready(rec.id))]
    assert [g.group_id for g in out] == ["g0", "g1", "g2"] and all(g.stage == "ready" for g in out)
    want = scorer.score([([49, 10, 50, 30], [51, 0]), ([49, 10, 50, 30], [52, 53, 0])])
    for g in out:
        got = [unpack_f32(c.ref_logprobs).tolist() for c in g.completions]
        for a, b in zip(got, want, strict=True):
            assert a == pytest.approx(b, **FP32_LOGPROB_TOL)  # the worker batches 6 sequences, `want` 2
            assert all(x < 0 for x in a)
    assert read_ledger(r, rec.id)["refd"] == 3
    (point,) = read_points(r, rec.id, "ref")
    assert point["groups"] == 3 and point["sequences"] == 6 and point["tokens"] == 15
    assert point["tokens_per_s"] > 0 and point["batch_groups"] == 3
    assert 1.5 < point["queue_lag_s"] < 60
    # k1 of sampler (-1 per token here) minus reference log-probs, over trained tokens.
    flat = [x for lp in want for x in lp]
    assert point["kl_sampler_ref"] == pytest.approx(sum(-1.0 - x for x in flat) / len(flat), abs=1e-4)
    metrics = TestClient(worker.rt.app).get("/metrics").text
    assert "burstrl_ref_groups_total 3.0" in metrics and "burstrl_ref_tokens_total 15.0" in metrics
    assert "burstrl_ref_batch_groups 3.0" in metrics and "burstrl_ref_queue_lag_seconds" in metrics


def test_bad_groups_are_dead_lettered_and_the_rest_go_on(worker: RefWorker, r, tiny_model: Path) -> None:  # noqa: ANN001
    rec = _job(r, base_model=str(tiny_model), kl_coef=0.01, group_size=2)
    _push(r, _group(rec.id, [49, 50], [[51, 0], [52, 0]], "ok"))
    _push(r, _group(rec.id, [49] * 250, [[51] * 10, [52, 0]], "long"))  # 260 > the context of 256
    _push(r, _group(rec.id, [49, 50], [[51, 10_000], [52, 0]], "oov"))  # id beyond the vocabulary
    _push(r, _group(rec.id, [], [[51], [52]], "empty"))
    r.xadd(keys.scored(rec.id), {FIELD: b"\x92not a group"})
    assert worker.tick() == 1
    assert [decode(f[FIELD], GroupMsg).group_id for _, f in r.xrange(keys.ready(rec.id))] == ["ok"]
    reasons = sorted(_dead(r, rec.id))  # one reason each; the bus dead-letters undecodable ones first
    assert len(reasons) == 4
    assert "empty prompt" in reasons[0]
    assert "260 tokens exceeds the reference's context of 256" in reasons[1]
    assert "token id 10000 is outside the reference's vocabulary" in reasons[2]
    assert "undecodable" in reasons[3]
    led = read_ledger(r, rec.id)
    assert led["refd"] == 1 and led["dead"] == 4
    assert not r.xpending(keys.scored(rec.id), keys.GROUP_REF)["pending"]  # everything settled


def test_teacher_with_another_tokenizer_is_rejected(
    tiny_model: Path, other_tokenizer_model: Path, redis_server, r, scorer: HFScorer, tmp_path: Path
) -> None:  # noqa: ANN001
    settings = RefSettings(model=str(other_tokenizer_model), redis_url=redis_server.url, dev=True, data_dir=tmp_path)
    w = RefWorker(ServiceRuntime("ref", settings), settings, scorer)
    rec = _job(r, base_model=str(tiny_model), teacher=str(other_tokenizer_model), algorithm={"advantage": "distill"})
    _push(r, _group(rec.id, [49, 50], [[51, 0], [52, 0]]))
    assert w.tick() == 0
    (reason,) = _dead(r, rec.id)
    assert "tokenizer mismatch" in reason and "special token ids differ" in reason and "<|im_start|>" in reason
    assert read_ledger(r, rec.id)["dead"] == 1


def test_replica_takes_only_jobs_whose_reference_it_serves(worker: RefWorker, r, tiny_model: Path) -> None:  # noqa: ANN001
    mine = _job(r, base_model=str(tiny_model), kl_coef=0.01, group_size=2)
    # The same base model but a teacher this replica does not serve: another replica's job.
    theirs = _job(r, base_model=str(tiny_model), teacher="org/teacher-7b", algorithm={"advantage": "distill"})
    no_ref = _job(r, base_model=str(tiny_model))  # kl_coef 0, no teacher: the stage is skipped
    assert not no_ref.spec.uses_ref
    assert worker.streams() == [keys.scored(mine.id)]
    _push(r, _group(theirs.id, [49, 50], [[51, 0], [52, 0]]))
    _push(r, _group(mine.id, [49, 50], [[51, 0], [52, 0]]))
    assert worker.tick() == 1
    assert r.xlen(keys.ready(mine.id)) == 1
    assert r.xlen(keys.ready(theirs.id)) == 0 and not _dead(r, theirs.id)  # left for its own replica


def test_zero_lora_trainer_logprobs_equal_reference(tiny_model: Path, scorer: HFScorer) -> None:
    """With a zero LoRA adapter (peft's init: B = 0), the trainer's log-probs are the reference's."""
    from services.trainer.batch import collate
    from services.trainer.learner import Learner
    from services.trainer.policy import load_policy

    model, tok = load_policy(str(tiny_model), rank=8, alpha=16, device="cpu", seed=0)
    assert all(float(p.detach().abs().max()) == 0.0 for n, p in model.named_parameters() if "lora_B" in n)
    spec = JobSpec(base_model=str(tiny_model), group_size=3, batch_size=2)
    learner = Learner(model, spec, pad_id=tok.pad_token_id, grad_clip=1.0)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for i, text in enumerate(["12+30=", "7+5="]):
        prompt = tok(text)["input_ids"]
        comps = [torch.randint(0, 258, (int(n),), generator=gen).tolist() for n in (3, 6, 1)]
        groups.append(_group("j", prompt, comps, f"g{i}"))
    b = collate(groups, tok.pad_token_id)
    model.eval()
    with torch.no_grad():
        logp, _, _ = learner._forward(b, list(range(6)))
    seqs = [
        (tok(t)["input_ids"], unpack_i32_list(c))
        for g, t in zip(groups, ["12+30=", "7+5="], strict=True)
        for c in g.completions
    ]
    ref = scorer.score(seqs)
    worst = 0.0
    for row, (p, c) in enumerate(seqs):
        trainer = logp[row, len(p) - 1 : len(p) - 1 + len(c)]
        worst = max(worst, float((trainer - torch.tensor(ref[row])).abs().max()))
        assert trainer.tolist() == pytest.approx(ref[row], **FP32_LOGPROB_TOL)  # other batch shapes, same math
    print(f"zero-LoRA trainer vs reference: max |diff| = {worst:.2e}")


def unpack_i32_list(c: Completion) -> list[int]:
    from shared.schema import unpack_i32

    return unpack_i32(c.token_ids).tolist()


def test_teacher_rules() -> None:
    d = {"advantage": "distill"}
    spec = JobSpec(base_model="org/small", teacher="org/large", algorithm=d)
    assert spec.uses_ref and spec.reference_model == "org/large"
    assert JobSpec(base_model="org/small", teacher="org/large", kl_coef=0.01).reference_model == "org/large"
    assert JobSpec(base_model="org/small", kl_coef=0.01).reference_model == "org/small"
    assert not JobSpec(base_model="org/small").uses_ref
    with pytest.raises(ValueError, match="teacher is set but unused"):
        JobSpec(base_model="org/small", teacher="org/large")
    with pytest.raises(ValueError, match="distill_reward_weight needs"):
        JobSpec(base_model="org/small", algorithm={"distill_reward_weight": 0.5})


def test_distill_advantage_mixes_the_verifier_reward() -> None:
    teacher = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0], [-1.0, -1.0]])
    sampler = torch.full((4, 2), -1.0)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    kw = {"sampler_logp": sampler, "ref_logp": teacher, "mask": mask}
    pure = compute_advantages("distill", rewards, **kw)
    mixed = compute_advantages("distill", rewards, reward_weight=0.5, **kw)
    want = pure + 0.5 * group_advantages(rewards).reshape(-1, 1) * mask
    assert torch.allclose(mixed, want)
    assert mixed[1, 1] == 0.0 and mixed[0, 0] > pure[0, 0] and mixed[1, 0] < pure[1, 0]


def test_an_unreadable_job_record_does_not_stop_the_others(worker: RefWorker, r, tiny_model: Path) -> None:  # noqa: ANN001
    """Issue 18, item 12: a record no reader can parse is skipped (not served), every tick."""
    bad = _job(r, base_model=str(tiny_model), kl_coef=0.01, group_size=2)
    r.hset(keys.jobs_index(), bad.id, json.dumps({"id": bad.id, "spec": {"tis_cap": None}}))
    good = _job(r, base_model=str(tiny_model), kl_coef=0.01, group_size=2)
    _push(r, _group(bad.id, [49, 10], [[51, 0], [52, 0]], "gb"))
    _push(r, _group(good.id, [49, 10], [[51, 0], [52, 0]], "gg"))
    assert worker.streams() == [keys.scored(good.id)]
    assert worker.tick() == 1
    assert r.xlen(keys.ready(good.id)) == 1 and r.xlen(keys.ready(bad.id)) == 0
