"""One device, Lightning's own strategy: the layout every other one is compared with."""

from typing import ClassVar

from multigpu.strategies.layout import Layout, LayoutRequest, Refuse

__all__ = ["OneDeviceLayout"]


class OneDeviceLayout(Layout):
    """The whole batch through the whole network on one device: the passes, then the update."""

    reference: ClassVar[bool] = True

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        return [cls("1 device", 1, 1, request.batch_size)]

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        return sum(forward) + sum(backward) + sum(update)
