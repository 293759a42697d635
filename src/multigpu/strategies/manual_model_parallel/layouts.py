"""``manual_model_parallel`` (``ManualModelParallelStrategy``): consecutive blocks on consecutive devices of one
process, optionally replicated with DDP."""

from dataclasses import dataclass

from multigpu.strategies.layout import (
    Layout,
    LayoutRequest,
    Refuse,
    activations,
    boundary_bytes,
    held,
    overlapped_reduction,
    refused,
    state,
)
from multigpu.strategies.manual_model_parallel.strategy import check_devices_per_replica
from multigpu.strategies.network_lookup import check_not_compiled
from multigpu.strategies.partition import stage_ranges

__all__ = ["ModelParallelLayout"]

DEVICES_PER_REPLICA = (2, 4)


@dataclass(frozen=True)
class ModelParallelLayout(Layout):
    """The stages one after another for the whole batch, the activations and their gradients sent between devices,
    and with several replicas ``ddp``'s all-reduce (and its buckets); each device holds its stage's blocks, for
    the whole batch."""

    devices_per_replica: int = 2

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        layouts: list[Layout] = []
        for per_replica in DEVICES_PER_REPLICA:
            what = f"manual_model_parallel over {per_replica} devices per replica"
            if refused(
                refuse,
                what,
                lambda: check_not_compiled(cls.strategy, request.compiled),
                lambda: check_devices_per_replica(request.devices, per_replica),
            ):
                continue
            replicas = request.devices // per_replica
            name = f"model parallel {per_replica}" + (f" x{replicas}" if replicas > 1 else "")
            batch = request.batch_size * per_replica
            layouts.append(cls(name, request.devices, replicas, batch, devices_per_replica=per_replica))
        return layouts

    @property
    def num_stages(self) -> int:
        return self.devices_per_replica

    def strategy_options(self) -> dict[str, object]:
        return {"devices_per_replica": self.devices_per_replica}

    def device_memory(self, memory, optimizer_states) -> list[list[int]]:
        if self.balance is None:
            raise ValueError("a split layout needs its balance before its memory is estimated")
        buckets = self.replicas > 1
        devices = [
            int(
                state(memory, blocks, optimizer_states)
                + (held(memory, blocks) if buckets else 0)
                + activations(memory, blocks, self.batch_size, self.recompute)
            )
            for blocks in stage_ranges(self.balance)
        ]
        return [devices for _ in range(self.processes)]

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        assert self.balance is not None, "a split layout is balanced before its forecast"
        sends = boundary_bytes(memory, self.balance, self.batch_size) if links.cuda else []  # CPU: one memory
        moved = 2 * sum(links.send(nbytes) for nbytes in sends)  # activations forward, their gradients back
        reduce = lambda nbytes: links.all_reduce(nbytes, self.replicas)  # noqa: E731
        return sum(forward) + moved + overlapped_reduction(backward, memory.params, reduce, links.overlap) + sum(update)
