"""What a strategy tells ``plan`` about itself: the ``Layout`` base class each strategy's layouts subclass, and what
they share.

A *layout* is a strategy with its options on a number of devices and processes, and whether the blocks recompute
their activations. Each strategy's subclass says which layouts it offers (``offered``, with a ``Refusal`` for each
one it cannot run here), their ``fit`` options, how much memory each device holds (``device_memory``) and how long
a step takes (``step_seconds``), from what ``plan`` measured: the blocks' times, the links' (``LinkCosts``) and the
blocks' memory (``BlockMemory``). ``plan`` asks the layout class of every strategy in ``multigpu.strategies.SPECS`` and
knows none of them by name.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from multigpu.errors import UsageError
from multigpu.strategies.partition import stage_ranges

__all__ = [
    "BlockMemory",
    "Layout",
    "LayoutRequest",
    "LinkCosts",
    "Refuse",
    "Refusal",
    "activations",
    "boundary_bytes",
    "overlapped_reduction",
    "refused",
    "several_devices",
]

MIB = 2**20
DDP_FIRST_BUCKET, DDP_BUCKET = 1 * MIB, 25 * MIB  # DistributedDataParallel's defaults


@dataclass(frozen=True)
class BlockMemory:
    """Per block: bytes of parameters, bytes per image of what it saves for backward and of its input, and its
    number of parameter tensors."""

    params: list[int]
    activations: list[float]
    inputs: list[float]
    tensors: list[int]


class LinkCosts(Protocol):
    """Seconds of what moves between devices and processes, and how much processes at once slow each other, as
    ``plan`` measured them (``multigpu.planning.links.Links``)."""

    # Read-only (``plan``'s links are a frozen dataclass):
    @property
    def cuda(self) -> bool: ...
    @property
    def pipeline_action(self) -> float: ...  # a pipeline schedule's own time per action
    @property
    def sharded_block(self) -> float: ...  # fully_shard's own cost per block and pass
    @property
    def sharded_byte(self) -> float: ...  # ... per byte of the block's parameters
    @property
    def sharded_update(self) -> float: ...  # ... per parameter tensor, in the update

    @property
    def overlap(self) -> bool:
        """Whether transfers run beside the computation (CUDA), not holding it up (the CPU)."""

    def send(self, nbytes: float) -> float: ...

    def all_reduce(self, nbytes: float, group: int) -> float: ...

    def all_gather(self, nbytes: float, group: int, latency: bool = True) -> float: ...

    def reduce_scatter(self, nbytes: float, group: int, latency: bool = True) -> float: ...

    def slowdown(self, processes: float, in_lockstep: bool = False) -> float: ...


@dataclass(frozen=True)
class LayoutRequest:
    """What ``plan`` asks the strategies for: layouts on ``devices`` devices (CUDA or not), ``batch_size`` images per
    device as ``ddp`` reads ``--data.batch_size``, whether the network is compiled, and the pipeline's schedules and
    micro-batch counts to try (``None``: ``P``, ``2P`` and ``4P`` for ``P`` processes)."""

    devices: int
    cuda: bool
    batch_size: int
    compiled: bool
    schedules: Sequence[str]
    micro_batches: Sequence[int] | None = None


@dataclass(frozen=True)
class Refusal:
    """Layouts left out (``what``), and why."""

    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.what}: {self.why}"


Refuse = Callable[[str, str], None]  # refuse(what, why)


@dataclass(frozen=True)
class Layout:
    """One way to train: the strategy of the subclass with its options (its subclass's own fields, given by
    ``strategy_options``) on ``devices`` devices in ``processes`` processes, ``batch_size`` images per replica
    (``--data.batch_size``), ``micro_batches`` inputs per batch; ``balance`` (blocks per stage of a split network)
    is set once the blocks are timed.

    The bodies here are a whole network in every process, each a replica: what a strategy says otherwise, its
    subclass overrides.
    """

    strategy: ClassVar[str]  # --trainer.strategy, set by the strategy's ``StrategySpec``
    class_path: ClassVar[str | None] = None  # its class in a config file (ours), set by the same
    reference: ClassVar[bool] = False  # the layout every other one is compared with (one device)

    name: str
    devices: int
    processes: int
    batch_size: int
    recompute: bool = False
    balance: tuple[int, ...] | None = None
    micro_batches: int = 1

    @classmethod
    def offered(cls, request: LayoutRequest, refuse: Refuse) -> list["Layout"]:
        """The layouts of this strategy that can train as ``request`` asks, without activation recomputation;
        ``refuse(what, why)`` for each one that cannot."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        return self.name + (" +recompute" if self.recompute else "")

    @property
    def num_stages(self) -> int:
        """Stages of one copy of the network (1 unless it is split)."""
        return 1

    @property
    def replicas(self) -> int:
        """Copies of the network that see different samples."""
        return self.processes

    @property
    def timed_input(self) -> tuple[int, int]:
        """The images of one input of a device (a micro-batch, dp's slice of the batch), and the processes: what
        the blocks are timed at."""
        return self.batch_size // self.micro_batches, self.processes

    @property
    def in_lockstep(self) -> bool:
        """Whether every process computes the same passes as the others and waits for them throughout the step:
        then the slowest sets the pace."""
        return self.processes > 1

    def device_memory(self, memory: BlockMemory, optimizer_states: int) -> list[list[int]]:
        """Bytes each device of each process holds at its peak, process by process, with ``optimizer_states``
        tensors of optimizer state per parameter: here the whole network's state and the whole batch's
        activations."""
        every = range(len(memory.params))
        device = state(memory, every, optimizer_states) + activations(memory, every, self.batch_size, self.recompute)
        return [[int(device)] for _ in range(self.processes)]

    def step_seconds(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        update: Sequence[float],
        links: LinkCosts,
        memory: BlockMemory,
        profile,
    ) -> float:
        """Seconds of one step, from each block's forward, backward (recomputation included) and update time at
        ``timed_input``, slowed as the processes slow each other; ``profile`` (``BlockProfile``) for what else
        a strategy measured of the network."""
        raise NotImplementedError

    def strategy_options(self) -> dict[str, object]:
        """The strategy's options that select this layout, besides its balance, by their names."""
        return {}

    @property
    def init_args(self) -> dict[str, object]:
        """The strategy's options, its balance included."""
        return {**self.strategy_options(), **({"balance": list(self.balance)} if self.balance else {})}

    def strategy_config(self) -> str | dict:
        """``trainer.strategy`` as a config file holds it."""
        if not self.init_args:
            return self.strategy
        return {"class_path": self.class_path, "init_args": self.init_args}

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


def several_devices(strategy: str, request: LayoutRequest, refuse: Refuse) -> bool:
    """Whether ``request`` has the devices a strategy of one process per device needs; else refuse it."""
    if request.devices < 2:
        refuse(strategy, f"needs 2 devices or more; --trainer.devices={request.devices}")
        return False
    return True


def refused(refuse: Refuse, what: str, *checks: Callable[[], object]) -> bool:
    """Whether one of ``checks`` raises the ``UsageError`` the strategy itself raises before launch (its rules,
    stated once); if so, ``refuse(what, why)`` in the first error's words."""
    for check in checks:
        try:
            check()
        except UsageError as error:
            refuse(what, str(error).rstrip("."))
            return True
    return False


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def held(memory: BlockMemory, blocks: Sequence[int]) -> int:
    """Bytes of the parameters of ``blocks``."""
    return sum(memory.params[i] for i in blocks)


def state(memory: BlockMemory, blocks: Sequence[int], optimizer_states: int) -> int:
    """Bytes of the parameters of ``blocks``, their gradients and ``optimizer_states`` tensors of optimizer state."""
    return held(memory, blocks) * (2 + optimizer_states)


def activations(
    memory: BlockMemory, blocks: Sequence[int], images: float, recompute: bool, in_flight: int = 1
) -> float:
    """What ``blocks`` keep for ``in_flight`` batches of ``images``; with recomputation, the blocks' inputs for
    each, and the activations of one block of one batch, recomputed at a time."""
    if not blocks:
        return 0.0
    if recompute:
        return images * (in_flight * sum(memory.inputs[i] for i in blocks) + max(memory.activations[i] for i in blocks))
    return in_flight * images * sum(memory.activations[i] for i in blocks)


def boundary_bytes(memory: BlockMemory, balance: Sequence[int], images: float) -> list[float]:
    """Bytes each stage's output holds for ``images`` images (the input of the next stage's first block)."""
    stages = stage_ranges(balance)
    return [memory.inputs[stages[s + 1].start] * images if s + 1 < len(stages) else 0.0 for s in range(len(stages))]


def overlapped_reduction(
    backward: Sequence[float], params: Sequence[int], reduce: Callable[[float], float], overlap: bool
) -> float:
    """Seconds from the start of the backward pass until its last gradient bucket (DDP's: the first of 1 MiB, then
    25 MiB, filled from the last block back) is all-reduced: beside the backward pass when ``overlap``, else (the
    CPU) each bucket's all-reduce holding the computation up."""
    compute = link = 0.0
    bucket, cap = 0, DDP_FIRST_BUCKET
    for seconds, nbytes in zip(reversed(backward), reversed(params)):
        compute += seconds
        bucket += nbytes
        if bucket >= cap:
            link = max(link, compute) + reduce(bucket)
            compute = compute if overlap else link
            bucket, cap = 0, DDP_BUCKET
    if bucket:
        link = max(link, compute) + reduce(bucket)
    return max(compute, link)
