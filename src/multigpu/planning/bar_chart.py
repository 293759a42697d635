"""A horizontal bar chart of images per second, one bar per configuration: the benchmark's and ``plan``'s."""

from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_bar_chart"]


def write_bar_chart(
    names: Sequence[str],
    values: Sequence[float],
    notes: Sequence[str],
    title: str,
    path: Path,
    grey: Sequence[bool] | None = None,
) -> None:
    """Bars of ``values`` (images per second) top to bottom in the given order, each labelled with its
    value and ``notes``; ``grey`` marks reference bars. Written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grey = list(grey) if grey is not None else [False] * len(names)
    figure, axes = plt.subplots(figsize=(8, 0.5 * len(names) + 1.5))
    bars = axes.barh(
        list(names)[::-1], list(values)[::-1], color=["#999999" if reference else "#3b75af" for reference in grey[::-1]]
    )
    for bar, value, note in zip(bars, list(values)[::-1], list(notes)[::-1]):
        label = f"{value:.1f}" + (f", {note}" if note else "")
        axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, "  " + label, va="center", fontsize=8)
    axes.set_xlabel("training images per second")
    axes.set_xlim(0, max(values) * 1.45)
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
