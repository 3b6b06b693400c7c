"""Chat messages -> token ids, token-exact across turns (the agent endpoint, docs/agents.md).

The trap of chat-API agent RL: the agent sends its whole history every turn, and rendering
that history through the chat template and tokenizing it again need not give the ids the
sampler produced (a generated "<|im_end|>" spelled out in characters becomes one special
token; the model stopped on its EOS where the template writes its end-of-turn marker; a
word split "hel"+"lo" comes back as "hello"). Then the trainer would score tokens the
sampler never saw, under log-probs of other tokens.

So history is never re-tokenized. An episode keeps its token ids server-side: the first
request's messages rendered once (`first_ids`), then per turn exactly the ids the engine
generated, then only the new messages' tokens (`delta_ids`): the text the template puts
after the last assistant message's content (its end-of-turn marker, minus what the model
already generated) plus the rendering of the new messages, found as the suffix of
render(history + new) over render(history). A request whose history differs from what the
episode holds is refused (`HistoryMismatch`): an agent may extend its history, not rewrite it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

# A placeholder for an assistant message's content when finding what the template writes
# after it; no real message contains it.
_SENTINEL = "\x00burstrl-content\x00"
# Hermes-style tool calls (Qwen2.5, Hermes, many others): <tool_call>{"name": ..., "arguments": {...}}</tool_call>
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


class ChatError(ValueError):
    """A request the template cannot render as given; the message says what to fix."""


class HistoryMismatch(ChatError):
    """The request's messages do not extend the episode's history."""


def content_text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI content parts of type "text"."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError("content parts must be {'type': 'text', 'text': ...}: this endpoint serves text only")
            out.append(part["text"])
        return "".join(out)
    raise ChatError(f"content must be a string or a list of text parts, got {type(content).__name__}")


def normal(msg: dict[str, Any]) -> dict[str, Any]:
    """A message as the template renders it and as histories are compared: role, content
    text, and tool_calls / tool_call_id / name where present."""
    out: dict[str, Any] = {"role": msg["role"], "content": content_text(msg.get("content"))}
    calls = msg.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id", ""),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name", ""),
                    "arguments": _arguments((c.get("function") or {}).get("arguments", "")),
                },
            }
            for c in calls
        ]
    for k in ("tool_call_id", "name"):
        if msg.get(k):
            out[k] = msg[k]
    return out


def _arguments(a: Any) -> str:
    """Tool-call arguments as the JSON string OpenAI clients send back (canonical when it parses)."""
    if isinstance(a, str):
        try:
            return json.dumps(json.loads(a), sort_keys=True)
        except ValueError:
            return a
    return json.dumps(a, sort_keys=True)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated turn: Hermes-style calls taken out of the content.

    Only the reply to the client changes; the episode keeps the generated ids as they are."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}), sort_keys=True)},
            }
        )
    if not calls:
        return text, []
    return _TOOL_CALL.sub("", text).strip(), calls


class ChatTemplate:
    """The base model's chat template and tokenizer (Hugging Face), rendering text only;
    token ids of a turn's context come from `first_ids` and `delta_ids`."""

    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.model = model

    def render(self, messages: Sequence[dict[str, Any]], *, generation: bool, tools: list | None = None) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ChatError(f"the base model {self.model} has no chat template: use /v1/completions")
        try:
            text = self.tok.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False, add_generation_prompt=generation
            )
        except Exception as e:  # a template's own raise_exception (roles out of order, ...)
            raise ChatError(f"the chat template refused these messages: {type(e).__name__}: {e}") from e
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Text -> ids; the template writes its own BOS/markers as text (special tokens parsed)."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))

    def first_ids(self, messages: Sequence[dict[str, Any]], tools: list | None) -> list[int]:
        """The first turn's context: the messages rendered with the generation prompt, tokenized once."""
        return self.encode(self.render(messages, generation=True, tools=tools))

    def delta_ids(
        self,
        history: Sequence[dict[str, Any]],
        new: Sequence[dict[str, Any]],
        generated: Sequence[int],
        tools: list | None,
    ) -> list[int]:
        """The ids to append after the episode's last generated turn for `new` messages.

        `history` ends with the assistant message of that turn (what the client was sent),
        `generated` are that turn's ids as the engine returned them."""
        last = history[-1]
        if last["role"] != "assistant":
            raise ChatError("internal: an episode's history must end with its last assistant turn")
        # What the template writes after an assistant message's content (its end-of-turn
        # marker), minus what the model generated itself after the content (its stop token).
        probe = self.render([*history[:-1], {"role": "assistant", "content": _SENTINEL}], generation=False, tools=tools)
        at = probe.rfind(_SENTINEL)
        tail = probe[at + len(_SENTINEL) :] if at >= 0 else ""
        produced = self.decode(generated)
        text = last["content"]
        after = produced[len(text) :] if produced.startswith(text) else ""
        if after and tail.startswith(after):
            tail = tail[len(after) :]
        prev = self.render(history, generation=False, tools=tools)
        full = self.render([*history, *new], generation=True, tools=tools)
        if full.startswith(prev):
            return self.encode(tail + full[len(prev) :])
        # Templates that rewrite earlier turns (dropping old reasoning, say) are not prefix-stable
        # over the whole history; the new messages after the last assistant turn alone usually are.
        prev1 = self.render(history[-1:], generation=False, tools=tools)
        full1 = self.render([*history[-1:], *new], generation=True, tools=tools)
        if full1.startswith(prev1):
            return self.encode(tail + full1[len(prev1) :])
        raise ChatError(
            "the chat template does not render the new messages as a suffix of the history, so their tokens "
            "cannot be appended exactly; use /v1/completions with the episode's text"
        )


def check_extends(held: Sequence[dict[str, Any]], given: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of `given` after the episode's history `held` (HistoryMismatch if `given`
    does not start with it, or adds an assistant message of its own)."""
    for i, (h, g) in enumerate(zip(held, given, strict=False)):
        if h != g:
            raise HistoryMismatch(
                f"messages[{i}] differs from what this episode holds (role {h['role']!r}): the history may be "
                "extended, not rewritten; start a new episode for another history"
            )
    if len(given) <= len(held):
        raise HistoryMismatch(
            f"messages: {len(given)} messages, but this episode already holds {len(held)}; send its history "
            "plus at least one new message"
        )
    new = list(given[len(held) :])
    for j, m in enumerate(new):
        if m["role"] == "assistant":
            raise HistoryMismatch(
                f"messages[{len(held) + j}]: an assistant message the policy did not generate cannot be trained "
                "on or appended exactly; only user, tool and system messages may follow the episode's history"
            )
    return new
