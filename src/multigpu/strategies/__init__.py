"""Our strategies, registered by name so that ``--trainer.strategy=<name>`` finds them.

    dp                      torch.nn.DataParallel over the devices of one process
    fsdp                    parameters, gradients and optimizer state sharded over the processes (FSDP2),
                            on the CPU as on CUDA; in place of Lightning's CUDA-only fsdp
    manual_model_parallel   consecutive blocks of the network on consecutive devices,
                            optionally replicated with DDP (devices_per_replica)
    pipeline                one process per stage, micro-batches on torch.distributed.pipelining,
                            optionally replicated (num_stages)

On the command line a name may be followed by the strategy's options, as a class would be::

    --trainer.strategy=manual_model_parallel --trainer.strategy.balance=[9,9]

In YAML the options go under ``init_args`` of ``class_path: multigpu.strategies.ManualModelParallelStrategy``.

Each strategy of ours states what the rest of the project reads from it (``multigpu.contracts.Parallelism``), and
tells ``plan`` its layouts, memory and step time (``layouts``, where a new strategy registers its ``Layout`` class).
"""

import inspect
from collections.abc import Sequence

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from multigpu.errors import UsageError
from multigpu.strategies.data_parallel import DataParallelStrategy
from multigpu.strategies.ddp_options import ddp_options
from multigpu.strategies.fully_sharded import FullyShardedStrategy
from multigpu.strategies.manual_model_parallel import ManualModelParallelStrategy
from multigpu.strategies.pipeline import PipelineStrategy

__all__ = [
    "DataParallelStrategy",
    "FullyShardedStrategy",
    "ManualModelParallelStrategy",
    "PipelineStrategy",
    "name_to_class_path",
]

_OUR_STRATEGY_CLASSES = (DataParallelStrategy, FullyShardedStrategy, ManualModelParallelStrategy, PipelineStrategy)
CLASS_PATHS = {strategy.strategy_name: f"{__name__}.{strategy.__name__}" for strategy in _OUR_STRATEGY_CLASSES}

for _strategy in _OUR_STRATEGY_CLASSES:  # ``fsdp`` takes the name from Lightning's CUDA-only FSDP1 strategy
    StrategyRegistry.register(
        _strategy.strategy_name, _strategy, description=(_strategy.__doc__ or "").splitlines()[0], override=True
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


def _check_options(name: str, args: Sequence[str]) -> None:
    """Refuse a ``--trainer.strategy.<option>`` that strategy ``name`` does not take, in one line that names
    the strategy whose option it is, if any, and the options ``name`` takes."""
    strategy = next(strategy for strategy in _OUR_STRATEGY_CLASSES if strategy.strategy_name == name)
    takes = list(inspect.signature(strategy).parameters)
    for arg in args:
        if not arg.startswith("--trainer.strategy."):
            continue
        option = arg[len("--trainer.strategy.") :].partition("=")[0]
        if option not in takes:
            owners = [
                other.strategy_name for other in _OUR_STRATEGY_CLASSES if option in inspect.signature(other).parameters
            ]
            of = f" (an option of {', '.join(owners)})" if owners else ""
            raise UsageError(
                f"--trainer.strategy.{option}: {name} has no option {option}{of}; its options are {', '.join(takes)}."
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
        if name in CLASS_PATHS:
            _check_options(name, args[index + 1 :])
            args[at] = prefix + CLASS_PATHS[name]
    return args
