"""``dp``: one process drives several GPUs with ``torch.nn.DataParallel``.

Only the network (``pl_module.net``) is wrapped: each batch is scattered over the
devices, the network replicated, and the outputs gathered on the first device,
where the loss, the metrics and the logging run once. ``batch_size`` is therefore
the whole batch of the process, split between the devices.

Without CUDA devices there is nothing to scatter over: ``dp`` warns and trains on
one device.
"""

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DataParallel
from typing_extensions import override

from multigpu.compat import layer_sync
from multigpu.contracts import Parallelism
from multigpu.errors import UsageError
from multigpu.strategies.network_lookup import network

__all__ = ["DataParallelStrategy", "TransparentDataParallel"]


class _Autocast(nn.Module):
    """Runs a replica under the autocast dtype of the thread that called ``DataParallel``."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class TransparentDataParallel(DataParallel):
    """``DataParallel`` whose state dict is that of the module it wraps: no ``module.`` prefix.

    It also carries the autocast dtype into the replicas' threads: torch's
    ``parallel_apply`` re-enables autocast there without its dtype, so ``bf16-mixed``
    would otherwise run the replicas in float16.
    """

    def __init__(self, module: nn.Module, device_ids: list[int], output_device: int | None) -> None:
        super().__init__(module, device_ids=device_ids, output_device=output_device)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    @override
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    @override
    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Any, kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [_Autocast(replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


def _add_module_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    for key in [key for key in state_dict if key.startswith(prefix) and not key.startswith(prefix + "module.")]:
        state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)


class DataParallelStrategy(ParallelStrategy, Parallelism):
    """Single-process data parallelism over the devices of ``--trainer.devices`` (a count or a list)."""

    strategy_name = "dp"

    def __init__(self) -> None:
        super().__init__()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[0]

    # One process: rank 0 of a world of 1, whatever the devices.
    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def num_nodes(self) -> int:
        return 1

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        if num_nodes != 1:
            raise UsageError(f"dp runs in one process on one machine, not {num_nodes}: use ddp across machines.")

    @property
    @override
    def process_devices(self) -> list[torch.device]:
        assert self.parallel_devices is not None
        return self.parallel_devices

    @property
    def is_distributed(self) -> bool:
        """No distributed sampler: the one process sees every sample."""
        return False

    @property
    def device_ids(self) -> list[int]:
        """The CUDA device indices DataParallel scatters over; empty without CUDA."""
        assert self.parallel_devices is not None
        return [device.index for device in self.parallel_devices if device.type == "cuda"]

    @override
    def setup_environment(self) -> None:
        environment = self.cluster_environment
        if environment is not None and environment.creates_processes_externally and environment.world_size() > 1:
            raise UsageError(
                f"dp runs in one process, but {type(environment).__name__} started {environment.world_size()}: "
                "start one process per machine, or use ddp."
            )
        if layer_sync(self) is not None:
            raise UsageError("--trainer.sync_batchnorm=true needs one process per device: use ddp, not dp.")
        super().setup_environment()

    @override
    def check_model(self, pl_module: LightningModule) -> nn.Module:
        """Refuse a LightningModule dp cannot run, before training; return its network."""
        return network(pl_module, self.strategy_name)

    @override
    def model_to_device(self) -> None:
        assert self.lightning_module is not None
        pl_module = self.lightning_module
        net = self.check_model(pl_module)
        pl_module.to(self.root_device)
        if self.root_device.type != "cuda":
            rank_zero_warn(f"strategy dp needs CUDA devices; it trains on one {self.root_device.type} device instead.")
        elif len(self.device_ids) > 1:
            pl_module.net = TransparentDataParallel(net, device_ids=self.device_ids, output_device=self.device_ids[0])

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def teardown(self) -> None:
        pl_module = self.lightning_module
        if pl_module is not None and isinstance(pl_module.net, TransparentDataParallel):
            pl_module.net = pl_module.net.module
        super().teardown()
