"""Splitting a sequence of blocks into consecutive stages.

Shared by the strategies that place parts of one network on different devices
(manual model parallel, pipeline parallel). A *balance* is the number of
consecutive blocks in each stage: ``[12, 11, 11]`` splits 34 blocks into 3 stages.
"""

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from multigpu.errors import UsageError

__all__ = [
    "BalanceBy",
    "balance_by_cost",
    "check_balance",
    "check_stage_count",
    "choose_balance",
    "param_counts",
    "split_table",
    "stage_ranges",
]

BalanceBy = Literal["params", "time"]


def check_balance(balance: Sequence[int], num_blocks: int) -> list[int]:
    """Return ``balance`` as a list, or raise a ``UsageError`` that says why it cannot split ``num_blocks``."""
    balance = list(balance)
    if not balance or any(count < 1 for count in balance):
        raise UsageError(f"balance {balance} must give each stage at least one block.")
    if sum(balance) != num_blocks:
        raise UsageError(f"balance {balance} sums to {sum(balance)}, but the network has {num_blocks} blocks.")
    return balance


def stage_ranges(balance: Sequence[int]) -> list[range]:
    """The block indices of each stage of ``balance``: ``[2, 3]`` gives ``range(0, 2)`` and ``range(2, 5)``."""
    starts = [sum(balance[:stage]) for stage in range(len(balance))]
    return [range(start, start + count) for start, count in zip(starts, balance)]


def check_stage_count(num_stages: int, num_blocks: int) -> None:
    """Raise a ``UsageError`` unless ``num_blocks`` blocks can fill ``num_stages`` stages."""
    if num_stages < 1:
        raise UsageError(f"the number of stages must be at least 1, not {num_stages}.")
    if num_stages > num_blocks:
        raise UsageError(f"{num_stages} stages need at least {num_stages} blocks, but the network has {num_blocks}.")


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split blocks with the given costs into ``num_stages`` consecutive stages.

    Minimises the cost of the most expensive stage (the bottleneck of a pipeline),
    and among such splits keeps the earlier stages as light as possible.
    """
    check_stage_count(num_stages, len(costs))
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


def choose_balance(
    blocks: nn.Sequential,
    num_stages: int,
    balance: Sequence[int] | None,
    balance_by: BalanceBy,
    times: Sequence[float] | None,
) -> list[int]:
    """The balance to use: ``balance`` as given (checked), else one computed from parameters or times."""
    check_stage_count(num_stages, len(blocks))
    if balance is not None:
        if len(balance) != num_stages:
            raise UsageError(f"balance {list(balance)} has {len(balance)} stages, but {num_stages} are asked for.")
        return check_balance(balance, len(blocks))
    if balance_by == "params":
        return balance_by_cost(param_counts(blocks), num_stages)
    if times is None:
        raise UsageError("balance_by=time needs the LightningModule's example_input_array; give balance instead.")
    return balance_by_cost(times, num_stages)


def split_table(
    blocks: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device | str], times: Sequence[float] | None
) -> str:
    """The split as a table: stage, device, blocks, parameters, and share of the measured time."""
    counts = param_counts(blocks)
    total_time = sum(times) if times else 0.0
    rows = [("stage", "device", "blocks", "params", "time")]
    for stage, (blocks_of_stage, device) in enumerate(zip(stage_ranges(balance), devices, strict=True)):
        start, end = blocks_of_stage.start, blocks_of_stage.stop
        share = f"{sum(times[start:end]) / total_time:.1%}" if times and total_time else "-"
        rows.append((str(stage), str(device), f"{start}-{end - 1}", f"{sum(counts[start:end]):,}", share))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
