"""Splitting a sequence of blocks into consecutive stages.

Shared by the strategies that place parts of one network on different devices
(manual model parallel, pipeline parallel). A *balance* is the number of
consecutive blocks in each stage: ``[6, 6, 6]`` splits 18 blocks into 3 stages.
"""

from collections.abc import Sequence

from torch import nn

from multigpu.errors import UsageError

__all__ = ["balance_by_cost", "check_balance", "param_counts", "split_blocks"]


def check_balance(balance: Sequence[int], num_blocks: int) -> list[int]:
    """Return ``balance`` as a list, or raise a ``UsageError`` that says why it cannot split ``num_blocks``."""
    balance = list(balance)
    if not balance or any(count < 1 for count in balance):
        raise UsageError(f"balance {balance} must give each stage at least one block.")
    if sum(balance) != num_blocks:
        raise UsageError(f"balance {balance} sums to {sum(balance)}, but the network has {num_blocks} blocks.")
    return balance


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split blocks with the given costs into ``num_stages`` consecutive stages.

    Minimises the cost of the most expensive stage (the bottleneck of a pipeline),
    and among such splits keeps the earlier stages as light as possible.
    """
    if num_stages > len(costs):
        raise UsageError(f"{num_stages} stages need at least {num_stages} blocks, but the network has {len(costs)}.")
    if num_stages < 1:
        raise UsageError(f"the number of stages must be at least 1, not {num_stages}.")
    # best[k][i]: the smallest bottleneck when the first i blocks form k stages.
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    n, inf = len(costs), float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):  # the k-th stage holds blocks j .. i-1
                bottleneck = max(best[k - 1][j], prefix[i] - prefix[j])
                if bottleneck < best[k][i]:
                    best[k][i], cut[k][i] = bottleneck, j
    balance, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        balance.append(end - start)
        end = start
    return balance[::-1]


def param_counts(blocks: nn.Sequential) -> list[int]:
    """Number of parameters of each block."""
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


def split_blocks(blocks: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``blocks`` into consecutive stages of ``balance[i]`` blocks; the modules are shared, not copied."""
    balance = check_balance(balance, len(blocks))
    stages, start = [], 0
    for count in balance:
        stages.append(blocks[start : start + count])
        start += count
    return stages
