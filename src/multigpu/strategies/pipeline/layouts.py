"""``pipeline`` (``PipelineStrategy``): one process per stage (or several stages each), micro-batches under a
schedule, optionally replicated."""

from dataclasses import dataclass

from multigpu.errors import UsageError
from multigpu.strategies.layout import Layout, LayoutRequest, Refuse, activations, boundary_bytes, refused, state
from multigpu.strategies.network_lookup import check_not_compiled
from multigpu.strategies.partition import stage_ranges
from multigpu.strategies.pipeline.simulation import simulate_step, splits_backward
from multigpu.strategies.pipeline.stage_placement import (
    StagePlacement,
    natural_stages_per_process,
    processes_per_pipeline,
)

__all__ = ["PipelineLayout"]

PIPELINE_PROCESSES = (2, 4)
_ALL_AT_ONCE = ("gpipe", "loopedbfs")  # schedules that run every micro-batch's forward pass before a backward


@dataclass(frozen=True)
class PipelineLayout(Layout):
    """The schedule's step simulated from its action lists (``strategies.pipeline.simulation``), the zero-bubble
    schedules' split backward passes as much longer as the network's measured split in two
    (``BlockProfile.split_backward``; their whole ones, DualPipeV's most, not), its passes slowed by the processes'
    average concurrency over the step (they compute at once only between the bubbles); then, every process waiting
    for the step's last action (the last stage's output is shared with all), with several copies of the pipeline an
    all-reduce of each process's gradients, and the update of its blocks, the step ending with the slowest
    process's (the stage of the largest blocks updates longest).

    Each process holds its stages' blocks, for one micro-batch times the micro-batches in flight (GPipe and
    LoopedBFS run every forward pass first: all of them; the others at most as many as there are stages after this
    one)."""

    stages: int = 2  # of one copy of the pipeline: num_stages
    stages_per_process: int = 1
    schedule: str = "1f1b"

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list[Layout]:
        layouts: list[Layout] = []
        for processes in PIPELINE_PROCESSES:
            what = f"pipeline over {processes} processes"
            if refused(
                refuse,
                what,
                lambda: check_not_compiled(cls.strategy, request.compiled),
                lambda: processes_per_pipeline(request.devices, processes, 1),
            ):
                continue
            counts = request.micro_batches or (processes, 2 * processes, 4 * processes)
            batch = request.batch_size * processes
            for schedule in request.schedules:
                per_process = natural_stages_per_process(schedule)
                stages = processes * per_process
                for count in counts:
                    what = f"pipeline {stages} stages {schedule.lower()} m{count}"
                    if batch % count:
                        refuse(
                            what,
                            f"its batch of {batch} images ({processes} x --data.batch_size) is not divisible by "
                            f"{count} micro-batches",
                        )
                        continue
                    try:
                        StagePlacement(schedule, processes, per_process).check(count)
                    except UsageError as error:
                        refuse(what, str(error).rstrip("."))
                        continue
                    replicas = request.devices // processes
                    name = (
                        f"pipeline {stages}"
                        + (f"/{processes}p" if per_process > 1 else "")
                        + (f" x{replicas}" if replicas > 1 else "")
                        + f" {schedule.lower()} m{count}"
                    )
                    layouts.append(
                        cls(
                            name,
                            request.devices,
                            request.devices,
                            batch,
                            micro_batches=count,
                            stages=stages,
                            stages_per_process=per_process,
                            schedule=schedule.lower(),
                        )
                    )
        return layouts

    @property
    def placement(self) -> StagePlacement:
        """Where the stages of one copy of the pipeline go."""
        per_process = self.stages_per_process
        return StagePlacement(self.schedule, self.num_stages // per_process, per_process)

    @property
    def num_stages(self) -> int:
        return self.stages

    def strategy_options(self) -> dict[str, object]:
        return {
            "num_stages": self.stages,
            "stages_per_process": self.stages_per_process,
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
        }

    @property
    def replicas(self) -> int:
        return self.processes // self.placement.processes

    @property
    def in_lockstep(self) -> bool:
        return False  # the processes compute different stages, with the bubbles between to absorb a slow one

    def device_memory(self, memory, optimizer_states) -> list[list[int]]:
        if self.balance is None:
            raise ValueError("a split layout needs its balance before its memory is estimated")
        stages, placement = stage_ranges(self.balance), self.placement
        micro_batch = self.batch_size / self.micro_batches
        per_process = []
        for process in range(placement.processes):
            total = 0.0
            for stage in placement.stages_of(process):
                in_flight = self.micro_batches
                if self.schedule not in _ALL_AT_ONCE:
                    in_flight = min(in_flight, placement.num_stages - stage)
                total += state(memory, stages[stage], optimizer_states)
                total += activations(memory, stages[stage], micro_batch, self.recompute, in_flight)
            per_process.append([int(total)])
        return per_process * self.replicas

    def step_seconds(self, forward, backward, update, links, memory, profile) -> float:
        assert self.balance is not None, "a split layout is balanced before its forecast"
        placement, stages = self.placement, stage_ranges(self.balance)
        sends = boundary_bytes(memory, self.balance, self.batch_size / self.micro_batches)
        split = profile.split_backward(self.processes) if splits_backward(placement, self.micro_batches) else 1.0

        def simulated(scale: float) -> list[float]:
            return simulate_step(
                placement,
                self.micro_batches,
                [scale * sum(forward[i] for i in blocks) for blocks in stages],
                [scale * sum(backward[i] for i in blocks) for blocks in stages],
                lambda stage: links.send(sends[stage]),
                links.pipeline_action,
                split,
            )

        finish = simulated(1.0)
        # The passes came slowed as if every process computed all the time; between the bubbles fewer do. Slow
        # them as much as the processes' average concurrency over the simulated step does instead.
        computing = self.replicas * self.micro_batches * (sum(forward) + sum(backward))  # every copy's processes
        everyone = links.slowdown(self.processes)
        if everyone > 1.0:
            finish = simulated(links.slowdown(computing / max(finish)) / everyone)
        # Every process gets the last stage's output once the last action of the step is done, and only then
        # all-reduces its gradients and updates its blocks; the step ends with the slowest of them.
        after = []
        for process in range(len(finish)):
            kept = [i for stage in placement.stages_of(process) for i in stages[stage]]
            reduce = links.all_reduce(sum(memory.params[i] for i in kept), self.replicas)
            after.append(reduce + sum(update[i] for i in kept))
        return max(finish) + max(after)
