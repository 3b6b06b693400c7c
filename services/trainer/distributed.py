"""Data parallelism under torchrun: rank 0 talks to Redis and the store, every rank trains.

Rank 0 claims the job, reads each batch from the bus and broadcasts it as the groups'
msgpack bytes (docs/architecture.md, invariant 1: nothing crosses a process boundary as pickle,
so no broadcast_object_list); gradients are summed with all_reduce in `Learner`. Only
rank 0 checkpoints, publishes and acknowledges. An error on any rank ends the process
(no survive-and-retry: the other ranks would wait in a collective forever); torchrun's
--max-restarts restarts the group, which resumes from the store.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

CMD_STOP, CMD_STEP, CMD_EXIT = 0, 1, 2
# Under FSDP gathering the weights (for a version or a checkpoint), the optimizer states (for a
# checkpoint) and the probe's forward are collectives too: rank 0 announces each one and the
# followers join it (services/trainer/sharding.py), so they never have to guess its decisions.
CMD_FILES, CMD_OPTIMIZER, CMD_PROBE = 3, 4, 5


class Comm:
    def __init__(self, world: int = 1, rank: int = 0) -> None:
        self.world, self.rank = world, rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> Comm:
        """torchrun sets WORLD_SIZE/RANK; one process otherwise. gloo on CPU, nccl on GPUs."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        if not dist.is_initialized():
            # On GPUs: nccl for CUDA tensors, gloo for the CPU ones (the command and batch
            # broadcasts, the stats sums, FSDP's offloaded shards).
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            # Long timeout: followers wait in a broadcast while rank 0 waits for data.
            dist.init_process_group(backend, timeout=timedelta(hours=12))
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return cls(dist.get_world_size(), dist.get_rank())

    def broadcast_int(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.broadcast(t, src=0)
        return int(t.item())

    def broadcast_bytes(self, items: list[bytes] | None) -> list[bytes]:
        """Rank 0's list of byte strings on every rank (lengths first, then one uint8 buffer)."""
        if self.world == 1:
            return list(items or [])
        n = self.broadcast_int(len(items) if self.is_main and items is not None else 0)
        lengths = torch.tensor([len(x) for x in items] if self.is_main and items else [0] * n, dtype=torch.long)
        dist.broadcast(lengths, src=0)
        total = int(lengths.sum())
        if self.is_main and items:
            buf = torch.frombuffer(bytearray(b"".join(items)), dtype=torch.uint8) if total else torch.empty(0)
        else:
            buf = torch.empty(total, dtype=torch.uint8)
        if total:
            dist.broadcast(buf, src=0)
        raw = buf.numpy().tobytes()
        out, off = [], 0
        for n_i in lengths.tolist():
            out.append(raw[off : off + n_i])
            off += n_i
        return out
