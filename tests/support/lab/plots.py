"""Plots the stack benchmarks share: held-out accuracy against seconds, one curve per run."""

from __future__ import annotations

import math
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
    accuracy_panels([(title, curves)], png, xlabel=xlabel, threshold=threshold, marker_size=marker_size)


def accuracy_panels(
    panels: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]],
    png: Path,
    *,
    xlabel: str,
    threshold: float | None = None,
    marker_size: float = 6.0,
) -> None:
    """One panel per (title, curves), side by side with a shared y axis; a label keeps its colour
    in every panel, so the same setup reads the same across rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(7 if n == 1 else 4.5 * n, 4), sharey=True, squeeze=False)
    colours: dict[str, str] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, curves) in zip(axes[0], panels, strict=True):
        for label, evals in curves:
            c = colours.setdefault(label, cycle[len(colours) % len(cycle)])
            ax.plot([e["t"] for e in evals], [e["accuracy"] for e in evals], "o-", ms=marker_size, color=c, label=label)
        if threshold is not None:
            ax.axhline(threshold, color="grey", ls=":", label="threshold")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.set_title(title)
    axes[0][0].set_ylabel("held-out accuracy (T=1)")
    if n == 1:
        axes[0][0].legend()
        fig.tight_layout()
    else:  # below the panels, once: inside one it would cover that round's curves
        seen: dict[str, Any] = {}
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                seen.setdefault(lab, h)
        fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(3, len(seen)), fontsize="small")
        fig.tight_layout(rect=(0, 0.06 * math.ceil(len(seen) / 3) + 0.02, 1, 1))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
