"""``ddp``, Lightning's own: a replica of the whole network in each process, its gradients all-reduced."""

from multigpu.strategies.layout import Layout, LayoutRequest, Refuse, held, overlapped_reduction, several_devices

__all__ = ["DDPLayout"]


class DDPLayout(Layout):
    """The backward pass hands DDP's buckets to an all-reduce as each fills; the all-reduces run one after another
    beside the backward pass, and the step waits for the last. Each device also holds the buckets: one more copy of
    the gradients."""

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
