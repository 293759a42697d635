"""``fsdp``: parameters, gradients and optimizer state sharded over the processes with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``), on the CPU (gloo) as on CUDA (NCCL).

Lightning's own ``fsdp`` (FSDP1) refuses the CPU, and its ``ModelParallelStrategy`` leaves the
sharding to the LightningModule. This strategy keeps DDP's launch, process groups and sampler,
and replaces the DDP wrapper: once the network is built, ``fully_shard`` goes on each block of
``pl_module.net``, then on ``pl_module.net`` itself (torchtitan's order), over a mesh of every
process, or of replicas x shards (HSDP, ``shard_size``). A block's parameters are gathered just
before its forward and backward pass and freed after; each process keeps 1/N of every parameter,
its gradient and its momentum.

The maths are ``ddp``'s: the reduce-scatter averages the gradients over all processes as DDP's
all-reduce does, and the parameters and buffers start as the first process's. Like ``ddp`` here
(``multigpu.strategies``), it sends no buffers before a forward pass: BatchNorm's stay the same on
every process, one device's statistics (``multigpu.model.step_batch_norm``).

Over the batches a step accumulates, the gradients are reduce-scattered after each batch and stay
sharded (Lightning's own FSDP does the same); DDP adds them up whole first, so the sums differ in
their last bits. ``accumulate_whole_gradients`` adds them up whole and reduce-scatters once, as DDP
does: the same bits, and one whole copy of the gradients per process while a step accumulates.

A checkpoint holds the whole state in every strategy's layout (``full_state.py``), so it resumes
under one device, ``ddp``, model parallel or a pipeline, and theirs here.
"""

import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer
from typing_extensions import override

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.contracts import Parallelism
from multigpu.errors import UsageError
from multigpu.strategies.fully_sharded.full_state import (
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
)
from multigpu.strategies.network_lookup import block_sequence

__all__ = ["FullyShardedStrategy"]


def broadcast_from_first(tensors: list[Tensor]) -> None:
    """Give every process the first process's values of ``tensors``: one flat broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for group in by_dtype.values():
        flat = torch.cat([tensor.detach().reshape(-1) for tensor in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for tensor in group:
            tensor.data.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


class FullyShardedStrategy(DDPStrategy, Parallelism):
    """Parameters, gradients and optimizer state sharded over the processes (FSDP2), block by block.

    Args:
        reshard_after_forward: free each block's gathered parameters after its forward pass and gather
            them again for the backward pass (less memory); ``false`` keeps them until the backward pass
            (one all-gather less per block and step).
        shard_size: processes that share one copy of the state (HSDP): the processes form
            ``world size / shard_size`` replicas of ``shard_size`` shards, each process holding
            1/shard_size of the state. Default: all of them.
        accumulate_whole_gradients: with ``--trainer.accumulate_grad_batches`` above 1, add up each
            block's whole gradients over the accumulated batches and reduce-scatter once, as DDP does
            (ddp's sums bit for bit), instead of after each batch (gradients stay sharded).
        process_group_backend: default NCCL on CUDA, gloo on the CPU.
        sharded_checkpoints: while fitting, each process writes its own shard of the network's and the optimizer's
            tensors into a folder beside the checkpoint file, and no process gathers the whole state
            (``checkpointing.sharded_checkpoints``; every strategy, ``test``, ``predict`` and ``export`` read them);
            ``false`` gathers the whole state on the first process, which writes one file.
    """

    strategy_name = "fsdp"

    def __init__(
        self,
        reshard_after_forward: bool = True,
        shard_size: int | None = None,
        accumulate_whole_gradients: bool = False,
        process_group_backend: str | None = None,
        sharded_checkpoints: bool = True,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend)
        if shard_size is not None and shard_size < 1:
            raise UsageError(f"fsdp: shard_size must be at least 1, not {shard_size}.")
        self.reshard_after_forward = reshard_after_forward
        self.shard_size = shard_size
        self.accumulate_whole_gradients = accumulate_whole_gradients
        self.sharded_checkpoints = sharded_checkpoints
        self._saves_shards = False  # while training runs (``on_train_start``)
        self._net: FSDPModule | None = None  # the sharded network, while fitting

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """``(world_size,)``, or ``(replicas, shard_size)`` for HSDP; a ``UsageError`` when they do not divide."""
        shards = self.shard_size or world_size
        if world_size % shards:
            raise UsageError(
                f"fsdp: shard_size={shards} does not divide the {world_size} processes "
                f"(--trainer.devices x --trainer.num_nodes): use a divisor of {world_size}."
            )
        return (world_size,) if shards == world_size else (world_size // shards, shards)

    @override
    def check_model(self, pl_module: LightningModule) -> nn.Sequential:
        """Refuse a LightningModule this strategy cannot shard, before training; return its blocks."""
        blocks = block_sequence(pl_module, self.strategy_name)
        in_net = {id(param) for param in blocks.parameters()}
        if outside := [name for name, param in pl_module.named_parameters() if id(param) not in in_net]:
            raise UsageError(
                f"fsdp shards the blocks of {type(pl_module).__name__}.net, but {outside[0]} is outside it: "
                "move it into the network."
            )
        return blocks

    @override
    def check_training(self, pl_module: LightningModule) -> None:
        """Refuse a layout the processes cannot form, before any process is launched."""
        assert self.parallel_devices is not None
        self.mesh_shape(len(self.parallel_devices) * self.num_nodes)
        if self.num_nodes > 1 and self.shard_size and len(self.parallel_devices) % self.shard_size:
            raise UsageError(
                f"fsdp: shard_size={self.shard_size} does not divide the {len(self.parallel_devices)} devices of a "
                "node, so shard groups would span machines: use a divisor of --trainer.devices."
            )
        if self.process_group_backend == "gloo" and self.parallel_devices[0].type == "cuda":
            raise UsageError(
                "fsdp: gloo cannot gather or reduce-scatter CUDA tensors: drop "
                "--trainer.strategy.process_group_backend."
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise UsageError(
                "fsdp does not train in 16-mixed: its loss scaler would skip a step only on the processes whose "
                "shard of the gradients overflowed. Use --trainer.precision=bf16-mixed."
            )

    @property
    def sharded(self) -> bool:
        return self._net is not None

    @override
    def configure_ddp(self) -> None:
        # In place of the DDP wrapper: the network's blocks sharded where they are.
        assert self.lightning_module is not None
        blocks = self.check_model(self.lightning_module)
        shape = self.mesh_shape(self.world_size)
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        broadcast_from_first([*blocks.parameters(), *blocks.buffers()])  # as DDP starts
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        self._net = fully_shard(blocks, mesh=mesh, reshard_after_forward=self.reshard_after_forward)

    @contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
        # The batches a step accumulates before its last: with accumulate_whole_gradients, no reduce-scatter.
        if self._net is None or not self.accumulate_whole_gradients:
            yield
            return
        self._net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._net.set_requires_gradient_sync(True)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:  # DDP wraps only to train; the others keep the whole network
            self._net = None
            return
        # Validation runs the sharded blocks: under inference mode their gathered parameters would be inference
        # tensors that training cannot use afterwards (Lightning exempts only its own FSDP strategy).
        trainer.fit_loop.epoch_loop.val_loop.inference_mode = False

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Every process reads the whole checkpoint: onto the CPU, not each onto the GPU it was saved from.
        torch.cuda.empty_cache()
        return self.checkpoint_io.load_checkpoint(checkpoint_path, map_location="cpu", weights_only=weights_only)

    @override
    def setup_environment(self) -> None:
        if type(self.checkpoint_io) is TorchCheckpointIO:  # Lightning's default: ours writes the shards
            self.checkpoint_io = AtomicCheckpointIO()
        super().setup_environment()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # While training runs (its stop on SIGTERM or Ctrl-C included), a checkpoint is written as the processes hold
        # it (``sharded_checkpoints``, with our writer); once it has ended, the state is read whole, as every
        # strategy's.
        self._saves_shards = self.sharded_checkpoints and isinstance(self.checkpoint_io, AtomicCheckpointIO)

    @override
    def on_train_end(self) -> None:
        self._saves_shards = False
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # A failure or a second Ctrl-C ends every process: the shards of the save in flight may never all come (a
        # SIGTERM's stop saves with every process, and waits for it).
        if not isinstance(exception, SIGTERMException) and isinstance(self.checkpoint_io, AtomicCheckpointIO):
            self.checkpoint_io.abort()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._saves_shards = False  # after an interruption too
        super().teardown()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.sharded:
            return super().lightning_module_state_dict()
        assert self.lightning_module is not None
        if self._saves_shards:
            return get_model_state_dict(self.lightning_module)  # each process's shards, nothing gathered
        return full_model_state(self.lightning_module, self.is_global_zero)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self.sharded:
            return super().optimizer_state(optimizer)
        if self._saves_shards:
            return optimizer.state_dict()  # keyed by index, as every strategy's; its values each process's shards
        return full_optimizer_state(optimizer, self.is_global_zero)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._saves_shards:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None or "://" in str(filepath):  # remote: one whole file, gathered as before
            assert self.lightning_module is not None
            checkpoint = {**checkpoint, "state_dict": full_model_state(self.lightning_module, self.is_global_zero)}
            if "optimizer_states" in checkpoint:
                whole = [full_optimizer_state(optimizer, self.is_global_zero) for optimizer in self.optimizers]
                checkpoint["optimizer_states"] = whole
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        token = self.broadcast(secrets.token_hex(4))  # the folder of this save, the same in every process
        assert isinstance(self.checkpoint_io, AtomicCheckpointIO), "_saves_shards: set only with it"
        self.checkpoint_io.save_sharded(checkpoint, filepath, self.global_rank, self.world_size, token)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.sharded:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_full_optimizer_state(optimizer, state)
