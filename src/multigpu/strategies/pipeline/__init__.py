"""``pipeline``: one process per stage, micro-batches through the stages on ``torch.distributed.pipelining``.

Processes are launched as Lightning launches DDP (so ``--trainer.devices``,
``--trainer.num_nodes``, torchrun and SLURM all work). Ranks ``r*S .. r*S+S-1``
form replica ``r`` of a pipeline of ``S`` processes; each holds ``V`` stages
(``stages_per_process``) of consecutive blocks of ``pl_module.net``, placed as the
schedule expects (``stage_placement``). With ``R`` replicas the processes that hold
the same stages average their gradients, as DDP does.

In each step the batch is cut into micro-batches that flow through the stages
under one of PyTorch's schedules; the last stage computes the loss with the
LightningModule's ``criterion`` and the backward passes run inside the schedule.
The last stage's logits are then broadcast to the other stages of the pipeline,
and every process runs the LightningModule's own ``training_step`` (or
``validation_step`` ...) on them, so loss, metrics and logging are those of DDP.

Each process materialises only its own stages (``split_network``): the other stages'
parameters, gradients and optimizer state are never allocated in it. Checkpoints
gather each stage from the process that trained it (``checkpoints``).

The package's modules, each one job:

    strategy         the Lightning strategy: launch, placement, steps, checkpoint hooks
    stage_placement  the schedules, and which process holds which stage (checked before launch)
    model_checks     what the pipeline asks of the LightningModule and its batch (checked before launch)
    runner           process groups, and a batch through the schedule
    forward          evaluation: a forward pass through the stages without the schedule
    gradients        clipping and 16-mixed's overflow over the stages, averaging between replicas
    checkpoints      the stages' parameters and optimizer state gathered for a checkpoint file
    simulation       one step simulated from the schedule's action lists, for ``plan``'s forecast
    layouts          what it tells ``plan``
"""

from multigpu.strategies.pipeline.layouts import PipelineLayout
from multigpu.strategies.pipeline.strategy import PipelineStrategy
from multigpu.strategies.spec import StrategySpec

__all__ = ["SPECS", "PipelineLayout", "PipelineStrategy"]

SPECS = (
    StrategySpec(
        PipelineStrategy.strategy_name,
        "one process per stage, micro-batches under any of PyTorch's 7 schedules, optionally replicated",
        "[strategies](docs/strategies.md#pipeline-parallel-pipeline)",
        layout=PipelineLayout,
        strategy=PipelineStrategy,
    ),
)
