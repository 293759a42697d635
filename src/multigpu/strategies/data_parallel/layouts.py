"""``dp`` (``DataParallelStrategy``): one process, a slice of the batch on each of its CUDA devices."""

from multigpu.strategies.layout import (
    Layout,
    LayoutRequest,
    Refuse,
    activations,
    held,
    refused,
    several_devices,
    state,
)
from multigpu.strategies.network_lookup import check_not_compiled

__all__ = ["DataParallelLayout"]


class DataParallelLayout(Layout):
    """A slice of the batch on every device at once, the parameters broadcast and the gradients gathered on the
    first every step; the first device also holds the optimizer state, the others a copy of the parameters and
    their gradients."""

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        if not request.cuda:
            refuse(cls.strategy, "needs CUDA devices (without them dp trains on one device)")
            return []
        if refused(refuse, cls.strategy, lambda: check_not_compiled(cls.strategy, request.compiled)):
            return []
        if not several_devices(cls.strategy, request, refuse):
            return []
        return [cls(cls.strategy, request.devices, 1, request.batch_size * request.devices)]

    @property
    def replicas(self) -> int:
        return 1

    @property
    def timed_input(self) -> tuple[int, int]:
        return -(-self.batch_size // self.devices), self.processes

    def device_memory(self, memory, optimizer_states) -> list[list[int]]:
        every = range(len(memory.params))
        kept = activations(memory, every, self.timed_input[0], self.recompute)
        first = state(memory, every, optimizer_states) + kept
        return [[int(first)] + [int(2 * held(memory, every) + kept)] * (self.devices - 1)]

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        copies = 2 * links.send(sum(memory.params))  # parameters out to the devices, gradients back
        return sum(forward) + sum(backward) + copies + sum(update)
