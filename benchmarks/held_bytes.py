"""What the memory benchmark counts: the bytes each process and each stage holds, and each process's peak."""

import json
from pathlib import Path

from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor
from typing_extensions import override

from multigpu.timing.step_timer import peak_memory_bytes


def _bytes(tensors) -> int:
    """What this process holds of ``tensors``: of a sharded one (a ``DTensor``, under fsdp) its own shard."""
    local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors)
    return sum(tensor.numel() * tensor.element_size() for tensor in local if not tensor.is_meta)


class HeldBytes(Callback):
    """Before the optimizer step of step ``trainer.max_steps`` (parameters, gradients and the
    optimizer state of the earlier steps all exist), counts the bytes of each, exactly from the
    tensors, per stage of the network this process holds (a strategy's ``stage_blocks``; else the
    whole network is one stage). At the end of training, writes them with the process's peak memory
    to ``out`` with the rank appended.
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.stages: list[dict] = []

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 != trainer.max_steps:
            return
        blocks = pl_module.net
        stages = getattr(trainer.strategy, "stage_blocks", [range(len(blocks))])
        state = [value for param_state in optimizer.state.values() for value in param_state.values()]
        state_of = {id(param): list(param_state.values()) for param, param_state in optimizer.state.items()}
        self.stages = []
        for stage in stages:
            params = [param for index in stage for param in blocks[index].parameters()]
            self.stages.append(
                {
                    "blocks": f"{stage.start}-{stage.stop - 1}",
                    "params": _bytes(params),
                    "grads": _bytes(param.grad for param in params if param.grad is not None),
                    "optimizer": _bytes(
                        value
                        for param in params
                        for value in state_of.get(id(param), [])
                        if hasattr(value, "numel") and value.ndim > 0
                    ),
                }
            )
        held = sum(stage["params"] + stage["grads"] + stage["optimizer"] for stage in self.stages)
        everything = _bytes(pl_module.parameters()) + _bytes(
            p.grad for p in pl_module.parameters() if p.grad is not None
        )
        everything += _bytes(value for value in state if hasattr(value, "numel") and value.ndim > 0)
        assert held == everything, "a parameter, gradient or state outside the stages"

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        record = {"rank": trainer.global_rank, "stages": self.stages, "peak": peak_memory_bytes(pl_module.device)}
        self.out.with_name(f"{self.out.name}.rank{trainer.global_rank}").write_text(json.dumps(record))
