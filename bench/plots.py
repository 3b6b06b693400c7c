"""Plots the stack benchmarks share: held-out accuracy against seconds, one curve per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def accuracy_curves(
    curves: list[tuple[str, list[dict[str, Any]]]],
    png: Path,
    *,
    xlabel: str,
    title: str,
    threshold: float | None = None,
    marker_size: float = 6.0,
) -> None:
    """`curves`: (label, evals) with each eval's `t` (seconds) and `accuracy`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, evals in curves:
        ax.plot([e["t"] for e in evals], [e["accuracy"] for e in evals], "o-", ms=marker_size, label=label)
    if threshold is not None:
        ax.axhline(threshold, color="grey", ls=":", label="threshold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out accuracy (T=1)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
