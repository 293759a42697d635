import pytest
import torch
from torch import nn

from multigpu.errors import UsageError
from multigpu.network import resnet50_blocks
from multigpu.partition import balance_by_cost, check_balance, param_counts, split_blocks


@pytest.mark.parametrize(
    ("costs", "stages", "expected"),
    [
        ([1, 1, 1, 1], 2, [2, 2]),
        ([1, 1, 1, 1, 1, 1], 3, [2, 2, 2]),
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [1, 8]),  # one heavy block gets a stage of its own
        ([1, 1, 1, 1, 1, 1, 1, 1, 8], 2, [8, 1]),
        ([1, 2, 3, 4, 5, 6], 2, [4, 2]),  # 10 | 11 beats 15 | 6
        ([5, 1, 1, 1, 1, 5], 3, [1, 4, 1]),
        ([3, 3, 3], 3, [1, 1, 1]),
        ([2, 7], 1, [2]),
    ],
)
def test_balance_minimises_the_heaviest_stage(costs, stages, expected):
    assert balance_by_cost(costs, stages) == expected


def test_balance_of_resnet50_by_parameters_gives_the_head_blocks_less_company():
    counts = param_counts(resnet50_blocks())
    balance = balance_by_cost(counts, 2)
    assert sum(balance) == 18
    # layer4's three bottlenecks hold more than half of the parameters.
    assert balance[1] <= 4


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(UsageError, match="3 stages need at least 3 blocks, but the network has 2"):
        balance_by_cost([1, 1], 3)


@pytest.mark.parametrize(("balance", "message"), [([5, 5], "sums to 10, but the network has 18"), ([18, 0], "at least one block")])
def test_bad_balance_is_refused(balance, message):
    with pytest.raises(UsageError, match=message):
        check_balance(balance, 18)


def test_split_stages_chain_to_the_whole_network():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    stages = split_blocks(net, [2, 3])
    assert [len(stage) for stage in stages] == [2, 3]
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), net(x))
    assert stages[0][0] is net[0]
