"""``manual_model_parallel``: consecutive blocks of the network on consecutive devices of one process, optionally
replicated with DDP (``devices_per_replica``).

    strategy  the Lightning strategy, and its rule on the devices (used by ``plan`` too)
    layouts   what it tells ``plan``
"""

from multigpu.strategies.manual_model_parallel.layouts import ModelParallelLayout
from multigpu.strategies.manual_model_parallel.strategy import ManualModelParallelStrategy
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "ManualModelParallelStrategy", "ModelParallelLayout"]

SPECS = (
    StrategySpec(
        ManualModelParallelStrategy.strategy_name,
        "one process, consecutive blocks on consecutive devices, optionally replicated with DDP",
        "[strategies](docs/strategies.md#manual_model_parallel-the-network-split-over-devices)",
        layout=ModelParallelLayout,
        strategy=ManualModelParallelStrategy,
    ),
)
