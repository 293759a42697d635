"""The private torch hooks ``multigpu.compat`` relies on, named, and the maths they keep on every supported torch."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from conftest import free_port
from multigpu.compat import STAGE_FINDS_SHAPES_BY_A_FORWARD_PASS, pipeline_stage

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


def test_the_pipeline_stage_hooks_compat_overrides_are_there_with_the_arguments_it_passes():
    if not STAGE_FINDS_SHAPES_BY_A_FORWARD_PASS:
        assert not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"), (
            "torch.distributed.pipelining.PipelineStage._get_init_p2p_neighbors_ops is back without _shape_inference: "
            "check whether compat's _StageOfTorch211 must filter its sends to this process again")
        return
    assert hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"), (
        "PipelineStage._get_init_p2p_neighbors_ops is gone while _shape_inference stays: compat's _StageOfTorch211 "
        "overrides both; see which of them this torch still needs")
    assert list(inspect.signature(PipelineStage._shape_inference).parameters) == ["self", "args", "kwargs"], (
        "PipelineStage._shape_inference(self, args, kwargs) changed: compat's _StageOfTorch211 calls it so")


def test_a_stage_trains_batch_norm_statistics_of_its_micro_batches_only():
    """One process, one stage, GPipe over 2 micro-batches: BatchNorm's running statistics are those of one device
    given the 2 micro-batches, on every torch (2.11's shape inference ran a third pass, on zeros)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    piped = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference.load_state_dict(piped.state_dict())
    x, y = torch.randn(8, 4) * 3 + 1, torch.randn(8, 6)
    stage = pipeline_stage(piped, 0, 1, torch.device("cpu"), dist.group.WORLD)
    ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss).step(x, target=y)
    for micro_batch in x.chunk(2):
        reference(micro_batch)
    for name, buffer in reference.state_dict().items():
        assert torch.equal(piped.state_dict()[name], buffer), name
    assert int(piped[1].num_batches_tracked) == 2
