"""The log-prob probe a version's manifest carries (docs/architecture.md, invariant 5).

The trainer scores one fixed sequence (a held-out prompt of the job's task plus a fixed
completion) with the weights it is about to publish; rollout scores the same token ids
with the engine after loading the version and refuses it unless the per-token log-probs
agree within a tolerance. Hashes prove the bytes arrived intact; the probe proves the
engine actually serves those weights (right adapter, right base model, loaded correctly).
"""

from __future__ import annotations

import torch

from shared.domain.tasks import get_task
from shared.ml.chunked_logprobs import head_params, model_token_logprobs, resolve_logits_chunk
from shared.policy import make_probe

# Fixed, so every version of a job is probed on the same sequence. A completion that is
# not the right answer on purpose: log-probs of unlikely tokens move more with the
# weights than those of confident ones, which makes a mismatch easier to see.
PROBE_COMPLETION = " 0 1 2 3"


def probe_text(task: str) -> str:
    item = get_task(task).heldout_items(1)[0]
    return item.prompt + PROBE_COMPLETION


@torch.no_grad()
def compute_probe(model, tok, task: str, logits_chunk: int = 0) -> dict[str, list]:  # noqa: ANN001 (peft model, HF tokenizer)
    """Token ids of the probe text and each token's log-prob after the first, in fp32, from the
    head `logits_chunk` tokens at a time (0: auto), as the trainer's passes compute them."""
    ids = tok(probe_text(task), add_special_tokens=True)["input_ids"]
    was_training = model.training
    model.eval()  # no dropout: the engine has none either
    try:
        device = next(model.parameters()).device
        chunk = resolve_logits_chunk(logits_chunk, int(head_params(model)[0].shape[0]))
        logp = model_token_logprobs(model, torch.tensor([ids], device=device), chunk=chunk)
        values = logp[0].cpu().tolist()
    finally:
        model.train(was_training)
    return make_probe(ids, values)
