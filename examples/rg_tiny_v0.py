"""How the tiny models do on reasoning-gym prompts before any RL (v0), in several shapes.

    PYTHONPATH=. .venv/bin/python examples/rg_tiny_v0.py

HF generate on .burstrl/models/tiny-sft (SFT'd on burstrl's "a+b=") in several shapes, and on
.burstrl/models/tiny-sft-rg (`burstrl init-model --rg`: SFT'd on examples/demo_rg.toml's task)
in the demo's: up to 64 held-out items per shape, greedy accuracy and sampled accuracy (8
samples at T=1), both "reward 1.0" by the dataset's own scorer, and the share of prompts whose
8 samples are neither all right nor all wrong. A shape whose sampled accuracy is ~0 gives GRPO
no signal: every group scores alike.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.domain.tasks import make_task
from shared.ml.models import RG_MODEL_NAME
from shared.task_spec import render_template

MODEL = ".burstrl/models/tiny-sft"
RG_MODEL = f".burstrl/models/{RG_MODEL_NAME}"
SMALL_SUM = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"], "allow_parentheses": False}
DEMO = tomllib.loads(Path("examples/demo_rg.toml").read_text())
SHAPES = [
    ("rg:basic_arithmetic", SMALL_SUM, ""),  # rg's question + the <answer> line
    ("rg:basic_arithmetic", {**SMALL_SUM, "answer_format": "raw"}, ""),  # "Calculate 3 + 5."
    ("rg:basic_arithmetic", {**SMALL_SUM, "answer_format": "raw"}, "{expression}="),  # "3 + 5="
    ("rg:chain_sum", {"min_terms": 2, "max_terms": 2, "max_digits": 1, "answer_format": "raw"}, "{expression}="),
    (DEMO["task"], DEMO["task_spec"]["args"], DEMO["task_spec"]["template"]),  # examples/demo_rg.toml: "5 + 8 - 9 ="
]


def main(n: int = 64, k: int = 8) -> None:
    for model_dir, shapes in ((MODEL, SHAPES), (RG_MODEL, SHAPES[-1:])):
        if not (Path(model_dir) / "burstrl_ready.json").exists():  # not installed: say so
            print(f"{model_dir}: not installed (burstrl init-model{' --rg' if model_dir == RG_MODEL else ''})")
            continue
        probe(model_dir, shapes, n, k)


def probe(model_dir: str, shapes: list[tuple[str, dict, str]], n: int, k: int) -> None:
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, args, template in shapes:
        task = make_task(name, args)
        items = task.heldout_items(n)
        greedy = sampled = mixed = 0
        for it in items:
            prompt = render_template(template, {**it.fields, "prompt": it.prompt}) if template else it.prompt
            ids = tok(prompt, return_tensors="pt")
            start = ids["input_ids"].shape[1]
            with torch.no_grad():
                g = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
                s = model.generate(
                    **ids, max_new_tokens=8, do_sample=True, temperature=1.0, num_return_sequences=k,
                    pad_token_id=tok.pad_token_id,
                )  # fmt: skip
            greedy += task.score(tok.decode(g[0, start:], skip_special_tokens=True), it.fields)["correct"] >= 1.0
            right = sum(
                task.score(tok.decode(o[start:], skip_special_tokens=True), it.fields)["correct"] >= 1.0 for o in s
            )
            sampled += right
            mixed += 0 < right < k
        print(
            f"{model_dir}: {name} args={args} template={template!r} e.g. {prompt!r}: {len(items)} held-out, "
            f"greedy {greedy / len(items):.3f}, sampled {sampled / len(items) / k:.3f}, "
            f"mixed groups {mixed / len(items):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
