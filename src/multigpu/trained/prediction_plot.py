"""``predict --predictions.plot=true``: the first images with their predicted and true classes, as a PNG grid."""

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

__all__ = ["plot_predictions"]


def plot_predictions(
    images: Sequence[torch.Tensor],
    rows: Sequence[tuple],
    path: Path,
    class_name: Callable[[int], str],
    stats: tuple[Sequence[float], Sequence[float]],
) -> None:
    """Draw ``images`` (normalised with ``stats``, the mean and std), each titled with its predicted class and
    probability and, where it has one, its true class (green when right, red when wrong); ``rows``: ``(index,
    label, classes, probabilities)`` of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 8
    lines = max(1, -(-len(images) // columns))
    figure, axes = plt.subplots(lines, columns, figsize=(columns * 1.3, lines * 1.8), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    shift, scale = (torch.tensor(values)[:, None, None] for values in stats)
    for axis, image, (index, label, classes, values) in zip(axes.flat, images, rows):
        axis.imshow((image * scale + shift).clamp(0, 1).permute(1, 2, 0).numpy())
        title = f"{class_name(classes[0])} {values[0]:.0%}"
        colour = "black"
        if label >= 0:
            title += f"\n({class_name(label)})"
            colour = "#2a7a2a" if classes[0] == label else "#b02020"
        axis.set_title(title, fontsize=7, color=colour)
    figure.suptitle("predicted class and probability (true class)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
