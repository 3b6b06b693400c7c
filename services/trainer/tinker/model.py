"""One Tinker model inside the trainer: its LoRA policy, AdamW and the calls that change them.

It knows nothing of Redis or the queue (services/trainer/tinker/worker.py does): it turns a
TinkerCall into a TinkerResult, and saves and restores its state in the store as a burstrl
checkpoint (services/trainer/checkpoint.py), a named state, or a policy version.

Log-probs come from the same code as the job trainer's (shared/ml/chunked_logprobs.py: the
decoder's hidden states, the head applied a chunk of tokens at a time, fp32 log-softmax), so a
cross_entropy call returns what burstrl's own trainer computes for the same tokens. Datums run
in passes of at most `pass_tokens` padded tokens, longest first; the losses are sums, so the
passes' gradients add up to one pass's.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from safetensors.torch import load, save

from services.trainer.build import load_job_policy, pass_tokens, restore_newest
from services.trainer.checkpoint import TrainState, optimizer_from_tensors, optimizer_to_tensors, save_checkpoint
from services.trainer.policy import load_policy_files, policy_files
from services.trainer.probe import compute_probe
from services.trainer.settings import TrainerSettings
from services.trainer.tinker.losses import LossInputError, elementwise_loss
from shared.folders import get_folder, new_data_dir, put_folder
from shared.job import JobRecord
from shared.ml.chunked_logprobs import chunked_token_logprobs, head_params, model_hidden, resolve_logits_chunk
from shared.schema import TinkerCall, TinkerDatum, TinkerResult
from shared.store import ObjectStore

log = logging.getLogger(__name__)
OPTIMIZER = "optimizer.safetensors"


class CallRefused(ValueError):
    """A call this model cannot apply (a user error): it fails and changes nothing."""


def named_state_prefix(job_id: str, name: str) -> str:
    """Where save_state keeps a named state of a model (kept until the job is deleted)."""
    return f"jobs/{job_id}/tinker/states/{name}"


@dataclass
class _Rows:
    tokens: list[np.ndarray]
    inputs: list[dict[str, torch.Tensor]]


class TinkerModel:
    def __init__(self, rec: JobRecord, settings: TrainerSettings, device: str) -> None:
        spec = rec.spec
        self.rec, self.device = rec, device
        self.model, self.tok = load_job_policy(spec, device)  # as the job trainer loads it (build.py)
        self.vocab = int(head_params(self.model)[0].shape[0])
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.chunk = resolve_logits_chunk(settings.logits_chunk, self.vocab)
        self.pass_tokens = pass_tokens(self.model, settings, rec.id, gradient_checkpointing=False)
        self.pad_id = self.tok.pad_token_id or 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = self._fresh_optimizer()
        self.steps = 0  # optimizer steps applied
        self.versions = 0  # policy versions published
        self.dirty = False  # gradients accumulated since the last optimizer step

    def _fresh_optimizer(self) -> torch.optim.Optimizer:
        # Tinker's Adam is torch's AdamW with its defaults; each optim_step sets its own values.
        return torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    # -- forward, forward_backward ------------------------------------------------------
    def _rows(self, data: list[TinkerDatum]) -> _Rows:
        """Every datum's tokens and inputs, checked against this model before any pass runs,
        so a call that fails here leaves no gradient behind."""
        rows = _Rows([], [])
        for i, d in enumerate(data):
            tokens = np.frombuffer(d.tokens, dtype="<i4")
            if self.context and len(tokens) > self.context:
                raise CallRefused(f"data[{i}]: {len(tokens)} tokens, longer than the model's context {self.context}")
            if len(tokens) and int(tokens.max()) >= self.vocab:
                raise CallRefused(f"data[{i}].model_input: token id {int(tokens.max())} >= vocab size {self.vocab}")
            inputs = {}
            for name, t in d.inputs.items():
                arr = np.frombuffer(t.data, dtype="<f4" if t.dtype == "float32" else "<i8")
                if list(t.shape) != [len(tokens)]:
                    raise CallRefused(f"data[{i}].loss_fn_inputs.{name}: shape {t.shape} != [{len(tokens)}]")
                inputs[name] = torch.from_numpy(arr.copy()).to(self.device)
            target = inputs.get("target_tokens")
            if target is not None and len(target) and int(target.max()) >= self.vocab:
                raise CallRefused(
                    f"data[{i}].loss_fn_inputs.target_tokens: id {int(target.max())} >= vocab size {self.vocab}"
                )
            rows.tokens.append(tokens)
            rows.inputs.append(inputs)
        return rows

    def _passes(self, lengths: list[int]) -> list[list[int]]:
        """Datum indices in passes of at most pass_tokens padded tokens, longest first."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out: list[list[int]] = []
        for i in order:
            if out and self.pass_tokens and (len(out[-1]) + 1) * lengths[out[-1][0]] <= self.pass_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def _logprobs(self, rows: _Rows, idx: list[int]) -> torch.Tensor:
        """log p(target_tokens[t] | model_input[: t + 1]) of the rows `idx`, padded: [B, L]."""
        longest = max(len(rows.tokens[i]) for i in idx)
        ids = torch.full((len(idx), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), longest), dtype=torch.long)
        targets = torch.zeros((len(idx), longest), dtype=torch.long)
        for b, i in enumerate(idx):
            n = len(rows.tokens[i])
            ids[b, :n] = torch.from_numpy(rows.tokens[i].astype(np.int64))
            attn[b, :n] = 1
            targets[b, :n] = rows.inputs[i]["target_tokens"].cpu()
        hidden = model_hidden(self.model, ids.to(self.device), attn.to(self.device))
        weight, bias = head_params(self.model)
        logp = chunked_token_logprobs(hidden, weight, targets.to(self.device), chunk=self.chunk, bias=bias)
        assert isinstance(logp, torch.Tensor)  # without entropies: one tensor
        return logp

    def forward(self, call: TinkerCall, *, backward: bool) -> TinkerResult:
        rows = self._rows(call.data)
        outputs: list[dict[str, bytes]] = [{} for _ in call.data]
        total = 0.0
        self.model.train()  # as the job trainer's passes (the models here have no dropout)
        for idx in self._passes([len(t) for t in rows.tokens]):
            with torch.set_grad_enabled(backward):
                logp = self._logprobs(rows, idx)
                loss = logp.new_zeros(())
                terms = []
                for b, i in enumerate(idx):
                    n = len(rows.tokens[i])
                    try:
                        el = elementwise_loss(call.loss_fn, logp[b, :n], rows.inputs[i], call.loss_config)
                    except LossInputError as e:
                        raise CallRefused(str(e)) from None
                    loss = loss + el.sum()
                    terms.append((i, logp[b, :n], el))
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"the loss is {float(loss)}: the weights or the inputs hold non-finite values")
            if backward:
                loss.backward()
                self.dirty = True
            total += float(loss.detach())
            for i, lp, el in terms:
                outputs[i] = {
                    "logprobs": lp.detach().float().cpu().numpy().astype("<f4").tobytes(),
                    "elementwise_loss": el.detach().float().cpu().numpy().astype("<f4").tobytes(),
                }
        return TinkerResult(
            job_id=call.job_id, seq=call.seq, outputs=outputs, metrics={"loss:sum": total}, body={"kind": call.kind}
        )

    # -- optim_step -----------------------------------------------------------------------
    def optim_step(self, call: TinkerCall) -> TinkerResult:
        a = call.adam
        for g in self.opt.param_groups:
            g["lr"] = a["learning_rate"]
            g["betas"] = (a["beta1"], a["beta2"])
            g["eps"] = a["eps"]
            g["weight_decay"] = a["weight_decay"]
        clip = a["grad_clip_norm"] if a["grad_clip_norm"] > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.dirty = False
        metrics = {"optimizer_step:sum": float(self.steps), "grad_norm:mean": norm}
        return TinkerResult(job_id=call.job_id, seq=call.seq, metrics=metrics, body={"kind": "optim_step"})

    # -- state in the store -------------------------------------------------------------------
    def files(self) -> dict[str, bytes]:
        return policy_files(self.model, self.rec.spec.base_model)

    def probe(self) -> dict[str, list]:
        return compute_probe(self.model, self.tok, self.rec.spec.task, self.chunk)

    def checkpoint(self, store: ObjectStore, seq: int, *, epoch: int, before_manifest) -> None:  # noqa: ANN001
        """The state after call `seq` as a burstrl checkpoint (numbered by seq): weights, AdamW, RNG."""
        state = TrainState(step=seq, extra={"tinker": {"steps": self.steps, "versions": self.versions}})
        save_checkpoint(
            store, self.rec.id, state, self.files(), self.opt, None, epoch=epoch, before_manifest=before_manifest
        )

    def restore(self, store: ObjectStore) -> int | None:
        """Back to the newest valid checkpoint; returns the seq_id it holds (None: none, as created)."""
        state = restore_newest(store, self.rec.id, self.model, self.opt)
        if state is None:
            return None
        extra = state.extra.get("tinker", {})
        self.steps, self.versions = int(extra.get("steps", 0)), int(extra.get("versions", 0))
        return state.step

    def save_named(self, store: ObjectStore, name: str, seq: int, *, epoch: int, before_manifest) -> None:  # noqa: ANN001
        """save_state: weights and AdamW under a name, a folder with its manifest last. The files go to
        a write-once subfolder and the manifest by `put_manifest`'s rule (shared/folders.py), as a
        checkpoint's: a deposed worker's late save never touches its successor's state of that name,
        and saving a name again replaces this holder's own."""
        tensors, groups = optimizer_to_tensors(self.opt)
        files = {**self.files(), OPTIMIZER: save(tensors), "state.json": json.dumps({"param_groups": groups}).encode()}
        meta = {"seq": seq, "epoch": epoch, "base_model": self.rec.spec.base_model, "rank": self.rec.spec.lora_rank}
        prefix = named_state_prefix(self.rec.id, name)
        put_folder(store, prefix, files, meta, before_manifest=before_manifest, data_dir=new_data_dir(epoch))

    def load_named(self, store: ObjectStore, source_job: str, name: str, *, optimizer: bool) -> None:
        """load_state: another (or this) model's named state; AdamW's too with `optimizer`, else a fresh one."""
        try:
            meta, files = get_folder(store, named_state_prefix(source_job, name))
        except Exception as e:  # noqa: BLE001 - missing or corrupt: the caller's path names nothing loadable
            raise CallRefused(f"no loadable state {name!r} of that model: {type(e).__name__}: {e}") from None
        if meta.get("rank") != self.rec.spec.lora_rank:
            raise CallRefused(f"state {name!r} has LoRA rank {meta.get('rank')}, this model {self.rec.spec.lora_rank}")
        opt_tensors = load(files.pop(OPTIMIZER))
        groups = json.loads(files.pop("state.json"))["param_groups"]
        load_policy_files(self.model, files)
        self.opt = self._fresh_optimizer()
        if optimizer:
            optimizer_from_tensors(self.opt, opt_tensors, groups)
        self.opt.zero_grad(set_to_none=True)
        self.dirty = False
