"""``fsdp`` (``FullyShardedStrategy``): parameters, gradients and optimizer state sharded over the processes."""

from dataclasses import dataclass

from multigpu.strategies.layout import Layout, LayoutRequest, Refuse, activations, refused, several_devices, state
from multigpu.strategies.network_lookup import check_not_compiled

__all__ = ["FullyShardedLayout"]


@dataclass(frozen=True)
class FullyShardedLayout(Layout):
    """Each block's parameters are all-gathered before its forward and backward pass (the next block's while this
    one computes) and its gradients reduce-scattered after its backward pass, one transfer at a time beside the
    computation, plus ``fully_shard``'s own cost per block and per byte of its parameters. A device holds 1/N of
    the state; whole at once only a block's parameters (the one computing and the next, gathered ahead) and, in the
    backward pass, its gradients before they are reduce-scattered."""

    reshard_after_forward: bool = True

    def strategy_options(self) -> dict[str, object]:
        return {} if self.reshard_after_forward else {"reshard_after_forward": False}

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        if refused(refuse, cls.strategy, lambda: check_not_compiled(cls.strategy, request.compiled)):
            return []
        if not several_devices(cls.strategy, request, refuse):
            return []
        return [cls(cls.strategy, request.devices, request.devices, request.batch_size)]

    def device_memory(self, memory, optimizer_states) -> list[list[int]]:
        every = range(len(memory.params))
        gathered = 3 * max(memory.params)
        sharded = state(memory, every, optimizer_states) / self.devices
        device = sharded + gathered + activations(memory, every, self.batch_size, self.recompute)
        return [[int(device)] for _ in range(self.processes)]

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        group, params = self.processes, memory.params
        gather = lambda block: links.all_gather(params[block], group, latency=False)  # noqa: E731
        scatter = lambda block: links.reduce_scatter(params[block], group, latency=False)  # noqa: E731
        # The runtime's own cost, per pass: per block, and per byte the copies into and out of its collectives' buffers
        own = [(links.sharded_block + links.sharded_byte * nbytes) / 2 if nbytes else 0.0 for nbytes in params]
        serial, last = not links.overlap, len(params) - 1
        link = gather(0)  # the first block's parameters, before anything computes
        compute = link if serial else 0.0
        for block in range(last + 1):  # forward: block + 1's gather starts as block starts
            start = max(compute, link)
            if block < last:
                link = max(link, start) + gather(block + 1)
                start = link if serial else start
            compute = start + forward[block] + own[block]
        regather = self.reshard_after_forward
        if regather:
            link = max(link, compute) + gather(last)
            compute = link if serial else compute
        for block in range(last, -1, -1):  # backward: block - 1's gather, then block's reduce-scatter
            start = max(compute, link) if regather else compute
            if regather and block > 0:
                link = max(link, start) + gather(block - 1)
                start = link if serial else start
            compute = start + backward[block] + own[block]
            link = max(link, compute) + scatter(block)
            compute = link if serial else compute
        return max(compute, link) + sum(update) / group + sum(memory.tensors) * links.sharded_update
