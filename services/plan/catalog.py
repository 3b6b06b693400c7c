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
    price_per_hour = 0.22   # USD; optional, 0 by default for a card you add
    owned = false            # true: yours, always on; false: rented, held only in bursts

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
    price_per_hour: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="USD per card-hour while held: a rental's on-demand rate; 0 for owned cards (marginal cost).",
    )
    owned: bool = Field(
        default=False,
        description="Owned cards run around the clock; rented ones are held (and billed) only during bursts.",
    )
    note: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def serve_dtype(self) -> str:
        """What vLLM and the ref compute in: bf16 where the card has it, else fp16 (gfx906)."""
        return "bf16" if self.bf16_tflops > 0 else "fp16"

    @property
    def train_dtype(self) -> str:
        """What the trainer computes in: bf16 where the card has it, else fp32.

        The trainer's dtype setting is auto | bfloat16 | float32: it has no fp16 with loss
        scaling, so a card without bf16 (gfx906) trains in fp32.
        """
        return "bf16" if self.bf16_tflops > 0 else "fp32"

    @property
    def tflops(self) -> float:
        """Throughput at the card's preferred 16-bit dtype."""
        return self.bf16_tflops if self.bf16_tflops > 0 else self.fp16_tflops

    @property
    def train_tflops(self) -> float:
        """Throughput at `train_dtype`. The catalog has no fp32 column: without bf16 we assume
        half the fp16 rate, which is gfx906's ratio (packed fp16 runs two lanes per fp32 lane)."""
        return self.bf16_tflops if self.bf16_tflops > 0 else self.fp16_tflops / 2


def _card(
    name: str,
    mem: float,
    bf16: float,
    fp16: float,
    bw: float,
    link: float,
    note: str = "",
) -> Card:
    owned = name in OWNED
    return Card(
        name=name,
        memory_gb=mem,
        bf16_tflops=bf16,
        fp16_tflops=fp16,
        bandwidth_gbs=bw,
        link_gbs=link,
        price_per_hour=0.0 if owned else PRICES[name],
        owned=owned,
        note=note,
    )


# Cards burstrl's user has at home: their marginal cost is 0 (electricity aside; set a price
# with --price to count it), and they may run around the clock.
OWNED = {"mi50-16", "mi50-32", "rtx4070"}
# Default rental prices, USD per card-hour, on-demand (not spot, not reserved), as typical
# 2025-2026 listings showed them. They move month to month and differ by provider: override
# with --price CARD=USD (or price_per_hour in --cards-file).
PRICES = {
    # RunPod H200 SXM listing, $3.59/h (deploybase.ai "H200 vs H100", Nov 2025 / Mar 2026).
    "h200": 3.59,
    # RunPod Secure Cloud H100 SXM5, ~$2.69/h (spheron.network "RunPod H100 pricing 2026";
    # Lambda lists $2.99-3.78/h for the same card).
    "h100": 2.69,
    # Not listed by US/EU clouds (export variant): assumed at the H100's rate.
    "h800": 2.69,
    # Not listed by US/EU clouds (export variant): assumed at about half an H100's rate.
    "h20": 1.40,
    # A100 SXM 80 GB: $1.39-1.79/h on-demand across RunPod/Lambda listings (2025-2026).
    "a100-80": 1.64,
    # A100 40 GB: Lambda-style $1.29/h (2025).
    "a100-40": 1.29,
    # L40S 48 GB: $0.86-0.87/h (aihardwareindex.com "cost-per-token", Dec 2025, cloud median).
    "l40s": 0.87,
    # RTX 4090: $0.34/h community spot to $0.60/h on-demand (deploybase.ai RunPod guide, Mar 2026).
    "rtx4090": 0.60,
    # RTX 4070 is listed as owned above; as a rental it would be about this (consumer-card tier).
    "rtx4070": 0.20,
    # MI50s are rarely rented; as a rental they would be about this (older-card tier).
    "mi50-16": 0.15,
    "mi50-32": 0.20,
}


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
        _card("l40s", 48, 362, 362, 864, 32, "PCIe 4.0 x16; data-center Ada: full-rate FP32 accumulate"),
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
            known = cards.get(key)
            # An override keeps the built-in's price and ownership unless it sets them; a new
            # card without a price is taken to be one you own.
            defaults = {"fp16_tflops": fields.get("bf16_tflops", 0)}
            if known is not None:
                defaults |= {"price_per_hour": known.price_per_hour, "owned": known.owned}
            else:
                defaults["owned"] = not fields.get("price_per_hour")
            fields = {**defaults, **fields}
            cards[key] = Card(name=key, **{k: v for k, v in fields.items() if k != "name"})
        return Catalog(cards=cards)

    def with_costs(
        self,
        prices: dict[str, float] | None = None,
        owned: list[str] | None = None,
        rented: list[str] | None = None,
    ) -> Catalog:
        """Override prices (USD per card-hour) and which cards are owned or rented.

        A card made rented without a price of its own takes the catalog's rental default
        (`PRICES`); a card made owned costs 0 unless a price is given for it too.
        """
        prices = {normalize_name(k): v for k, v in (prices or {}).items()}
        owned_keys = {normalize_name(n) for n in owned or []}
        rented_keys = {normalize_name(n) for n in rented or []}
        if both := owned_keys & rented_keys:
            raise ValueError(f"--owned and --rented both name {', '.join(sorted(both))}: pick one")
        for flag, keys in (("--price", prices), ("--owned", owned_keys), ("--rented", rented_keys)):
            for key in keys:
                if key not in self.cards:
                    known = ", ".join(sorted(self.cards))
                    raise KeyError(f"{flag} {key}: unknown card; known: {known} (add more with --cards-file)")
        cards = dict(self.cards)
        for key, card in cards.items():
            update: dict[str, object] = {}
            if key in owned_keys:
                update |= {"owned": True, "price_per_hour": 0.0}
            if key in rented_keys:
                update |= {"owned": False, "price_per_hour": card.price_per_hour or PRICES.get(key, 0.0)}
            if key in prices:
                update["price_per_hour"] = prices[key]
            cards[key] = card.model_copy(update=update)
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
