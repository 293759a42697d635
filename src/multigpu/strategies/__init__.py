"""Every strategy the application runs, one package each, listed once in ``SPECS``.

    one_device              Lightning's one device (``auto``): the reference ``plan`` compares every layout with
    ddp                     Lightning's ddp and ddp_spawn, with our DDP options
    data_parallel           dp: torch.nn.DataParallel over the devices of one process
    fully_sharded           fsdp: parameters, gradients and optimizer state sharded over the processes (FSDP2),
                            on the CPU as on CUDA; in place of Lightning's CUDA-only fsdp
    manual_model_parallel   consecutive blocks of the network on consecutive devices, optionally replicated with
                            DDP (devices_per_replica)
    pipeline                one process per stage, micro-batches on torch.distributed.pipelining, optionally
                            replicated (num_stages)

A package holds its Lightning strategy (ours), what it tells ``plan`` (its ``Layout`` subclass: layouts, memory,
step time), its refusal rules, used at launch and by ``plan`` alike, and its ``SPECS`` (``spec.StrategySpec``). A new
strategy is one package and its name in ``PACKAGES``; from that list come Lightning's registry of our names, the CLI's
names and checks of ``--trainer.strategy.<option>``, ``plan``'s strategies, and the README's table (docs/code-map.md,
"Where to go to change… a strategy"). What the strategies share: ``layout`` (the ``Layout`` base class and its
arithmetic), ``split_network``, ``partition`` (the block balancer), ``block_timing``, ``network_lookup``,
``micro_batch_check``.

On the command line a name may be followed by the strategy's options, as a class would be::

    --trainer.strategy=manual_model_parallel --trainer.strategy.balance=[9,9]

In YAML the options go under ``init_args`` of ``class_path: multigpu.strategies.ManualModelParallelStrategy``.
"""

from collections.abc import Sequence
from importlib import import_module

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from multigpu.errors import UsageError
from multigpu.strategies.data_parallel import DataParallelStrategy
from multigpu.strategies.ddp import ddp_options
from multigpu.strategies.fully_sharded import FullyShardedStrategy
from multigpu.strategies.layout import Layout
from multigpu.strategies.manual_model_parallel import ManualModelParallelStrategy
from multigpu.strategies.pipeline import PipelineStrategy
from multigpu.strategies.spec import StrategySpec

__all__ = [
    "LAYOUTS",
    "PLANNED_STRATEGIES",
    "SPECS",
    "DataParallelStrategy",
    "FullyShardedStrategy",
    "ManualModelParallelStrategy",
    "PipelineStrategy",
    "name_to_class_path",
    "spec_named",
    "strategies_table",
]

PACKAGES = ("one_device", "ddp", "data_parallel", "fully_sharded", "manual_model_parallel", "pipeline")
"""Our strategies' packages, one name each: a new strategy's package adds its name here."""

SPECS: tuple[StrategySpec, ...] = tuple(spec for name in PACKAGES for spec in import_module(f"{__name__}.{name}").SPECS)
"""Every strategy users choose, in the order the README's table and ``plan`` list them."""

LAYOUTS: dict[str, type[Layout]] = {spec.name: spec.layout for spec in SPECS if spec.layout is not None}
"""What each strategy ``plan`` tries tells it, by name, the reference first."""

PLANNED_STRATEGIES = tuple(name for name, layout in LAYOUTS.items() if not layout.reference)
"""The strategies ``plan`` tries besides the reference, in the order it lists them."""

_OURS = [spec for spec in SPECS if spec.strategy is not None]

for _spec in _OURS:  # ``fsdp`` takes the name from Lightning's CUDA-only FSDP1 strategy
    StrategyRegistry.register(
        _spec.name, _spec.strategy, description=(_spec.strategy.__doc__ or "").splitlines()[0], override=True
    )

for _name, _entry in list(StrategyRegistry.items()):
    if _entry["strategy"] is DDPStrategy:
        StrategyRegistry.register(
            _name,
            DDPStrategy,
            description=_entry["description"],
            override=True,
            **{**_entry["init_params"], **ddp_options()},
        )


def spec_named(name: object) -> StrategySpec | None:
    """The spec of ``--trainer.strategy=name``, if it is one of ``SPECS``."""
    return next((spec for spec in SPECS if spec.name == name), None)


def strategies_table() -> str:
    """The README's table of strategies, made from ``SPECS``."""
    rows = [spec.table_row() for spec in SPECS]
    return "\n".join(["| `--trainer.strategy=` | what runs | details |", "| --- | --- | --- |", *rows])


def _check_options(spec: StrategySpec, args: Sequence[str]) -> None:
    """Refuse a ``--trainer.strategy.<option>`` that ``spec``'s strategy does not take, in one line that names
    the strategy whose option it is, if any, and the options it takes."""
    for arg in args:
        if not arg.startswith("--trainer.strategy."):
            continue
        option = arg[len("--trainer.strategy.") :].partition("=")[0]
        if option not in spec.options:
            owners = [other.name for other in _OURS if option in other.options]
            of = f" (an option of {', '.join(owners)})" if owners else ""
            raise UsageError(
                f"--trainer.strategy.{option}: {spec.name} has no option {option}{of}; its options are "
                f"{', '.join(spec.options)}."
            )


def name_to_class_path(args: Sequence[str]) -> list[str]:
    """Command-line arguments where ``--trainer.strategy=<one of our names>`` becomes its class path
    when ``--trainer.strategy.<option>`` arguments follow, each of which it must take.

    jsonargparse takes such options only after a class; without them, the name stays a name.
    """
    args = list(args)
    if not any(arg.startswith("--trainer.strategy.") for arg in args):
        return args
    for index, arg in enumerate(list(args)):
        if arg.startswith("--trainer.strategy="):
            at, prefix, name = index, "--trainer.strategy=", arg.partition("=")[2]
        elif arg == "--trainer.strategy" and index + 1 < len(args):
            at, prefix, name = index + 1, "", args[index + 1]
        else:
            continue
        spec = spec_named(name)
        if spec is not None and spec.class_path is not None:
            _check_options(spec, args[index + 1 :])
            args[at] = prefix + spec.class_path
    return args
