"""The report's PNG plots, drawn with matplotlib's file-only Agg backend (no display needed).

Each function takes plain series, so the report decides what is plotted and these only draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless machine has no display to open

import matplotlib.pyplot as plt  # noqa: E402

# {(system, workload): [(x, y), ...]}: colour tells systems apart, line style workloads.
Lines = Mapping[tuple[str, str], Sequence[tuple[float, float]]]
# {group on the x axis: {bar name: value}}
Bars = Mapping[str, Mapping[str, float]]


def line_panels(path: Path, panels: Sequence[tuple[str, Lines]], xlabel: str,
                title: str) -> Path:
    """Side-by-side panels of y against x, one line per series; y on a log scale when it
    spans more than a factor of 20 (latencies under load often do)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    systems = sorted({system for _, lines in panels for system, _ in lines})
    workloads = sorted({workload for _, lines in panels for _, workload in lines})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "P")]
    for ax, (ylabel, lines) in zip(axes[0], panels, strict=True):
        values = [y for points in lines.values() for _, y in points if y > 0]
        for (system, workload), points in sorted(lines.items()):
            ordered = sorted(points)
            style, marker = styles[workloads.index(workload) % len(styles)]
            ax.plot([x for x, _ in ordered], [y for _, y in ordered], linestyle=style,
                    marker=marker, color=colours[systems.index(system) % len(colours)],
                    label=f"{system} · {workload}")
        if values and max(values) / min(values) > 20:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_panels(path: Path, panels: Sequence[tuple[str, Bars]], title: str,
               marks: Mapping[str, float] | None = None, percent: bool = False) -> Path:
    """Grouped bars per panel; `marks` draws a black tick over each group (e.g. the hit rate
    the workload implies), `percent` scales 0..1 values to 0..100 %."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.8 * len(panels)), squeeze=False)
    scale = 100.0 if percent else 1.0
    for ax, (ylabel, groups) in zip(axes[:, 0], panels, strict=True):
        names = sorted({bar for bars in groups.values() for bar in bars})
        group_names = list(groups)
        width = 0.8 / max(1, len(names))
        for b, name in enumerate(names):
            xs = [g + (b - (len(names) - 1) / 2) * width for g in range(len(group_names))]
            ys = [groups[group].get(name, 0.0) * scale for group in group_names]
            ax.bar(xs, ys, width, label=name)
        if marks:
            for g, group in enumerate(group_names):
                if group in marks:
                    ax.hlines(marks[group] * scale, g - 0.45, g + 0.45, colors="black",
                              linestyles="--", linewidth=1.2)
        ax.set_xticks(range(len(group_names)))
        ax.set_xticklabels(group_names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
        if percent:
            ax.set_ylim(0, 100)
        if names:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
