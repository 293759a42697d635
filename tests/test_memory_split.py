"""Model and pipeline parallel split the memory: each block is built only where it is trained.

A network built by a factory (``LazyBlocks``) trains under ``pipeline`` and
``manual_model_parallel`` like one device, while a callback records at every hook which
blocks each process holds, and the factory records which blocks each process built.
"""

import json

import pytest
import torch
from strategy_training import HeldBlocks

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too

EVERY_HOOK = set(HeldBlocks.HOOKS)


def _records(train_setup, setup: str, ranks: int) -> list[list[dict]]:
    train_setup(setup)
    return [json.loads((train_setup.folder / f"{setup}.pt.rank{rank}.json").read_text()) for rank in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["factory_pipe", "factory_mmp"])
def test_a_factory_network_trains_like_one_device(setup, train_setup):
    reference, split = train_setup("factory_single"), train_setup(setup)
    assert split.keys() == reference.keys()
    torch.testing.assert_close(split, reference, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_no_pipeline_process_ever_builds_or_holds_another_stage(train_setup):
    stages = [range(0, 4), range(4, 8)]  # balance by parameters: 4 equal blocks each, save the narrower ends
    timed = list(range(8))  # rank 0 times every block for the split table, each on a copy of its own, one at a time
    for rank, records in enumerate(_records(train_setup, "factory_pipe", ranks=2)):
        assert {record["hook"] for record in records} == EVERY_HOOK
        assert records[0]["held"] == [] and records[0]["built"] == []  # setup: nothing built before configure_model
        for record in records[1:]:
            assert record["held"] == list(stages[rank]), record  # never a block of the other stage
            # Each of its own blocks built once, no other (save rank 0's timing copies).
            assert record["built"] == (timed if rank == 0 else []) + list(stages[rank]), record
            assert all((device == "meta") != (index in stages[rank]) for index, device in enumerate(record["devices"]))


@pytest.mark.slow
def test_model_parallel_builds_each_block_once_where_it_goes(train_setup):
    (records,) = _records(train_setup, "factory_mmp", ranks=1)
    assert {record["hook"] for record in records} == EVERY_HOOK
    for record in records[1:]:
        # Built once each, straight into place: never the whole network first, then moved.
        # (the first 8: the timing copies, one at a time).
        assert record["built"] == list(range(8)) * 2 and record["held"] == list(range(8)), record


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "reference"),
    [
        ("bottleneck_accumulated_recomputed", "bottleneck_accumulated"),
        ("bottleneck_dp_recomputed", "bottleneck_accumulated"),
        ("bottleneck_mmp_recomputed", "bottleneck_mmp"),  # (one process of 2 threads: its own sums)
        ("bottleneck_pipe_1f1b_recomputed", "bottleneck_accumulated"),
        ("bottleneck_ddp_recomputed", "bottleneck_ddp"),
        ("bottleneck_pipe_deferred_recomputed", "bottleneck_pipe_deferred"),
    ],
)
def test_recompute_activations_changes_no_bit(setup, reference, train_setup):
    """Parameters, BatchNorm statistics and counters after 4 steps, bit for bit (one thread per process)."""
    recomputed, plain = train_setup(setup), train_setup(reference)
    assert recomputed.keys() == plain.keys()
    for name, tensor in recomputed.items():
        assert torch.equal(tensor, plain[name]), name
