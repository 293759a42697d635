"""``ddp``, Lightning's own: a replica of the whole network in each process, its gradients all-reduced."""

from typing import ClassVar

from multigpu.strategies.layouts.layout import Layout, LayoutRequest, Refuse, held, overlapped_reduction

__all__ = ["DDPLayout", "several_devices"]


def several_devices(strategy: str, request: LayoutRequest, refuse: Refuse) -> bool:
    """Whether ``request`` has the devices a strategy of one process per device needs; else refuse it."""
    if request.devices < 2:
        refuse(strategy, f"needs 2 devices or more; --trainer.devices={request.devices}")
        return False
    return True


class DDPLayout(Layout):
    """The backward pass hands DDP's buckets to an all-reduce as each fills; the all-reduces run one after another
    beside the backward pass, and the step waits for the last. Each device also holds the buckets: one more copy of
    the gradients."""

    strategy: ClassVar[str] = "ddp"

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        if not several_devices(cls.strategy, request, refuse):
            return []
        return [cls(cls.strategy, request.devices, request.devices, request.batch_size)]

    def device_memory(self, memory, optimizer_states) -> list[list[int]]:
        buckets = held(memory, range(len(memory.params)))
        return [[device + buckets for device in process] for process in super().device_memory(memory, optimizer_states)]

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        reduce = lambda nbytes: links.all_reduce(nbytes, self.processes)  # noqa: E731
        return sum(forward) + overlapped_reduction(backward, memory.params, reduce, links.overlap) + sum(update)
