import pytest
import torch
from torch import nn

from multigpu.errors import UsageError
from multigpu.model.resnet import resnet50_blocks
from multigpu.strategies.block_timing import block_pass_times_together, block_times, sgd_options
from multigpu.strategies.partition import (
    balance_by_cost,
    check_balance,
    choose_balance,
    param_counts,
    split_table,
)


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


def test_resnet50_split_by_parameters_shares_them_nearly_evenly():
    """The bottlenecks' halves let a split fall inside layer4.0, whose parameters alone are a quarter of them."""
    counts = param_counts(resnet50_blocks())
    for stages, heaviest in ((2, 0.52), (4, 0.28)):
        balance = balance_by_cost(counts, stages)
        assert sum(balance) == 34
        starts = [sum(balance[:stage]) for stage in range(stages)]
        shares = [sum(counts[start : start + count]) / sum(counts) for start, count in zip(starts, balance)]
        assert max(shares) <= heaviest, shares


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(UsageError, match="3 stages need at least 3 blocks, but the network has 2"):
        balance_by_cost([1, 1], 3)


@pytest.mark.parametrize(
    ("balance", "message"), [([5, 5], "sums to 10, but the network has 34"), ([34, 0], "at least one block")]
)
def test_bad_balance_is_refused(balance, message):
    with pytest.raises(UsageError, match=message):
        check_balance(balance, 34)


def test_block_times_measure_every_block_on_a_copy():
    net = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), nn.Conv2d(8, 64, 3), nn.Flatten())
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    times = block_times(net, torch.randn(4, 3, 16, 16), torch.device("cpu"), {"momentum": 0.9})
    assert len(times) == 3 and all(seconds > 0 for seconds in times)
    assert times[1] > times[2]  # a convolution costs more than a flatten
    for name, tensor in net.state_dict().items():  # BatchNorm statistics untouched
        assert torch.equal(tensor, before[name]), name


def test_blocks_timed_together_at_several_sizes_each_pass_its_own_input_through():
    """``block_pass_times_together`` (plan's profile): each size's input through every block, each with its own
    thread count, the sizes in turn; a bigger input costs more, and the threads are as they were afterwards."""
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1), nn.Flatten())
    threads = torch.get_num_threads()
    small, large = block_pass_times_together(
        net, [torch.randn(1, 3, 32, 32), torch.randn(32, 3, 32, 32)], [1, None], torch.device("cpu"), {}, repeats=2
    )
    assert len(small) == len(large) == 3 and torch.get_num_threads() == threads
    assert sum(map(sum, large[:2])) > sum(map(sum, small[:2]))  # 32 images cost more than 1


def test_the_blocks_update_with_the_recipes_sgd_whose_options_cost_passes_over_the_parameters(monkeypatch):
    """The update timed is the recipe's (momentum, Nesterov's, weight decay: a pass over the parameters each), not
    plain momentum's; a module without those hyperparameters is taken to use plain SGD; Nesterov's needs momentum."""
    recipe = {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4, "base_lr": 0.1}
    assert sgd_options(recipe) == {"momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}
    assert sgd_options({}) == {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0}
    assert sgd_options({"momentum": 0.0, "nesterov": True})["nesterov"] is False
    built = []

    class RecordedSGD(torch.optim.SGD):
        def __init__(self, params, **options) -> None:
            built.append(options)
            super().__init__(params, **options)

    monkeypatch.setattr(torch.optim, "SGD", RecordedSGD)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    block_times(net, torch.randn(2, 3, 8, 8), torch.device("cpu"), sgd_options(recipe), repeats=1)
    assert built == [{"lr": 0.0, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4}]  # the flatten has none


def test_choose_balance_takes_the_given_balance_or_the_costs():
    net = nn.Sequential(nn.Linear(4, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 2))
    assert choose_balance(net, 2, [1, 3], "time", None) == [1, 3]
    assert choose_balance(net, 2, None, "params", None) == [2, 2]
    assert choose_balance(net, 2, None, "time", [9.0, 1.0, 1.0, 1.0]) == [1, 3]
    with pytest.raises(UsageError, match=r"balance \[4\] has 1 stages, but 2 are asked for"):
        choose_balance(net, 2, [4], "time", None)
    with pytest.raises(UsageError, match="5 stages need at least 5 blocks, but the network has 4"):
        choose_balance(net, 5, None, "params", None)
    with pytest.raises(UsageError, match="balance_by=time needs the LightningModule's example_input_array"):
        choose_balance(net, 2, None, "time", None)


def test_split_table_lists_stages_devices_blocks_params_and_time_shares():
    net = nn.Sequential(nn.Linear(10, 100), nn.Linear(100, 10), nn.Linear(10, 1))
    table = split_table(net, [1, 2], [torch.device("cpu"), torch.device("cpu")], [1.0, 2.0, 1.0])
    assert table.splitlines() == [
        "stage  device  blocks  params  time",
        "0      cpu     0-0     1,100   25.0%",
        "1      cpu     1-2     1,021   75.0%",
    ]
    assert split_table(net, [3], [torch.device("cpu")], None).splitlines()[1].endswith("-")
