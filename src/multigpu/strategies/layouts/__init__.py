"""What each strategy tells ``plan``: its layouts on N devices, their ``fit`` options, memory and step time.

    layout          the ``Layout`` base class (a whole network in every process), ``BlockMemory``, ``LinkCosts``
                    and the arithmetic the strategies share
    one_device      the reference: Lightning's one device
    ddp             Lightning's ddp
    data_parallel   dp
    fully_sharded   fsdp
    model_parallel  manual_model_parallel
    pipeline        pipeline (its step simulated by ``strategies.pipeline.simulation``)

``LAYOUTS`` registers them, in the order ``plan`` lists them: a new strategy adds its subclass here.
"""

from multigpu.strategies.layouts.data_parallel import DataParallelLayout
from multigpu.strategies.layouts.ddp import DDPLayout
from multigpu.strategies.layouts.fully_sharded import FullyShardedLayout
from multigpu.strategies.layouts.layout import BlockMemory, Layout, LayoutRequest, Refusal
from multigpu.strategies.layouts.model_parallel import ModelParallelLayout
from multigpu.strategies.layouts.one_device import OneDeviceLayout
from multigpu.strategies.layouts.pipeline import PipelineLayout

__all__ = [
    "LAYOUTS",
    "PLANNED_STRATEGIES",
    "BlockMemory",
    "DDPLayout",
    "DataParallelLayout",
    "FullyShardedLayout",
    "Layout",
    "LayoutRequest",
    "ModelParallelLayout",
    "OneDeviceLayout",
    "PipelineLayout",
    "Refusal",
]

LAYOUTS: dict[str, type[Layout]] = {
    layout.strategy: layout
    for layout in (
        OneDeviceLayout,
        DDPLayout,
        DataParallelLayout,
        FullyShardedLayout,
        ModelParallelLayout,
        PipelineLayout,
    )
}

PLANNED_STRATEGIES = tuple(name for name, layout in LAYOUTS.items() if not layout.reference)
"""The strategies ``plan`` tries besides the reference, in the order it lists them."""
