"""``fsdp``: parameters, gradients and optimizer state sharded over the processes (FSDP2), on the CPU as on CUDA.

strategy    the Lightning strategy
full_state  the whole state gathered for a checkpoint, and scattered again from one
layouts     what it tells ``plan``
"""

from multigpu.strategies.fully_sharded.layouts import FullyShardedLayout
from multigpu.strategies.fully_sharded.strategy import FullyShardedStrategy
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "FullyShardedLayout", "FullyShardedStrategy"]

SPECS = (
    StrategySpec(
        FullyShardedStrategy.strategy_name,
        "one process per device, each holding 1/N of the parameters, gradients and optimizer state (PyTorch's FSDP2 on "
        "each block), on GPUs or CPUs; replicas of shards (HSDP) with `shard_size`",
        "[strategies](docs/strategies.md#fsdp-sharded-data-parallel)",
        layout=FullyShardedLayout,
        strategy=FullyShardedStrategy,
        as_instance=True,  # Lightning reads the name as its CUDA-only FSDP1
    ),
)
