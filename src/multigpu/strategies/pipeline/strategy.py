"""``PipelineStrategy``: the Lightning strategy that runs a pipeline (the package's docstring tells how)."""

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from multigpu.compat import is_log_step, layer_sync
from multigpu.contracts import holds_network, trains_network
from multigpu.errors import UsageError
from multigpu.model.deferred_batch_norm import defer_batch_norm
from multigpu.strategies.block_timing import time_blocks
from multigpu.strategies.network_lookup import block_sequence
from multigpu.strategies.partition import BalanceBy, choose_balance, split_table
from multigpu.strategies.pipeline.checkpoints import gather_optimizer_state, gather_state_dict
from multigpu.strategies.pipeline.gradients import (
    average_between_replicas,
    micro_batch_loss,
    norm_over_stages,
    over_stages,
)
from multigpu.strategies.pipeline.model_checks import pipeline_blocks, refuse_untrainable_micro_batches
from multigpu.strategies.pipeline.runner import StageBlocks, StageRunner, create_groups, network_returns
from multigpu.strategies.pipeline.schedule_clock import ideal_idle_share
from multigpu.strategies.pipeline.stage_placement import StagePlacement, check_options
from multigpu.strategies.split_network import SplitNetworkStrategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(SplitNetworkStrategy):
    """Pipeline parallelism over processes, optionally replicated (data parallel between pipelines).

    Args:
        num_stages: stages per pipeline; default all processes (devices x nodes) times
            ``stages_per_process``. It must be a multiple of ``stages_per_process``, and the
            processes a multiple of the pipeline's; the quotient is the number of replicas.
        micro_batches: micro-batches each batch is cut into; the batch must be divisible by it.
        schedule: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (one forward, one
            backward; holds fewer activations), or any other of PyTorch's schedules, by the
            name ``get_schedule_class`` knows, case-insensitive: ``Interleaved1F1B``,
            ``LoopedBFS``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``.
        stages_per_process: stages each process holds (``V``); more than one needs a
            multi-stage schedule, and ``ZBVZeroBubble`` and ``DualPipeV`` need 2.
        balance: blocks per stage, e.g. ``[17, 17]``.
        balance_by: without ``balance``, split by parameter count or measured time (see
            ``manual_model_parallel``).
        deferred_batch_norm: BatchNorm's running statistics are those of each whole batch,
            updated once per step, instead of those of each micro-batch (``DeferredBatchNorm``);
            each micro-batch is still normalised by its own statistics.
        process_group_backend: default NCCL on CUDA, gloo on the CPU.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        num_stages: int | None = None,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        stages_per_process: int = 1,
        balance: list[int] | None = None,
        balance_by: BalanceBy = "time",
        deferred_batch_norm: bool = False,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend)
        check_options(num_stages, micro_batches, schedule, stages_per_process)
        self.num_stages_option = num_stages
        self.micro_batches = micro_batches
        self.schedule_name = schedule
        self.stages_per_process = stages_per_process
        self.balance = balance
        self.balance_by = balance_by
        self.deferred_batch_norm = deferred_batch_norm
        self._pipe_group: dist.ProcessGroup | None = None
        self.replica_group: dist.ProcessGroup | None = None  # the processes of these stages, one per replica
        self._stage_blocks: list[range] | None = None
        self._stage_module: nn.ModuleList | None = None  # this process's stages, each a StageBlocks
        self._runner: StageRunner | None = None
        self._example_input: Any = None

    # --- stage placement -------------------------------------------------------------------------------

    @property
    def placement(self) -> StagePlacement:
        """The schedule, the processes of one pipeline and the stages of each."""
        stages = self.num_stages_option or (len(self.balance) if self.balance else None)
        return StagePlacement.of(
            self.schedule_name, self.num_nodes * self.num_processes, stages, self.stages_per_process
        )

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    @override
    def data_parallel_size(self) -> int:
        """Replicas of the whole pipeline: the processes that see different samples."""
        return self.num_nodes * self.num_processes // self.placement.processes

    @property
    def pipe_index(self) -> int:
        """This process's place in its pipeline."""
        return self.global_rank % self.placement.processes

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.placement.processes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The stages of one pipeline read the same batches.
        return {"num_replicas": self.data_parallel_size, "rank": self.replica_index}

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        placement = self.placement  # checks the process count
        if self.balance is not None and len(self.balance) != placement.num_stages:
            raise UsageError(
                f"balance {self.balance} has {len(self.balance)} stages, but the pipeline has {placement.num_stages}."
            )
        placement.check(self.micro_batches)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._pipe_group, self.replica_group = create_groups(
            self.placement.processes, self.data_parallel_size, self.pipe_index, self.replica_index
        )

    @property
    def stage_blocks(self) -> list[range]:
        """The block indices of each of this process's stages."""
        assert self._stage_blocks is not None, "placed in place_blocks"
        return self._stage_blocks

    @property
    def _held_blocks(self) -> list[int]:
        """Indices of the blocks of this process's stages."""
        return [index for blocks in self.stage_blocks for index in blocks]

    def _rank_of(self, stage: int) -> int:
        """Global rank of the process that holds ``stage`` in this process's pipeline."""
        return self.replica_index * self.placement.processes + self.placement.process_of(stage)

    # --- the model ------------------------------------------------------------------------------

    @override
    def check_model(self, pl_module: LightningModule) -> nn.Sequential:
        """Refuse a LightningModule this pipeline cannot run, before any process is launched; return its blocks."""
        if layer_sync(self) is not None:
            raise UsageError(
                "--trainer.sync_batchnorm=true does not work under pipeline, whose stages hold different "
                "layers: drop it (deferred_batch_norm gives statistics of the whole batch)."
            )
        return pipeline_blocks(pl_module, self.micro_batches, self.num_stages, self.balance, self.balance_by)

    @override
    def check_training(self, pl_module: LightningModule) -> None:
        """Refuse, before launch, micro-batches too small to train (``refuse_untrainable_micro_batches``)."""
        refuse_untrainable_micro_batches(self.check_model(pl_module), pl_module, self.micro_batches)

    @override
    def place_blocks(self) -> list[torch.device | None]:
        pl_module = self.lightning_module
        assert pl_module is not None
        blocks = self.check_model(pl_module)
        if self._stage_blocks is None:
            # Rank 0 times the blocks, one at a time and for one training micro-batch, for all. Evaluation,
            # which trains nothing (and may take micro-batches too small to train), splits by parameters.
            fitting = pl_module.trainer.state.fn == TrainerFn.FITTING
            if fitting:  # as the CLI does before launch, for a Trainer built without it
                self.check_training(pl_module)
            times = (
                self.broadcast(time_blocks(self, blocks, self.micro_batches) if self.global_rank == 0 else None)
                if fitting
                else None
            )
            balance_by = self.balance_by if fitting else "params"
            placement = self.placement
            balance = choose_balance(blocks, placement.num_stages, self.balance, balance_by, times)
            self._stage_blocks = placement.stage_blocks(balance, self.pipe_index)
            devices = [f"rank {self._rank_of(stage)}" for stage in range(placement.num_stages)]
            rank_zero_info(
                f"pipeline: {placement}, {self.data_parallel_size} replica(s), {self.micro_batches} micro-batches, "
                f"balance {balance}"
                + ("" if self.balance else f" (by {balance_by})")
                + "\n"
                + split_table(blocks, balance, devices, times)
            )
        held = set(self._held_blocks)
        return [self.root_device if index in held else None for index in range(len(blocks))]

    @override
    def setup(self, trainer: Trainer) -> None:
        # DDPStrategy.setup without the DDP wrapper and without its broadcast of the whole module from rank 0.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()  # this process's blocks on its device, the others on the meta device
        pl_module = self.lightning_module
        assert trains_network(pl_module), "checked by place_blocks"
        blocks = block_sequence(pl_module, self.strategy_name)
        stage_module = nn.ModuleList(StageBlocks(*blocks[held.start : held.stop]) for held in self.stage_blocks)
        self._stage_module = stage_module
        if self.deferred_batch_norm:
            for module in stage_module:
                defer_batch_norm(module, self.micro_batches)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        # Lightning clips (and 16-mixed skips an overflow) between unscaling and the step: over every stage here.
        assert self._pipe_group is not None
        self.precision_plugin = over_stages(
            self.precision_plugin, lambda: list(stage_module.parameters()), self._pipe_group, self.root_device
        )
        self.setup_precision_plugin()
        # Processes that hold the same stages start from the same weights.
        for tensor in stage_module.state_dict().values():
            dist.broadcast(tensor, src=self.pipe_index, group=self.replica_group)
        self._runner = StageRunner.build(
            stage_module,
            self.placement,
            self.pipe_index,
            self._rank_of,
            self.micro_batches,
            micro_batch_loss(pl_module, trainer, self.micro_batches, self.precision_plugin),
            self._pipe_group,
            self.root_device,
            self.precision_plugin,
        )
        # The model summary's forward pass would need every block in this process.
        self._example_input, pl_module.example_input_array = pl_module.example_input_array, None

    # --- steps --------------------------------------------------------------------------------

    def _step(self, hook: str, batch: Any, *args: Any, train: bool, **kwargs: Any) -> STEP_OUTPUT:
        pl_module = self.lightning_module
        assert holds_network(pl_module) and self._runner is not None, "set up in setup"
        timed = train and is_log_step(pl_module.trainer)
        output = self._runner.run(batch, train, shared=not train or self._figures_read(), timed=timed)
        with network_returns(pl_module, output):
            return getattr(super(), hook)(batch, *args, **kwargs)

    def _figures_read(self) -> bool:
        """Whether the figures the LightningModule logs in this training step (its loss, its accuracy) are read:
        after a log step, and at the end of an epoch or of the run (the epoch's line, the progress bar). Only then
        does every stage get the last stage's output to compute them from; in the other steps the first stage,
        which writes the logs, computes them from zeros, and nothing reads them: no broadcast a step. (A run
        ``max_time`` ends reads the zeros' figures of its last step.)"""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        last_step = 0 < trainer.max_steps <= trainer.global_step + 1  # the run's, where max_steps ends it
        return is_log_step(trainer) or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch or last_step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("training_step", *args, train=True, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("validation_step", *args, train=False, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("test_step", *args, train=False, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("predict_step", *args, train=False, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # The schedule ran every micro-batch's backward pass in training_step; its gradients land here.
        assert self.lightning_module is not None and self._runner is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._runner.take_gradients()
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def configure_ddp(self) -> None:
        pass  # gradients are averaged between replicas in optimizer_step

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            result = closure()
            assert self._stage_module is not None and self.replica_group is not None
            average_between_replicas(list(self._stage_module.parameters()), self.replica_group, self.data_parallel_size)
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    @override
    def step_figures(self) -> dict[str, float]:
        """This process's idle share of the last log step's schedule (its computations timed), and the schedule's
        ideal (``ideal_idle_share``)."""
        assert self._runner is not None
        idle = self._runner.clock.idle_share()
        if idle is None:
            return {}
        ideal = ideal_idle_share(self.placement, self.micro_batches)
        return {"perf/pipeline/idle_share": idle, "perf/pipeline/idle_share_ideal": ideal}

    @override
    def gradient_norm(self, pl_module: nn.Module) -> Tensor:
        """Over this process's stages and the other processes' (each holds its stages' gradients alone)."""
        assert self._stage_module is not None and self._pipe_group is not None
        return norm_over_stages(list(self._stage_module.parameters()), self._pipe_group, self.root_device)

    # --- checkpoints --------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return gather_state_dict(
            self.lightning_module.state_dict(),
            self._held_blocks,
            self.placement.processes,
            self.replica_index == 0,
            self.is_global_zero,
        )

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self._stage_module is not None
        return gather_optimizer_state(
            optimizer,
            super().optimizer_state(optimizer),
            self._stage_module,
            self.placement.processes,
            self.replica_index == 0,
            self.is_global_zero,
        )

    @override
    def teardown(self) -> None:
        self._runner = None
        if self.lightning_module is not None and self._example_input is not None:
            self.lightning_module.example_input_array = self._example_input
        super().teardown()
