"""Issue 45, "Bad input": a job checked against its base model's files at submission
(services/api/model_checks.py): chat asked of a tokenizer without a chat template, and prompts
that do not fit the context, are 422s naming the field. The real api app over a real Redis; the
model folders hold what the api reads (config.json, tokenizer.json, the chat template), with a
byte-level tokenizer whose token count is the prompt's length in bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.api import api_client
from tests.support.heartbeats import fake_heartbeat

TOKEN = "model-checks-token-0123456789"


@pytest.fixture
def client(r, redis_server):  # noqa: ANN001, ANN201
    with api_client(redis_server.url, TOKEN) as c:
        yield c


def model_folder(at: Path, *, context: int, chat: bool, tiny: bool = False) -> Path:
    """config.json (its context), a byte-level tokenizer.json (one token per byte), and a chat
    template or none; `tiny`: the mark of the tiny models (trained on raw prompts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    at.mkdir(parents=True)
    (at / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": context}))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(at / "tokenizer.json"))
    (at / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if chat:
        (at / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if tiny:
        (at / "burstrl_model.json").write_text(json.dumps({"kind": "tiny"}))
    return at


def _refused(resp) -> tuple[list, str]:  # noqa: ANN001
    assert resp.status_code == 422, resp.text
    (d,) = resp.json()["detail"]
    return d["loc"], d["msg"]


def test_chat_needs_a_chat_template(client, tmp_path: Path) -> None:  # noqa: ANN001
    plain = model_folder(tmp_path / "plain", context=256, chat=False)
    loc, msg = _refused(client.post("/v1/jobs", json={"base_model": str(plain), "prompt_format": "chat"}))
    assert loc == ["body", "prompt_format"] and str(plain) in msg and "no chat template" in msg
    # auto and raw need none; a model with a template takes chat
    for fmt in ("auto", "raw"):
        assert client.post("/v1/jobs", json={"base_model": str(plain), "prompt_format": fmt}).status_code == 201
    chat = model_folder(tmp_path / "chat", context=256, chat=True)
    assert client.post("/v1/jobs", json={"base_model": str(chat), "prompt_format": "chat"}).status_code == 201
    # A model the api cannot read (a hub id): rollout is the judge.
    assert client.post("/v1/jobs", json={"base_model": "org/model", "prompt_format": "chat"}).status_code == 201
    loc, msg = _refused(
        client.post("/v1/jobs", json={"base_model": "m", "prompt_format": "chat", "env": {"name": "calc"}})
    )
    assert "prompt_format = 'chat' with env.name" in msg


def test_prompts_past_the_context_are_refused(client, r, tmp_path: Path) -> None:  # noqa: ANN001
    # arith prompts are "a+b=" with a, b < 100: at most 6 bytes, so 6 tokens here
    small = str(model_folder(tmp_path / "small", context=32, chat=False))
    assert client.post("/v1/jobs", json={"base_model": small, "sampling": {"max_tokens": 26}}).status_code == 201
    loc, msg = _refused(client.post("/v1/jobs", json={"base_model": small, "sampling": {"max_tokens": 27}}))
    assert loc == ["body", "sampling", "max_tokens"]
    assert "needs 33" in msg and "model's context (config.json) of 32" in msg and "at most 26" in msg
    # A prompt that alone fills the context names what makes the prompts.
    long = {"base_model": small, "task_spec": {"template": "x" * 40 + "{prompt}"}}
    loc, msg = _refused(client.post("/v1/jobs", json=long))
    assert loc == ["body", "task_spec", "template"] and "shorten the prompts" in msg
    # A rollout replica's context is the one that counts when one advertises it.
    fake_heartbeat(r, "r0", rollout_model=small, max_model_len=16)
    loc, msg = _refused(client.post("/v1/jobs", json={"base_model": small, "sampling": {"max_tokens": 12}}))
    assert loc == ["body", "sampling", "max_tokens"] and "rollout replicas' context (max_model_len) of 16" in msg


def test_the_prompt_format_decides_what_is_counted(client, tmp_path: Path) -> None:  # noqa: ANN001
    """A chat prompt is counted without its template (a lower bound); a raw prompt as the engine
    gets it. With a template the tiny models' mark keeps 'auto' raw (counted the same here: this
    tokenizer adds no special tokens), and a chat-template model's 'auto' is chat."""
    chat = str(model_folder(tmp_path / "chat", context=32, chat=True))
    tiny = str(model_folder(tmp_path / "tiny", context=32, chat=True, tiny=True))
    for model in (chat, tiny):
        loc, msg = _refused(client.post("/v1/jobs", json={"base_model": model, "sampling": {"max_tokens": 27}}))
        assert loc == ["body", "sampling", "max_tokens"]
        assert ("(chat, before its chat template)" in msg) == (model == chat), msg
