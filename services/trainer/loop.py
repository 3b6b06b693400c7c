"""The trainer: claim a job, gather batches from its ready stream, step, publish, ack.

Order per step (ARCHITECTURE invariant 2): train -> checkpoint (adapter, optimizer, the
ids of the groups trained) -> publish policy v{step} -> XACK those entries + ledger in
one MULTI -> move the policy pointer. A crash anywhere leaves the entries pending; on
restart the trainer restores the newest checkpoint, re-publishes its version if that
was lost, acks redelivered groups the checkpoint already contains, and re-trains the
rest: each group counts exactly once.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from services.trainer.batch import collate
from services.trainer.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    optimizer_from_tensors,
    save_checkpoint,
)
from services.trainer.grpo import group_advantages, policy_loss, token_logprobs
from services.trainer.policy import ADAPTER_WEIGHTS, adapter_files, load_adapter_weights, load_policy
from services.trainer.settings import TrainerSettings
from shared import keys
from shared.bus import Bus, Entry
from shared.job import JobRecord, JobState, load_job, save_job
from shared.metrics import record_point
from shared.policy import MANIFEST, Manifest, publish_version, version_prefix
from shared.schema import GroupMsg, PolicyPublished, decode, encode
from shared.service import ServiceRuntime, active_job_ids
from shared.store import ObjectStore

log = logging.getLogger(__name__)
CONSUMER = "trainer"  # one trainer per job (leased), so a fixed name finds its own pending entries


class JobTrainer:
    def __init__(self, rt: ServiceRuntime, settings: TrainerSettings, store: ObjectStore, rec: JobRecord) -> None:
        self.rt, self.s, self.store, self.rec = rt, settings, store, rec
        self.r = rt.redis
        self.bus = Bus(self.r, keys.GROUP_TRAINER, CONSUMER)
        spec = rec.spec
        self.device = settings.device if settings.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tok = load_policy(
            spec.base_model, rank=spec.lora_rank, alpha=spec.lora_alpha, device=self.device, seed=spec.seed
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0)
        self.state = TrainState()
        self.trained = set()
        self.pending: list[tuple[Entry, GroupMsg]] = []
        self._restore()

    # -- resume ----------------------------------------------------------------------
    def _restore(self) -> None:
        step = latest_checkpoint(self.store, self.rec.id)
        if step is not None:
            state, files, opt_tensors, groups = load_checkpoint(self.store, self.rec.id, step)
            load_adapter_weights(self.model, files[ADAPTER_WEIGHTS])
            optimizer_from_tensors(self.opt, opt_tensors, groups)
            torch.set_rng_state(opt_tensors["rng.torch"])
            self.state = state
            log.info("job %s: resumed from checkpoint step %d", self.rec.id, step)
        self.trained = set(self.state.trained_groups)
        if self.state.step > 0:
            self._publish_if_missing()

    # -- the loop --------------------------------------------------------------------
    def run(self) -> None:
        spec = self.rec.spec
        first = True  # our own pending entries (from before a crash) come first
        t_wait = time.time()
        while not self.rt.stop.is_set() and self.state.step < spec.steps:
            if not self._renew_lease():
                log.warning("job %s: lost the lease; stopping", self.rec.id)
                return
            rec = load_job(self.r, self.rec.id)
            if rec is None or rec.state in (JobState.cancelled, JobState.failed):
                return
            need = spec.batch_size - len(self.pending)
            entries = self._read(need, first)
            first = False
            self._admit(entries)
            if len(self.pending) >= spec.batch_size:
                wait_s = time.time() - t_wait
                self._step(self.pending[: spec.batch_size], wait_s)
                self.pending = self.pending[spec.batch_size :]
                t_wait = time.time()
        if self.state.step >= spec.steps:
            rec = load_job(self.r, self.rec.id)
            if rec and rec.state == JobState.running:
                rec.state, rec.updated_at = JobState.completed, time.time()
                save_job(self.r, rec)
                log.info("job %s: completed %d steps", self.rec.id, spec.steps)

    def _read(self, need: int, own_pending: bool) -> list[Entry]:
        stream = keys.ready(self.rec.id)
        if own_pending:
            resp = self.r.xreadgroup(keys.GROUP_TRAINER, CONSUMER, {stream: "0"}, count=10_000)
            return [Entry(stream, i.decode(), f.get(b"m", b"")) for _, es in resp or [] for i, f in es if f]
        return self.bus.read([stream], count=max(1, need), block_ms=1000)

    def _admit(self, entries: list[Entry]) -> None:
        spec, version = self.rec.spec, self.state.step
        for e in entries:
            try:
                g = decode(e.data, GroupMsg)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as err:
                self.bus.dead_letter(e, f"undecodable group: {err}")
                continue
            if g.group_id in self.trained:  # redelivered after a crash; already in the weights
                self.bus.ack([e])
            elif g.stage != "ready" or (spec.uses_ref and not all(c.ref_logprobs for c in g.completions)):
                self.bus.dead_letter(e, f"group not ready for training (stage {g.stage!r}, ref log-probs missing?)")
            elif version - g.policy_version > spec.max_staleness:
                self.bus.ack([e], {self.rec.id: {"dropped_stale": 1}})
            elif any(g.group_id == p.group_id for _, p in self.pending):
                self.bus.ack([e])
            else:
                self.pending.append((e, g))

    def _step(self, items: list[tuple[Entry, GroupMsg]], wait_s: float) -> None:
        spec = self.rec.spec
        t0 = time.time()
        groups = [g for _, g in items]
        b = collate(groups, self.tok.pad_token_id or 0)
        dev = self.device
        self.model.train()
        logits = self.model(input_ids=b.input_ids.to(dev), attention_mask=b.attention_mask.to(dev)).logits[:, :-1]
        logp = token_logprobs(logits, b.input_ids[:, 1:].to(dev))  # [N, L-1]
        adv = group_advantages(b.rewards).reshape(-1).to(dev)  # [N]
        loss, stats = policy_loss(
            logp,
            b.sampler_logp.to(dev),
            adv,
            b.mask.to(dev),
            clip_low=spec.clip_low,
            clip_high=spec.clip_high,
            tis_cap=spec.tis_cap,
            ref_logp=b.ref_logp.to(dev) if b.ref_logp is not None else None,
            kl_coef=spec.kl_coef,
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.opt.param_groups[0]["params"], self.s.grad_clip))
        self.opt.step()
        t_train = time.time() - t0
        # Durable first, then acknowledge (invariant 2).
        self.state.step += 1
        self.state.trained_groups.extend(g.group_id for g in groups)
        self.trained.update(g.group_id for g in groups)
        adapter = adapter_files(self.model, spec.base_model)
        save_checkpoint(self.store, self.rec.id, self.state, adapter, self.opt)
        self._publish(adapter)
        self.bus.ack([e for e, _ in items], {self.rec.id: {"trained": len(items)}})
        self._advance_pointer()
        t_pub = time.time() - t0 - t_train
        staleness = [self.state.step - 1 - v for v in b.versions]
        point = {
            "step": self.state.step,
            "loss": float(loss.detach()),
            "reward_mean": float(b.rewards.mean()),
            "grad_norm": grad_norm,
            "groups": len(groups),
            "tokens": b.tokens,
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "wait_s": round(wait_s, 3),
            "train_s": round(t_train, 3),
            "publish_s": round(t_pub, 3),
            **stats,
        }
        record_point(self.r, self.rec.id, "trainer", point)
        log.info(
            "job %s step %d/%d: reward %.3f loss %.4f mismatch_kl %.4f stale %.1f (wait %.1fs train %.2fs publish %.2fs)",
            self.rec.id,
            self.state.step,
            spec.steps,
            point["reward_mean"],
            point["loss"],
            stats["mismatch_kl"],
            point["staleness_mean"],
            wait_s,
            t_train,
            t_pub,
        )

    # -- publishing ------------------------------------------------------------------
    def _publish(self, adapter: dict[str, bytes]) -> None:
        m = Manifest(
            job_id=self.rec.id,
            version=self.state.step,
            step=self.state.step,
            base_model=self.rec.spec.base_model,
            files={},
        )
        publish_version(self.store, m, adapter)

    def _publish_if_missing(self) -> None:
        if not self.store.exists(f"{version_prefix(self.rec.id, self.state.step)}/{MANIFEST}"):
            self._publish(adapter_files(self.model, self.rec.spec.base_model))
        self._advance_pointer()

    def _advance_pointer(self) -> None:
        v = self.state.step
        cur = int(self.r.get(keys.policy_pointer(self.rec.id)) or 0)
        if v > cur:
            event = PolicyPublished(
                job_id=self.rec.id, version=v, path=version_prefix(self.rec.id, v), step=v, published_at=time.time()
            )
            pipe = self.r.pipeline(transaction=True)
            pipe.set(keys.policy_pointer(self.rec.id), v)
            pipe.xadd(keys.policy_events(self.rec.id), {b"m": encode(event)}, maxlen=1000, approximate=True)
            pipe.execute()
        self.rt.gauges["policy_versions"] = {self.rec.id: v}

    def _renew_lease(self) -> bool:
        key = keys.trainer_lease(self.rec.id)
        holder = self.r.get(key)
        if holder not in (None, self.s.replica.encode()):
            return False
        self.r.set(key, self.s.replica, ex=self.s.lease_s)
        return True


def claim_job(rt: ServiceRuntime, settings: TrainerSettings) -> JobRecord | None:
    """The first running job (or the configured one) whose lease we can take."""
    candidates = [settings.job] if settings.job else active_job_ids(rt.redis)
    for job_id in candidates:
        rec = load_job(rt.redis, job_id)
        if rec is None or rec.state != JobState.running:
            continue
        key = keys.trainer_lease(job_id)
        if rt.redis.set(key, settings.replica, nx=True, ex=settings.lease_s):
            return rec
        if rt.redis.get(key) == settings.replica.encode():  # ours, from before an error
            return rec
    return None
