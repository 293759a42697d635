"""Every way to train on a given number of devices, and why each of the others cannot run.

A *layout* is a strategy with its options and whether the blocks recompute their activations:
one device (the reference), ``ddp``, ``dp``, ``fsdp``, ``manual_model_parallel`` with 2 or 4
devices per replica, and ``pipeline`` over 2 or 4 processes under each schedule and several
micro-batch counts. ``candidate_layouts`` lists those that can run here and, for each one that
cannot, one line that says why, using the strategies' own checks.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from multigpu.errors import UsageError
from multigpu.strategies import CLASS_PATHS
from multigpu.strategies.pipeline.stage_placement import SCHEDULES, StagePlacement, natural_stages_per_process

__all__ = ["PLANNED_STRATEGIES", "Layout", "Refusal", "candidate_layouts"]

PLANNED_STRATEGIES = ("ddp", "dp", "fsdp", "manual_model_parallel", "pipeline")
"""The strategies ``plan`` tries besides one device, in the order it lists them."""

DEVICES_PER_REPLICA = (2, 4)  # manual_model_parallel
PIPELINE_PROCESSES = (2, 4)


@dataclass(frozen=True)
class Layout:
    """One way to train: ``strategy`` with its ``options`` on ``devices`` devices in ``processes`` processes,
    ``batch_size`` images per replica (``--data.batch_size``); ``balance`` (blocks per stage of a split
    network) is set once the blocks are timed.
    """

    name: str
    strategy: str  # "auto" (one device), or a registered strategy name
    devices: int
    processes: int
    batch_size: int
    recompute: bool = False
    options: dict = field(default_factory=dict)  # the strategy's own, besides balance
    balance: tuple[int, ...] | None = None
    schedule: str | None = None  # pipeline only
    micro_batches: int = 1

    @property
    def label(self) -> str:
        return self.name + (" +recompute" if self.recompute else "")

    @property
    def num_stages(self) -> int:
        """Stages of one copy of the network (1 unless it is split)."""
        if self.strategy == "manual_model_parallel":
            return self.options["devices_per_replica"]
        if self.strategy == "pipeline":
            return self.options["num_stages"]
        return 1

    @property
    def replicas(self) -> int:
        """Copies of the network that see different samples."""
        if self.strategy == "pipeline":
            return self.processes // self.pipeline.processes
        return 1 if self.strategy in ("auto", "dp") else self.processes

    @property
    def pipeline(self) -> StagePlacement:
        return StagePlacement(
            self.schedule,
            self.options["num_stages"] // self.options["stages_per_process"],
            self.options["stages_per_process"],
        )

    @property
    def init_args(self) -> dict:
        """The strategy's options, its balance included."""
        return {**self.options, **({"balance": list(self.balance)} if self.balance else {})}

    def strategy_config(self) -> str | dict:
        """``trainer.strategy`` as a config file holds it."""
        if not self.init_args:
            return self.strategy
        return {"class_path": CLASS_PATHS[self.strategy], "init_args": self.init_args}

    def device_request(self, device_ids: Sequence[int] | None) -> int | list[int]:
        """``trainer.devices`` for this layout: a count, or the first of the GPU indices the user listed."""
        return list(device_ids[: self.devices]) if device_ids else self.devices

    def config(self, device_ids: Sequence[int] | None = None) -> dict:
        """The part of a config file that selects this layout."""
        return {
            "trainer": {"strategy": self.strategy_config(), "devices": self.device_request(device_ids)},
            "model": {"recompute_activations": self.recompute},
            "data": {"batch_size": self.batch_size},
        }

    def fit_options(self, device_ids: Sequence[int] | None = None) -> list[str]:
        """The ``python main.py fit`` options that select this layout."""
        options = [f"--trainer.strategy={self.strategy}", f"--trainer.devices={_text(self.device_request(device_ids))}"]
        options += [f"--trainer.strategy.{key}={_text(value)}" for key, value in self.init_args.items()]
        return options + [
            f"--model.recompute_activations={_text(self.recompute)}",
            f"--data.batch_size={self.batch_size}",
        ]


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


@dataclass(frozen=True)
class Refusal:
    """Layouts left out (``what``), and why."""

    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.what}: {self.why}"


def candidate_layouts(
    devices: int,
    cuda: bool,
    batch_size: int,
    compiled: bool,
    strategies: Sequence[str] = PLANNED_STRATEGIES,
    schedules: Sequence[str] = SCHEDULES,
    micro_batches: Sequence[int] | None = None,
) -> tuple[list[Layout], list[Refusal]]:
    """The layouts without activation recomputation that can train on ``devices`` devices (one device first),
    and a ``Refusal`` for each one that cannot.

    Every layout but the one device trains the same global batch, ``batch_size`` per device as ``ddp`` does:
    ``dp`` takes ``batch_size x devices`` in its one process, a model-parallel replica or a pipeline of ``k``
    devices ``batch_size x k``. Only speed and memory differ between them, not the optimisation.

    Args:
        micro_batches: the counts a pipeline of ``P`` processes tries; default ``P``, ``2P`` and ``4P``.
    """
    layouts = [Layout("1 device", "auto", 1, 1, batch_size)]
    refusals: list[Refusal] = []

    def refuse(what: str, why: str) -> None:
        refusals.append(Refusal(what, why))

    several = f"needs 2 devices or more; --trainer.devices={devices}"
    for strategy in strategies:
        if strategy in ("ddp", "dp", "fsdp"):
            if strategy == "dp" and not cuda:
                refuse(strategy, "needs CUDA devices (without them dp trains on one device)")
            elif strategy == "fsdp" and compiled:
                refuse(strategy, "shards the blocks itself and cannot run --model.compile")
            elif devices < 2:
                refuse(strategy, several)
            elif strategy == "dp":
                layouts.append(Layout(strategy, strategy, devices, 1, batch_size * devices))
            else:
                layouts.append(Layout(strategy, strategy, devices, devices, batch_size))
        elif strategy == "manual_model_parallel":
            for per_replica in DEVICES_PER_REPLICA:
                what = f"manual_model_parallel over {per_replica} devices per replica"
                if compiled:
                    refuse(what, "places the blocks itself and cannot run --model.compile")
                elif devices % per_replica:
                    refuse(what, f"needs a multiple of {per_replica} devices, not --trainer.devices={devices}")
                else:
                    replicas = devices // per_replica
                    name = f"model parallel {per_replica}" + (f" x{replicas}" if replicas > 1 else "")
                    layouts.append(
                        Layout(
                            name,
                            strategy,
                            devices,
                            replicas,
                            batch_size * per_replica,
                            options={"devices_per_replica": per_replica},
                        )
                    )
        elif strategy == "pipeline":
            layouts += _pipelines(devices, batch_size, compiled, schedules, micro_batches, refuse)
        else:
            raise UsageError(f"plan.strategies: {strategy!r} is not one of {', '.join(PLANNED_STRATEGIES)}.")
    return layouts, refusals


def _pipelines(devices, batch_size, compiled, schedules, micro_batches, refuse) -> list[Layout]:
    layouts = []
    for processes in PIPELINE_PROCESSES:
        what = f"pipeline over {processes} processes"
        if compiled:
            refuse(what, "places the blocks itself and cannot run --model.compile")
            continue
        if devices % processes:
            refuse(what, f"needs a multiple of {processes} devices, not --trainer.devices={devices}")
            continue
        counts = micro_batches or (processes, 2 * processes, 4 * processes)
        batch = batch_size * processes
        for schedule in schedules:
            per_process = natural_stages_per_process(schedule)
            stages = processes * per_process
            for count in counts:
                layout = StagePlacement(schedule, processes, per_process)
                what = f"pipeline {stages} stages {schedule.lower()} m{count}"
                if batch % count:
                    refuse(
                        what,
                        f"its batch of {batch} images ({processes} x --data.batch_size) is not divisible by "
                        f"{count} micro-batches",
                    )
                    continue
                try:
                    layout.check(count)
                except UsageError as error:
                    refuse(what, str(error).rstrip("."))
                    continue
                options = {
                    "num_stages": stages,
                    "stages_per_process": per_process,
                    "schedule": schedule.lower(),
                    "micro_batches": count,
                }
                replicas = devices // processes
                name = (
                    f"pipeline {stages}"
                    + (f"/{processes}p" if per_process > 1 else "")
                    + (f" x{replicas}" if replicas > 1 else "")
                    + f" {schedule.lower()} m{count}"
                )
                layouts.append(
                    Layout(
                        name,
                        "pipeline",
                        devices,
                        devices,
                        batch,
                        options=options,
                        schedule=schedule.lower(),
                        micro_batches=count,
                    )
                )
    return layouts
