"""The three ref engines agree on the tiny model in fp32: transformers (the trainer's numerics),
vLLM in-process, and a real `python -m vllm.entrypoints.openai.api_server` reached over HTTP
(prompt_logprobs on token-id prompts, and the echo + logprobs fallback for servers without it).

One vLLM engine at a time: the in-process one is class-scoped and gone before the server starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.launch import free_port, terminate
from services.ref.engine import HFScorer, RefScorer, Rejected, Seq, build_scorer
from services.ref.settings import RefSettings
from tests.support.numerics import FP32_ENGINE_LOGPROB_TOL, FP32_LOGPROB_TOL
from tests.support.rollout import wait_vllm_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seqs(tiny_model: Path) -> list[Seq]:
    """Prompts of the task with completions of mixed lengths, some ending in EOS (id 0)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rng = random.Random(0)
    out = []
    for i, text in enumerate(["12+30=", "7+5=", "101+99=", "3+4="]):
        prompt = tok(text)["input_ids"]
        for n in (1, 4, 9):
            comp = [rng.randrange(3, len(tok)) for _ in range(n)]
            out.append((prompt, comp + [0] if i % 2 else comp))
    return out


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model: Path, seqs: list[Seq]) -> list[list[float]]:
    return HFScorer(str(tiny_model), max_batch_tokens=64).score(seqs)  # small chunks: several forwards


def _agree(scorer: RefScorer, seqs: list[Seq], want: list[list[float]]) -> float:
    got = scorer.score(seqs)
    assert [len(g) for g in got] == [len(c) for _, c in seqs]
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"{scorer.mode}: max |diff| vs transformers = {worst:.2e}")
    return worst


def test_hf_batching_does_not_change_numbers(tiny_model: Path, seqs: list[Seq], hf_logprobs) -> None:  # noqa: ANN001
    one_by_one = [HFScorer(str(tiny_model)).score([s])[0] for s in seqs[:3]]
    for a, b in zip(one_by_one, hf_logprobs[:3], strict=True):
        assert a == pytest.approx(b, **FP32_LOGPROB_TOL)


@pytest.fixture(scope="class")
def vllm_scorer(tiny_model: Path) -> Iterator[RefScorer]:
    from services.ref.engine import VllmScorer

    sc = VllmScorer(str(tiny_model), dtype="float32")
    yield sc
    sc.close()


class TestVllmInProcess:
    def test_agrees_with_transformers(self, vllm_scorer, seqs, hf_logprobs) -> None:  # noqa: ANN001
        assert vllm_scorer.dtype == "float32"
        assert _agree(vllm_scorer, seqs, hf_logprobs) < FP32_ENGINE_LOGPROB_TOL

    def test_rejects_too_long(self, vllm_scorer) -> None:  # noqa: ANN001
        with pytest.raises(Rejected, match="exceeds the reference's context"):
            vllm_scorer.score([([5] * 250, [6] * 10)])


@pytest.fixture(scope="class")
def server_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("ref-vllm-server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    cmd += ["--max-model-len", "256", "--seed", "0"]
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_vllm_server(f"http://127.0.0.1:{port}", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(proc.pid, 20)


class TestRemote:
    def test_agrees_with_transformers(self, server_url, tiny_model, seqs, hf_logprobs, monkeypatch) -> None:  # noqa: ANN001
        # Built the way the service builds it, from the deploy files' env names.
        monkeypatch.setenv("BURSTRL_REF_ENGINE", "remote")
        monkeypatch.setenv("BURSTRL_REF_ENGINE_URL", server_url + "/v1")  # a trailing /v1 is tolerated
        scorer = build_scorer(RefSettings(model=str(tiny_model), dev=True))
        try:
            assert scorer.mode == "remote" and scorer.max_len == 255
            assert _agree(scorer, seqs, hf_logprobs) < FP32_ENGINE_LOGPROB_TOL
            assert not scorer._echo_only  # prompt_logprobs was honoured
            with pytest.raises(Rejected, match="exceeds the reference's context"):
                scorer.score([([5] * 250, [6] * 10)])
            with pytest.raises(Rejected, match="HTTP 400"):  # an id the model does not have
                scorer.score([([5, 6], [10_000])])
        finally:
            scorer.close()

    def test_echo_fallback_agrees(self, server_url, tiny_model, seqs, hf_logprobs) -> None:  # noqa: ANN001
        from services.ref.engine import RemoteScorer

        scorer = RemoteScorer(url=server_url, model=str(tiny_model), prompts_per_request=5)
        scorer._echo_only = True  # as after meeting a server that ignores prompt_logprobs
        try:
            assert _agree(scorer, seqs, hf_logprobs) < FP32_ENGINE_LOGPROB_TOL
        finally:
            scorer.close()
