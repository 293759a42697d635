"""``pipeline``: one process per stage, micro-batches through the stages on ``torch.distributed.pipelining``.

Processes are launched as Lightning launches DDP (so ``--trainer.devices``,
``--trainer.num_nodes``, torchrun and SLURM all work). Ranks ``r*S .. r*S+S-1``
form replica ``r`` of an ``S``-stage pipeline; process ``s`` of each replica runs
the consecutive blocks of stage ``s`` of ``pl_module.net``. With ``R`` replicas the
processes that hold the same stage average their gradients, as DDP does.

In each step the batch is cut into micro-batches that flow through the stages
under a GPipe or 1F1B schedule; the last stage computes the loss with the
LightningModule's ``criterion`` and the backward passes run inside the schedule.
The last stage's logits are then broadcast to the other stages of the pipeline,
and every process runs the LightningModule's own ``training_step`` (or
``validation_step`` ...) on them, so loss, metrics and logging are those of DDP.

Every process keeps the whole network, but computes and updates only its stage;
checkpoints gather each stage from the process that trained it.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.optim import Optimizer
from typing_extensions import override

from multigpu.errors import UsageError
from multigpu.partition import BalanceBy, check_stage_count, choose_balance, split_blocks, split_table
from multigpu.strategies.network_lookup import block_sequence, time_blocks

__all__ = ["PipelineStrategy"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _Replay(nn.Module):
    """Stands in for the network: returns the pipeline's output for the batch it was computed on."""

    def __init__(self, output: Tensor) -> None:
        super().__init__()
        self.output = output

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.output


class PipelineStrategy(DDPStrategy):
    """Pipeline parallelism over processes, optionally replicated (data parallel between pipelines).

    Args:
        num_stages: stages per pipeline; default all processes (devices x nodes). The
            processes must be a multiple of it; the quotient is the number of replicas.
        micro_batches: micro-batches each batch is cut into; the batch must be divisible by it.
        schedule: ``gpipe`` (all forwards, then all backwards) or ``1f1b`` (one forward,
            one backward; needs at least as many micro-batches as stages, holds fewer activations).
        balance: blocks per stage, e.g. ``[9, 9]``.
        balance_by: without ``balance``, split by parameter count or measured time (see
            ``manual_model_parallel``).
        process_group_backend: default NCCL on CUDA, gloo on the CPU.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        num_stages: int | None = None,
        micro_batches: int = 4,
        schedule: Literal["gpipe", "1f1b"] = "1f1b",
        balance: list[int] | None = None,
        balance_by: BalanceBy = "time",
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend)
        if micro_batches < 1:
            raise UsageError(f"micro_batches must be at least 1, not {micro_batches}.")
        if num_stages is not None and num_stages < 1:
            raise UsageError(f"num_stages must be at least 1, not {num_stages}.")
        if schedule not in SCHEDULES:
            raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}.")
        self.num_stages_option = num_stages
        self.micro_batches = micro_batches
        self.schedule_name = schedule
        self.balance = balance
        self.balance_by = balance_by
        self._schedule: ScheduleGPipe | Schedule1F1B | None = None
        self._pipe_group: dist.ProcessGroup | None = None
        self._stage_group: dist.ProcessGroup | None = None
        self._stage_blocks: list[int] = []
        self._batch_size: int | None = None
        self._output_width: int | None = None
        self._held_grads: list[tuple[nn.Parameter, Tensor | None]] = []

    # --- layout -------------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        world = self.num_nodes * self.num_processes
        stages = self.num_stages_option or (len(self.balance) if self.balance else world)
        if world % stages:
            raise UsageError(
                f"the pipeline has {stages} stages, but devices x nodes = {world} processes is not a multiple of it: "
                f"use a multiple of {stages} devices, or change num_stages."
            )
        return stages

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the whole pipeline: the processes that see different samples."""
        return self.num_nodes * self.num_processes // self.num_stages

    @property
    def stage_index(self) -> int:
        return self.global_rank % self.num_stages

    @property
    def replica_index(self) -> int:
        return self.global_rank // self.num_stages

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The stages of one pipeline read the same batches.
        return {"num_replicas": self.data_parallel_size, "rank": self.replica_index}

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        stages = self.num_stages  # checks the process count
        if self.balance is not None and len(self.balance) != stages:
            raise UsageError(f"balance {self.balance} has {len(self.balance)} stages, but the pipeline has {stages}.")
        if self.schedule_name == "1f1b" and self.micro_batches < stages:
            raise UsageError(
                f"schedule 1f1b needs at least as many micro-batches as stages: micro_batches={self.micro_batches} "
                f"< {stages} stages. Raise micro_batches or use schedule gpipe."
            )

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        stages, replicas = self.num_stages, self.data_parallel_size
        # Every process creates every group, in the same order.
        for replica in range(replicas):
            group = dist.new_group(list(range(replica * stages, (replica + 1) * stages)))
            if replica == self.replica_index:
                self._pipe_group = group
        for stage in range(stages):
            group = dist.new_group(list(range(stage, stages * replicas, stages)))
            if stage == self.stage_index:
                self._stage_group = group

    def _pipe_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this process's pipeline."""
        return self.replica_index * self.num_stages + stage

    # --- the model ------------------------------------------------------------------------------

    def check_model(self, pl_module: LightningModule) -> nn.Sequential:
        """Refuse a LightningModule this pipeline cannot run, before any process is launched; return its blocks."""
        blocks = block_sequence(pl_module, self.strategy_name)
        if not isinstance(getattr(pl_module, "criterion", None), nn.Module):
            raise UsageError(
                f"strategy pipeline computes the loss on the last stage with the LightningModule's `criterion`; "
                f"{type(pl_module).__name__} has none."
            )
        batch_size = pl_module.hparams.get("batch_size")
        if batch_size is not None and batch_size % self.micro_batches:
            raise UsageError(
                f"the batch of {batch_size} images cannot be cut into micro_batches={self.micro_batches} equal parts: "
                "choose a batch size that is a multiple of micro_batches."
            )
        check_stage_count(self.num_stages, len(blocks))
        if self.balance is not None:
            choose_balance(blocks, self.num_stages, self.balance, self.balance_by, None)
        return blocks

    @override
    def setup(self, trainer) -> None:
        pl_module = self.lightning_module
        blocks = self.check_model(pl_module)
        super().setup(trainer)  # moves the module to this process's device; no DDP wrapper (configure_ddp)
        self._build_pipeline(pl_module, blocks)
        # Processes that hold the same stage start from the same weights.
        for tensor in self._stage_module.state_dict().values():
            dist.broadcast(tensor, src=self.stage_index, group=self._stage_group)
        self.precision_plugin.clip_gradients = self._clip_gradients  # the norm is global over the stages

    def _build_pipeline(self, pl_module: LightningModule, blocks: nn.Sequential) -> None:
        # Rank 0 times the blocks, for one micro-batch, for all.
        times = self.broadcast(time_blocks(self, blocks, self.micro_batches) if self.global_rank == 0 else None)
        balance = choose_balance(blocks, self.num_stages, self.balance, self.balance_by, times)
        start = sum(balance[: self.stage_index])
        self._stage_blocks = list(range(start, start + balance[self.stage_index]))
        self._stage_module = split_blocks(blocks, balance)[self.stage_index]
        devices = [f"rank {self._pipe_rank(stage)}" for stage in range(self.num_stages)]
        rank_zero_info(
            f"pipeline: {self.num_stages} stages x {self.data_parallel_size} replica(s), {self.micro_batches} "
            f"micro-batches, schedule {self.schedule_name}, balance {balance}"
            + ("" if self.balance else f" (by {self.balance_by})") + "\n" + split_table(blocks, balance, devices, times)
        )
        stage = PipelineStage(self._stage_module, self.stage_index, self.num_stages, self.root_device, group=self._pipe_group)
        self._schedule = SCHEDULES[self.schedule_name](
            stage, self.micro_batches, loss_fn=self._micro_batch_loss, scale_grads=False
        )

    def _micro_batch_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        """Each micro-batch's share of the mean loss over the batch and the accumulated batches."""
        trainer = self.lightning_module.trainer
        loss = self.lightning_module.criterion(logits, target) / (self.micro_batches * trainer.accumulate_grad_batches)
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    # --- steps --------------------------------------------------------------------------------

    def _run(self, batch: Any, train: bool) -> Tensor:
        """Run the batch through the pipeline; every stage gets the last stage's output."""
        x, y = batch[0], batch[1]
        size = len(x)
        if self._batch_size is None:
            self._batch_size = size
        if size > self._batch_size or (train and size != self._batch_size):
            raise UsageError(
                f"pipeline shapes are fixed by the first batch ({self._batch_size} images), but a batch has {size}: "
                "drop the last training batch (drop_last) and keep one batch size."
            )
        if size < self._batch_size:  # a last evaluation batch: pad it, and drop the padding's output
            pad = self._batch_size - size
            x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
            y = torch.cat([y, y[-1:].expand(pad)])
        inputs = (x,) if self.stage_index == 0 else ()
        is_last = self.stage_index == self.num_stages - 1
        target = y if is_last else None
        with self.precision_plugin.forward_context():
            if train:
                with self._gradients_held_for_backward():
                    output = self._schedule.step(*inputs, target=target)
            else:  # forward only; inference tensors would end up in the stage's buffers
                with torch.inference_mode(False), torch.no_grad():
                    output = self._schedule.eval(*inputs, target=target)
        return self._share_output(output, is_last)[:size]

    def _share_output(self, output: Tensor | None, is_last: bool) -> Tensor:
        last = self._pipe_rank(self.num_stages - 1)
        if self._output_width is None:
            width = torch.tensor([output.shape[1] if is_last else 0], device=self.root_device)
            dist.broadcast(width, src=last, group=self._pipe_group)
            self._output_width = int(width.item())
        if is_last:
            shared = output.detach().float().contiguous()
        else:
            shared = torch.empty(self._batch_size, self._output_width, device=self.root_device)
        dist.broadcast(shared, src=last, group=self._pipe_group)
        return shared

    @contextmanager
    def _gradients_held_for_backward(self) -> Iterator[None]:
        """Keep the gradients the schedule computes apart until ``backward``.

        Lightning zeroes the gradients between ``training_step`` and ``backward``, so the
        schedule's backward passes, which run inside ``training_step``, are added in ``backward``.
        """
        params = [param for param in self._stage_module.parameters() if param.requires_grad]
        earlier = [param.grad for param in params]
        for param in params:
            param.grad = None
        try:
            yield
        finally:
            self._held_grads = [(param, param.grad) for param in params]
            for param, grad in zip(params, earlier):
                param.grad = grad

    @contextmanager
    def _network_returns(self, output: Tensor) -> Iterator[None]:
        pl_module = self.lightning_module
        net = pl_module.net
        pl_module.net = _Replay(output)
        try:
            yield
        finally:
            pl_module.net = net

    def _step(self, hook: str, batch: Any, *args: Any, train: bool, **kwargs: Any) -> STEP_OUTPUT:
        output = self._run(batch, train)
        with self._network_returns(output):
            return getattr(super(), hook)(batch, *args, **kwargs)

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
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        for param, grad in self._held_grads:
            if grad is not None:
                param.grad = grad if param.grad is None else param.grad + grad
        self._held_grads = []
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    @override
    def configure_ddp(self) -> None:
        pass  # gradients are averaged between replicas in optimizer_step

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            result = closure()
            if self.data_parallel_size > 1:  # as DDP does, between the processes that hold this stage
                for param in self._stage_module.parameters():
                    if param.grad is not None:
                        dist.all_reduce(param.grad, group=self._stage_group)
                        param.grad /= self.data_parallel_size
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    def _clip_gradients(
        self, optimizer: Optimizer, clip_val: float = 0.0, gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM
    ) -> None:
        """Lightning's clipping step, made pipeline-wide.

        Lightning calls it after unscaling and before the optimizer step, with or without
        clipping, so it is also where a 16-mixed overflow on one stage skips the step on all.
        The norm is taken over the gradients of all stages.
        """
        self._share_overflow(optimizer)
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.precision_plugin.clip_grad_by_value(optimizer, clip_val)
            return
        params = [param for param in self._stage_module.parameters() if param.grad is not None]
        squares = torch.zeros((), device=self.root_device)
        for param in params:
            squares += param.grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=self._pipe_group)
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, squares.sqrt())

    def _share_overflow(self, optimizer: Optimizer) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        # GradScaler keeps its per-device overflow flags here; it has no public way to set them.
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flags = [flag.to(self.root_device).sum() for flag in found.values()]
        anywhere = torch.stack(flags).sum() if flags else torch.zeros((), device=self.root_device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        if anywhere.item() > 0:
            found[self.root_device] = torch.ones(1, device=self.root_device)

    # --- checkpoints --------------------------------------------------------------------------

    def _gather_stage_states(self, local: dict[str, Any]) -> list[dict[str, Any]]:
        """Every stage's entry from the first replica, gathered on rank 0 (empty lists elsewhere)."""
        mine = local if self.replica_index == 0 else {}
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(mine, gathered if self.global_rank == 0 else None, dst=0)
        return gathered[: self.num_stages]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.lightning_module.state_dict()
        prefixes = tuple(f"net.{index}." for index in self._stage_blocks)
        mine = {key: value.cpu() for key, value in state.items() if key.startswith(prefixes)}
        for stage_state in self._gather_stage_states(mine):
            state.update(stage_state)
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        full = super().optimizer_state(optimizer)
        owned = {id(p) for p in self._stage_module.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        mine = {
            index: {key: value.cpu() if isinstance(value, Tensor) else value for key, value in state.items()}
            for index, state in full["state"].items()
            if id(params[index]) in owned
        }
        merged = {}
        for stage_state in self._gather_stage_states(mine):
            merged.update(stage_state)
        return {**full, "state": dict(sorted(merged.items()))}

    @override
    def teardown(self) -> None:
        self._schedule = None
        super().teardown()
