"""A pipeline's schedule and which of its stages each process holds.

``S`` processes form one pipeline, each holding ``V`` stages (``stages_per_process``), so the
network is split into ``S x V`` stages. GPipe and 1F1B hold one stage per process.
PyTorch's multi-stage schedules place them *looped* (stage ``s`` on process ``s mod S``:
``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``) or *V-shaped* (process ``p``
holds stages ``p`` and ``2S - 1 - p``: ``ZBVZeroBubble``, ``DualPipeV``, which need ``V = 2``).
``StagePlacement.check`` says, in one line, what a schedule cannot take, before anything is launched.
"""

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

from multigpu.errors import UsageError
from multigpu.strategies.partition import stage_ranges

__all__ = [
    "SCHEDULES",
    "StagePlacement",
    "check_options",
    "natural_stages_per_process",
    "processes_per_pipeline",
    "schedule_class",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")
"""The schedule names ``pipeline`` accepts, case-insensitive: every schedule of ``get_schedule_class``."""

_V_SHAPED = ("zbvzerobubble", "dualpipev")
_ROUNDS = ("interleaved1f1b", "interleavedzerobubble")  # micro-batches in whole rounds of the processes
_ENOUGH_MICRO_BATCHES = ("1f1b", "dualpipev")  # at least as many micro-batches as stages


def schedule_class(name: str) -> type[PipelineScheduleSingle | PipelineScheduleMulti]:
    """PyTorch's schedule class for ``name``; a ``UsageError`` lists the names otherwise."""
    if name.lower() not in SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)} (any case), not {name!r}.")
    return get_schedule_class(name)


def natural_stages_per_process(schedule: str) -> int:
    """The stages each process holds under ``schedule`` when nothing else asks: 1 for GPipe and 1F1B, 2 for the
    multi-stage schedules (the V-shaped ones need exactly 2)."""
    return 1 if issubclass(schedule_class(schedule), PipelineScheduleSingle) else 2


def check_options(num_stages: int | None, micro_batches: int, schedule: str, stages_per_process: int) -> None:
    """Refuse a pipeline option that no placement can take: a count below 1, a schedule torch does not know."""
    if micro_batches < 1:
        raise UsageError(f"micro_batches must be at least 1, not {micro_batches}.")
    if num_stages is not None and num_stages < 1:
        raise UsageError(f"num_stages must be at least 1, not {num_stages}.")
    schedule_class(schedule)  # a known name
    if stages_per_process < 1:
        raise UsageError(f"stages_per_process must be at least 1, not {stages_per_process}.")


def processes_per_pipeline(processes: int, stages: int, stages_per_process: int) -> int:
    """The processes of one copy of a pipeline of ``stages`` stages, ``stages_per_process`` each, of which
    ``processes`` must be a multiple: the rule at launch and in ``plan``; a ``UsageError`` says what does not
    divide."""
    if stages % stages_per_process:
        raise UsageError(
            f"the pipeline has {stages} stages, which stages_per_process={stages_per_process} does not divide: "
            f"use a multiple of {stages_per_process} stages."
        )
    per_pipeline = stages // stages_per_process
    if processes % per_pipeline:
        raise UsageError(
            f"the pipeline has {stages} stages over {per_pipeline} processes, but devices x nodes = {processes} "
            f"processes is not a multiple of {per_pipeline}: use a multiple of {per_pipeline} devices, or change "
            "num_stages."
        )
    return per_pipeline


@dataclass(frozen=True)
class StagePlacement:
    """``processes`` processes per pipeline, ``stages_per_process`` stages each, under ``schedule``."""

    schedule: str
    processes: int
    stages_per_process: int

    @classmethod
    def of(cls, schedule: str, processes: int, stages: int | None, stages_per_process: int) -> "StagePlacement":
        """The placement of ``stages`` stages (default ``processes x stages_per_process``) over ``processes`` processes,
        as replicas of one pipeline; a ``UsageError`` says what does not divide."""
        stages = stages or processes * stages_per_process
        return cls(schedule, processes_per_pipeline(processes, stages, stages_per_process), stages_per_process)

    def __str__(self) -> str:
        per_process = f" ({self.stages_per_process} per process)" if self.stages_per_process > 1 else ""
        return f"{self.num_stages} stages{per_process} over {self.processes} processes, schedule {self.schedule}"

    @property
    def num_stages(self) -> int:
        return self.processes * self.stages_per_process

    @property
    def is_single(self) -> bool:
        """One stage per process, for a ``PipelineScheduleSingle`` (GPipe, 1F1B)."""
        return issubclass(schedule_class(self.schedule), PipelineScheduleSingle)

    @property
    def is_v_shaped(self) -> bool:
        return self.schedule.lower() in _V_SHAPED

    def process_of(self, stage: int) -> int:
        """Index, within its pipeline, of the process that holds ``stage``."""
        if self.is_v_shaped and (stage // self.processes) % 2:
            return self.processes - 1 - stage % self.processes
        return stage % self.processes

    def stages_of(self, process: int) -> list[int]:
        """The stages that process ``process`` of a pipeline holds, in order."""
        return [stage for stage in range(self.num_stages) if self.process_of(stage) == process]

    def stage_blocks(self, balance: list[int], process: int) -> list[range]:
        """The blocks of each stage that ``process`` holds, for ``balance`` (blocks per stage)."""
        ranges = stage_ranges(balance)
        return [ranges[stage] for stage in self.stages_of(process)]

    def check(self, micro_batches: int) -> None:
        """Raise a ``UsageError`` that names what to change if the schedule cannot run this placement."""
        name, stages, processes = self.schedule.lower(), self.num_stages, self.processes
        if self.is_single and self.stages_per_process != 1:
            raise UsageError(
                f"schedule {self.schedule} runs one stage per process, not "
                f"stages_per_process={self.stages_per_process}: use Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                "ZBVZeroBubble or DualPipeV, or drop stages_per_process."
            )
        if self.is_v_shaped and self.stages_per_process != 2:
            raise UsageError(
                f"schedule {self.schedule} places 2 stages on each process in a V: set stages_per_process=2, "
                f"not {self.stages_per_process}."
            )
        if name in _ENOUGH_MICRO_BATCHES and micro_batches < stages:
            raise UsageError(
                f"schedule {self.schedule} needs at least as many micro-batches as stages: "
                f"micro_batches={micro_batches} < {stages} stages. Raise micro_batches"
                + (" or use schedule gpipe." if self.is_single else ".")
            )
        rounds = max(1, micro_batches // processes)
        if name in _ROUNDS and micro_batches % rounds:
            raise UsageError(
                f"schedule {self.schedule} runs micro-batches in rounds of the {processes} processes: micro_batches="
                f"{micro_batches} is not a multiple of its {rounds} rounds. Use a multiple of {processes} "
                "micro-batches."
            )
