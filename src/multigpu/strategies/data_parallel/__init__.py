"""``dp``: ``torch.nn.DataParallel`` over the devices of one process.

strategy  the Lightning strategy
layouts   what it tells ``plan``
"""

from multigpu.strategies.data_parallel.layouts import DataParallelLayout
from multigpu.strategies.data_parallel.strategy import DataParallelStrategy
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "DataParallelLayout", "DataParallelStrategy"]

SPECS = (
    StrategySpec(
        DataParallelStrategy.strategy_name,
        "one process, `torch.nn.DataParallel` over its GPUs",
        "[strategies](docs/strategies.md#dp-dataparallel)",
        layout=DataParallelLayout,
        strategy=DataParallelStrategy,
    ),
)
