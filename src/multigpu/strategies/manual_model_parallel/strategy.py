"""``manual_model_parallel``: the network split into consecutive stages, one per device, in one process.

Each stage's first block moves its input to the stage's device, and the network's
output comes back to the first device, where the loss and the metrics live;
autograd carries the gradients back across the devices. Each block is built or
moved straight to its stage's device (``split_network``): the first device holds its
own stage, not the whole network. Parameter names do not change, so a checkpoint is the plain full state dict
every strategy loads.

With ``devices_per_replica: k`` the ``--trainer.devices`` of a node are cut into
groups of ``k``: one process per group holds a copy of the network split over its
``k`` devices, and DistributedDataParallel all-reduces the gradients between the
processes ("distributed model and data parallel").
"""

from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from multigpu.compat import set_default_process_group_backend
from multigpu.errors import UsageError
from multigpu.strategies.block_timing import time_blocks
from multigpu.strategies.ddp.options import ddp_options
from multigpu.strategies.network_lookup import block_sequence
from multigpu.strategies.partition import BalanceBy, choose_balance, split_table, stage_ranges
from multigpu.strategies.split_network import SplitNetworkStrategy

__all__ = ["ManualModelParallelStrategy", "check_devices_per_replica"]


def _move_inputs(device: torch.device):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return move_data_to_device(args, device)  # a block may pass a tuple (see ``network``)

    return hook


def _move_output(device: torch.device):
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return move_data_to_device(output, device)

    return hook


def check_devices_per_replica(devices: int, per_replica: int) -> None:
    """Refuse ``devices`` that do not make whole replicas of ``per_replica`` devices: at launch and in ``plan``."""
    if devices % per_replica:
        raise UsageError(
            f"--trainer.devices={devices} is not a multiple of the {per_replica} devices per replica "
            f"of manual_model_parallel: use a multiple of {per_replica}, or change devices_per_replica "
            "(or balance)."
        )


class ManualModelParallelStrategy(SplitNetworkStrategy):
    """Consecutive blocks of ``pl_module.net`` on consecutive devices, optionally replicated with DDP.

    Args:
        balance: blocks per stage, e.g. ``[17, 17]``; one stage per device of a replica.
        balance_by: without ``balance``, split to even out the parameter count (``params``)
            or the forward and backward time of the blocks, measured on the first device (``time``).
        devices_per_replica: devices (stages) per copy of the network; ``--trainer.devices``
            must be a multiple of it, and the quotient is the number of processes per node.
            Default: the length of ``balance``, else all devices of the node (one process).
        process_group_backend: the backend between replicas; default NCCL on CUDA, gloo on the CPU.
    """

    strategy_name = "manual_model_parallel"

    def __init__(
        self,
        balance: list[int] | None = None,
        balance_by: BalanceBy = "time",
        devices_per_replica: int | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, **ddp_options())
        if devices_per_replica is not None and devices_per_replica < 1:
            raise UsageError(f"devices_per_replica must be at least 1, not {devices_per_replica}.")
        if balance is not None and devices_per_replica is not None and len(balance) != devices_per_replica:
            raise UsageError(
                f"balance {balance} has {len(balance)} stages, but devices_per_replica={devices_per_replica} asks for "
                f"{devices_per_replica}: give one entry per device of a replica."
            )
        self.balance = balance
        self.balance_by = balance_by
        self.devices_per_replica = devices_per_replica
        self._hooks: list[RemovableHandle] = []
        self._balance: list[int] = []
        self._placed: list[torch.device | None] | None = None
        self._unbound_group = False  # root_device reads as the CPU while the process group is created

    @property
    def stages_per_replica(self) -> int:
        """Devices, and so stages, in each process's copy of the network."""
        assert self.parallel_devices is not None
        devices = len(self.parallel_devices)
        per_replica = self.devices_per_replica or (len(self.balance) if self.balance else devices)
        check_devices_per_replica(devices, per_replica)
        return per_replica

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) // self.stages_per_replica if self.parallel_devices else 0

    @property
    def stage_devices(self) -> list[torch.device]:
        """The devices of this process's stages, in order."""
        assert self.parallel_devices is not None
        per_replica = self.stages_per_replica
        return self.parallel_devices[self.local_rank * per_replica : (self.local_rank + 1) * per_replica]

    @property
    @override
    def process_devices(self) -> list[torch.device]:
        return self.stage_devices

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu") if self._unbound_group else self.stage_devices[0]

    @override
    def setup_distributed(self) -> None:
        if self.stages_per_replica == 1:
            return super().setup_distributed()
        # Lightning binds the process group to the root device (not a CPU); NCCL then refuses the collectives
        # (DDP's parameter broadcast and all-reduce) on the other stages' devices. Same steps, unbound, with
        # the backend of the stages' devices (Lightning would take the CPU's).
        set_default_process_group_backend(self, self.stage_devices[0])
        self._unbound_group = True
        try:
            super().setup_distributed()
        finally:
            self._unbound_group = False

    @override
    def check_model(self, pl_module: LightningModule) -> nn.Sequential:
        """Refuse a LightningModule this strategy cannot split, before training; return its blocks."""
        return block_sequence(pl_module, self.strategy_name)

    @override
    def place_blocks(self) -> list[torch.device | None]:
        if self._placed is None:
            assert self.lightning_module is not None
            blocks = self.check_model(self.lightning_module)
            devices = self.stage_devices
            times = time_blocks(self, blocks)
            self._balance = self.broadcast(choose_balance(blocks, len(devices), self.balance, self.balance_by, times))
            # (every replica splits the same way, as DDP's buckets need)
            rank_zero_info(
                f"manual_model_parallel: {len(devices)} stages per replica, {self.num_nodes * self.num_processes} "
                f"replica(s), balance {self._balance}"
                + ("" if self.balance else f" (by {self.balance_by})")
                + "\n"
                + split_table(blocks, self._balance, devices, times)
            )
            self._placed = [device for count, device in zip(self._balance, devices) for _ in range(count)]
        return self._placed

    @property
    def stage_blocks(self) -> list[range]:
        """The block indices of each stage of this process's replica, once the split is chosen."""
        return stage_ranges(self._balance)

    @override
    def model_to_device(self) -> None:
        super().model_to_device()  # each block straight to its stage's device
        assert self.lightning_module is not None
        blocks = block_sequence(self.lightning_module, self.strategy_name)
        self._remove_hooks()
        for blocks_of_stage, device in zip(self.stage_blocks, self.stage_devices, strict=True):
            if device != self.root_device:
                self._hooks.append(blocks[blocks_of_stage.start].register_forward_pre_hook(_move_inputs(device)))
        if self.stage_devices[-1] != self.root_device:
            self._hooks.append(blocks[-1].register_forward_hook(_move_output(self.root_device)))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @override
    def configure_ddp(self) -> None:
        if self.world_size > 1:  # one replica has no gradients to all-reduce
            super().configure_ddp()

    @override
    def determine_ddp_device_ids(self) -> list[int] | None:
        # DDP takes a module spread over several devices only without device_ids.
        return None if self.stages_per_replica > 1 else super().determine_ddp_device_ids()

    @override
    def teardown(self) -> None:
        self._remove_hooks()
        super().teardown()
