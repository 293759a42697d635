"""The images a validation got most wrong: the highest losses, kept on the device as the batches go by."""

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["WorstImages"]


class WorstImages(Metric):
    """The ``count`` validation images of highest loss, with their true and predicted classes, over every process.

    Each batch keeps the highest of its losses and those kept before (``torch.topk`` on the device: no wait); at
    the end every process's are gathered (torchmetrics' own sync), and ``compute`` gives the highest overall, a
    loss seen more than once (an image a sampler repeated, or one every pipeline stage holds) once.
    """

    full_state_update = False
    losses: list[Tensor]
    images: list[Tensor]
    targets: list[Tensor]
    predictions: list[Tensor]

    def __init__(self, count: int = 16) -> None:
        super().__init__()
        self.count = count
        self.add_state("losses", default=[], dist_reduce_fx="cat")
        self.add_state("images", default=[], dist_reduce_fx="cat")
        self.add_state("targets", default=[], dist_reduce_fx="cat")
        self.add_state("predictions", default=[], dist_reduce_fx="cat")

    def update(self, images: Tensor, logits: Tensor, targets: Tensor) -> None:
        losses = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
        held = [torch.cat([*kept, new]) for kept, new in (
            (self.losses, losses), (self.images, images), (self.targets, targets), (self.predictions, logits.argmax(1))
        )]  # fmt: skip
        top = held[0].topk(min(self.count, len(held[0]))).indices
        self.losses, self.images, self.targets, self.predictions = ([tensor[top]] for tensor in held)

    def compute(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The losses, images, true classes and predicted classes, the highest loss first."""
        losses, images, targets, predictions = (
            torch.cat(state) if isinstance(state, list) else state
            for state in (self.losses, self.images, self.targets, self.predictions)
        )
        ranked, order = losses.sort(descending=True)
        distinct = torch.ones_like(ranked, dtype=torch.bool)
        distinct[1:] = ranked[1:] != ranked[:-1]
        keep = order[distinct][: self.count]
        return losses[keep], images[keep], targets[keep], predictions[keep]
