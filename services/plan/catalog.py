"""Card catalog: memory, dense 16-bit throughput and bandwidth of the GPUs burstrl targets.

The planner (`services.plan.placement`) reads cards from here; `memory.py` never does (it is
pure math over byte counts). Users add or override cards with a TOML/JSON file
(`--cards-file`), e.g.::

    [cards.rtx3090]
    memory_gb = 24
    bf16_tflops = 71
    fp16_tflops = 71
    bandwidth_gbs = 936
    link_gbs = 32

Numbers are vendor peak figures for *dense* math (no 2:4 sparsity) with FP32 accumulation,
which is what training and vLLM actually use; the planner scales them by efficiency factors.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from pydantic import BaseModel, Field


class Card(BaseModel):
    """One GPU model. Throughputs are dense peak TFLOPS; 0 means "not supported in hardware"."""

    name: str = Field(description="Catalog key, lower case, e.g. 'h200'.")
    memory_gb: float = Field(gt=0, description="Device memory in GB (10^9 bytes, as vendors count).")
    bf16_tflops: float = Field(ge=0, description="Dense bf16 tensor TFLOPS with FP32 accumulate; 0 if no bf16.")
    fp16_tflops: float = Field(gt=0, description="Dense fp16 TFLOPS with FP32 accumulate.")
    bandwidth_gbs: float = Field(gt=0, description="Device memory bandwidth, GB/s.")
    link_gbs: float = Field(
        default=32.0,
        gt=0,
        description="Per-card bandwidth to peer cards (NVLink) or host (PCIe), GB/s.",
    )
    note: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def train_dtype(self) -> str:
        """bf16 where the card has it; fp16 (with loss scaling) otherwise, e.g. gfx906."""
        return "bf16" if self.bf16_tflops > 0 else "fp16"

    @property
    def tflops(self) -> float:
        """Throughput at the card's preferred 16-bit dtype."""
        return self.bf16_tflops if self.bf16_tflops > 0 else self.fp16_tflops


def _card(
    name: str,
    mem: float,
    bf16: float,
    fp16: float,
    bw: float,
    link: float,
    note: str = "",
) -> Card:
    return Card(
        name=name,
        memory_gb=mem,
        bf16_tflops=bf16,
        fp16_tflops=fp16,
        bandwidth_gbs=bw,
        link_gbs=link,
        note=note,
    )


# Sources: AMD/NVIDIA data sheets and the Ada whitepaper. GeForce cards run FP32-accumulate
# tensor math at half the FP16-accumulate rate, so the 4070/4090 figures are the halved ones.
BUILTIN_CARDS: dict[str, Card] = {
    c.name: c
    for c in [
        _card(
            "mi50-16",
            16,
            0,
            26.5,
            1024,
            32,
            "gfx906: no bf16, no matrix cores; vLLM via the gfx906 fork",
        ),
        _card(
            "mi50-32",
            32,
            0,
            26.5,
            1024,
            32,
            "gfx906: no bf16, no matrix cores; vLLM via the gfx906 fork",
        ),
        _card("rtx4070", 12, 58.3, 58.3, 504, 32, "PCIe 4.0 x16"),
        _card("rtx4090", 24, 165.2, 165.2, 1008, 32, "PCIe 4.0 x16"),
        _card("a100-40", 40, 312, 312, 1555, 600, "SXM"),
        _card("a100-80", 80, 312, 312, 2039, 600, "SXM"),
        _card("h100", 80, 989, 989, 3350, 900, "SXM"),
        _card("h800", 80, 989, 989, 3350, 400, "SXM, NVLink cut to 400 GB/s"),
        _card("h20", 96, 148, 148, 4000, 900, "low compute, high bandwidth"),
        _card("h200", 141, 989, 989, 4800, 900, "SXM"),
    ]
}

# Accepted spellings: "MI50 32GB", "mi50-32", "RTX 4090", "A100-80GB", "H200" ...
_ALIASES = {"mi50": "mi50-16", "a100": "a100-80"}


def normalize_name(name: str) -> str:
    """'RTX 4090' -> 'rtx4090', 'A100 80GB' -> 'a100-80', 'mi50_32gb' -> 'mi50-32'."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = re.sub(r"-?gb$", "", key)
    key = re.sub(r"^(rtx|gtx)-", r"\1", key)
    return _ALIASES.get(key, key)


class Catalog(BaseModel):
    """The cards the planner may place roles on: built-ins plus user-supplied ones."""

    cards: dict[str, Card] = Field(default_factory=lambda: dict(BUILTIN_CARDS))

    def get(self, name: str) -> Card:
        key = normalize_name(name)
        if key in self.cards:
            return self.cards[key]
        known = ", ".join(sorted(self.cards))
        raise KeyError(f"unknown card {name!r}; known: {known} (add more with --cards-file)")

    def extend_from_file(self, path: str | Path) -> Catalog:
        """Add/override cards from a TOML or JSON file holding a `cards` table keyed by name."""
        path = Path(path)
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        cards = dict(self.cards)
        for name, fields in data.get("cards", data).items():
            key = normalize_name(name)
            fields = {"fp16_tflops": fields.get("bf16_tflops", 0), **fields}
            cards[key] = Card(name=key, **{k: v for k, v in fields.items() if k != "name"})
        return Catalog(cards=cards)


def parse_card_spec(spec: str, catalog: Catalog) -> tuple[Card, int]:
    """'h200', 'mi50-32:3', 'rtx4070x2' or '3xmi50-32' -> (card, count)."""
    spec = spec.strip()
    # Card names contain digits and even 'x' (rtx4090), so a count is only split off when
    # what remains is a known card.
    candidates = [(spec, "1")]
    if m := re.fullmatch(r"(.+?)\s*[:x*]\s*(\d+)", spec, flags=re.IGNORECASE):
        candidates.append((m.group(1), m.group(2)))
    if m := re.fullmatch(r"(\d+)\s*[x*]\s*(.+)", spec, flags=re.IGNORECASE):
        candidates.append((m.group(2), m.group(1)))
    for name, count in candidates:
        if normalize_name(name) in catalog.cards:
            if int(count) < 1:
                raise ValueError(f"card count must be >= 1 in {spec!r}")
            return catalog.cards[normalize_name(name)], int(count)
    catalog.get(spec)  # raises KeyError listing the known cards
    raise AssertionError("unreachable")
