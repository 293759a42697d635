"""Every private torch and Lightning name the project relies on, in one place.

Nothing outside this module touches a private name of torch, torchvision or Lightning
(``tests/test_code_map.py`` fails if something does). Each use says why no public API serves,
and ``PRIVATE_HOOKS`` lists them, so that ``tests/test_compat.py`` fails by name, with the hook's
owner, when a torch or Lightning release removes one or changes its arguments. Each private name
is imported inside the function (or, for a class, at the first use of the name) that needs it,
so a release without it breaks only the feature that uses it, not every import of the project.

``LIGHTNING_CONTRACTS`` lists the other way we depend on Lightning's internals: attributes of
our strategies that Lightning reads by name (``hasattr``), outside any interface it declares. The
versions we support are in ``pyproject.toml`` (torch 2.11 to 2.15); the differences
between them are here too.
"""

import importlib
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as pipeline_schedules
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, Strategy
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

if TYPE_CHECKING:  # at run time both are made at their first import (``_LAZY_CLASSES``)
    from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase

    AnyDimBatchNorm = BatchNormBase

__all__ = [
    "AnyDimBatchNorm",
    "BatchNormBase",
    "BuiltBlocksMove",
    "CheckpointPathCLI",
    "LIGHTNING_CONTRACTS",
    "PRIVATE_HOOKS",
    "STAGE_ACTIONS",
    "STAGE_HOOKS_OF_TORCH_211",
    "TRAIN_LOADER_NEXT",
    "found_inf_flags",
    "is_log_step",
    "launches_subprocesses",
    "layer_sync",
    "pipeline_stage",
    "rendezvous_handlers",
    "replace_sigterm_notifier",
    "save_last_checkpoint",
    "schedule_actions",
    "set_default_process_group_backend",
    "skip_sigterm_broadcast",
    "split_backward",
    "should_skip_saving",
    "stop_after_this_step_as_on_sigterm",
    "thread_stack",
    "time_pipeline_parts",
    "time_stage_actions",
]


def resolve(path: str) -> Any:
    """The module, class or function at the dotted ``path`` (``torch.nn.modules.batchnorm._BatchNorm``), imported."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(path)


class PrivateHook(NamedTuple):
    """A private name we use: ``name`` on ``owner`` (the dotted path of a class or module) or, for an attribute set
    at construction, on ``instance()``; a function taking ``parameters`` (None: not a function). ``optional``: only
    some supported releases have it, and the code here checks for it. ``used_by``: the function or class of this
    module that needs it, the only one a release without it breaks."""

    owner: str
    name: str
    used_by: str
    parameters: tuple[str, ...] | None = None
    instance: Callable[[], Any] | None = None
    optional: bool = False


class LightningContract(NamedTuple):
    """An attribute ``name`` of our strategy ``provider`` (a dotted path) that Lightning reads by name in ``reader``
    (``hasattr``, outside any interface it declares): a release that stops reading it would silently change
    ``what``."""

    name: str
    provider: str
    reader: str
    what: str


STAGE_HOOKS_OF_TORCH_211 = ("_shape_inference", "_get_init_p2p_neighbors_ops")
"""torch 2.11's two ``PipelineStage`` steps that change a run, each overridden below where torch has it:

- ``_shape_inference``: a stage finds its shapes by running its module once, in training mode, on zeros,
  before the first micro-batch, and BatchNorm's running statistics keep that pass (2.15 backs the buffers up
  and puts them back);
- ``_get_init_p2p_neighbors_ops``: each schedule first exchanges a tensor with every neighbouring stage, which
  gloo cannot do where both stages are in one process (the V-shaped ``ZBVZeroBubble`` and ``DualPipeV``): "Pair
  is not connected".

2.15 has neither step."""


# --- torch.distributed.pipelining -------------------------------------------------------------------------------


class _StageOfTorch211(PipelineStage):
    """``PipelineStage`` that keeps its buffers through shape inference and greets only other processes
    (``STAGE_HOOKS_OF_TORCH_211``)."""

    def _shape_inference(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:  # type: ignore[misc]  # 2.11's
        # Private in 2.11, no public switch: the pass that finds the shapes must not update BatchNorm's statistics.
        kept = [(buffer, buffer.detach().clone()) for buffer in self.submod.buffers()]
        try:
            return super()._shape_inference(args, kwargs)  # type: ignore[misc]  # torch 2.11's, gone from the newest
        finally:
            with torch.no_grad():  # the pass ran under no_grad: nothing it saved reads these versions
                for buffer, value in kept:
                    buffer.copy_(value)

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        # Private in 2.11, no public switch: a warm-up send to a neighbouring stage held by this same process
        # fails under gloo; the stages of one process pass their tensors without any send.
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


def pipeline_stage(
    module: nn.Module, stage_index: int, num_stages: int, device: torch.device, group: dist.ProcessGroup
) -> PipelineStage:
    """``PipelineStage(module, stage_index, num_stages, device, group=group)``, with the same maths on every
    supported torch."""
    # An override of a step this torch lacks is never called.
    torch_211 = any(hasattr(PipelineStage, hook) for hook in STAGE_HOOKS_OF_TORCH_211)
    return (_StageOfTorch211 if torch_211 else PipelineStage)(module, stage_index, num_stages, device, group=group)


STAGE_ACTIONS = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward",
}
"""The methods of ``PipelineStage`` every schedule calls for its computations, and the part of the step each is:
torch documents the schedules, not what they call."""


def time_stage_actions(stage: PipelineStage, wrap: Callable[[str, Callable], Callable]) -> None:
    """Replace the computations the schedules call on ``stage`` (``STAGE_ACTIONS``) with ``wrap(part, method)``,
    on that stage alone."""
    for name, part in STAGE_ACTIONS.items():
        setattr(stage, name, wrap(part, getattr(stage, name)))


def time_pipeline_parts(wrap: Callable[[str, Callable], Callable]) -> None:
    """Replace what every pipeline schedule calls for its actions and its point-to-point communication with
    ``wrap(part, function)``: parts ``forward``, ``backward``, ``send/recv`` (posting) and ``wait``. For the
    benchmarks' clocks; for the rest of the process."""
    for name, part in STAGE_ACTIONS.items():
        setattr(PipelineStage, name, wrap(part, getattr(PipelineStage, name)))
    # The schedules post and wait for their sends and receives through these two module functions, which
    # have no public counterpart or hook.
    pipeline_schedules._batch_p2p = wrap("send/recv", pipeline_schedules._batch_p2p)
    pipeline_schedules._wait_batch_p2p = wrap("wait", pipeline_schedules._wait_batch_p2p)


def schedule_actions(
    schedule: str, processes: int, micro_batches: int, stages_per_process: int
) -> list[list[tuple[str, int, int]]]:
    """Each process's computations in one step of ``schedule``, in its order: ``(kind, stage, micro-batch)``, the
    kind ``F`` (forward), ``B`` (whole backward), ``I`` (input gradients) or ``W`` (weight gradients). An action
    that runs two computations at once (DualPipeV's) counts as both, one after the other; communication and
    empty slots are left out."""
    # torch lists a schedule's actions only by building it on stages; its visualiser builds one on stand-ins,
    # and has no public counterpart.
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(schedule, processes, micro_batches, stages_per_process)
    return [
        [
            (kind, int(stage), int(micro_batch))
            for action in rank
            if action is not None
            for stage, kind, micro_batch in re.findall(r"(\d+)([FBIW])(\d+)", str(action))
        ]
        for rank in ops
    ]


def split_backward(
    outputs: list[Tensor], grads: list[Tensor], inputs: list[Tensor], weights: list[nn.Parameter]
) -> Callable[[], object]:
    """Run the input-gradient half of the backward pass from ``outputs`` (their gradients ``grads``) to ``inputs``
    as the zero-bubble pipeline schedules run it, and return its weight-gradient half, to run later."""
    # The schedules split a backward pass with these two functions, which have no public counterpart.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    _, groups = stage_backward_input(outputs, grads, inputs, iter(weights))
    return lambda: stage_backward_weight(iter(weights), groups)


# --- torch: modules, mixed precision, rendezvous ---------------------------------------------------------------


@cache
def _batch_norm_base() -> type["BatchNormBase"]:
    # torch exports each BatchNorm layer but not their base.
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


@cache
def _any_dim_batch_norm() -> type[nn.Module]:
    class AnyDimBatchNorm(_batch_norm_base()):  # type: ignore[misc]  # a base made at first use, typed above
        """BatchNorm of any input with a channel dimension: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``..."""

        def _check_input_dim(self, input: Tensor) -> None:
            # The one hook by which BatchNorm1d/2d/3d differ; no public way to accept every dimension.
            if input.dim() < 2:
                raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    AnyDimBatchNorm.__module__, AnyDimBatchNorm.__qualname__ = __name__, "AnyDimBatchNorm"  # pickled by that name
    return AnyDimBatchNorm


_LAZY_CLASSES = {"BatchNormBase": _batch_norm_base, "AnyDimBatchNorm": _any_dim_batch_norm}
"""Classes built on a private torch class, made when first imported (``from multigpu.compat import ...``):

- ``BatchNormBase``: the base of every BatchNorm layer (1d, 2d, 3d, lazy, ``SyncBatchNorm``), which also holds
  the running statistics' update that ``DeferredBatchNorm`` builds on;
- ``AnyDimBatchNorm``: BatchNorm of any input with a channel dimension, ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)``...
"""


def __getattr__(name: str) -> Any:
    if name in _LAZY_CLASSES:
        return _LAZY_CLASSES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BuiltBlocksMove(nn.Sequential):
    """``nn.Sequential`` whose moves and casts (``.to``, ``.cpu``, ``.half``...) reach only the blocks that
    ``is_built`` accepts: the others are placeholders, which stay as they are."""

    def is_built(self, block: nn.Module) -> bool:
        raise NotImplementedError

    def _apply(self, fn: Callable, recurse: bool = True) -> "BuiltBlocksMove":
        # Every move and cast of nn.Module goes through _apply, for which torch has no public hook.
        if recurse:
            for block in self:
                if self.is_built(block):
                    block._apply(fn)
        return self


def found_inf_flags(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
    """The overflow flags per device that ``GradScaler.unscale_`` found for ``optimizer``, which ``step`` reads.

    GradScaler has no public way to read or set them; a pipeline sets them on every stage when one overflowed.
    """
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def rendezvous_handlers() -> dict[str, Callable]:
    """torch's registry of ``init_method`` schemes (``env://``, ``tcp://``...), by scheme.

    ``register_rendezvous_handler`` is public but refuses to replace one; the registry itself is private (in the
    module that the function ``torch.distributed.rendezvous`` hides as an attribute).
    """
    return importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers


# --- Lightning ----------------------------------------------------------------------------------------------------


def layer_sync(strategy: ParallelStrategy) -> Any:
    """The strategy's layer sync (``SyncBatchNorm`` under ``--trainer.sync_batchnorm=true``), or None.

    Lightning hands it to the strategy and keeps no public accessor.
    """
    return strategy._layer_sync


def set_default_process_group_backend(strategy: DDPStrategy, device: torch.device) -> None:
    """Make ``device``'s default backend (NCCL for CUDA, gloo for the CPU) the strategy's, unless one was given.

    ``DDPStrategy.setup_distributed`` picks the default from ``root_device``, which a strategy may have to
    show as the CPU while the process group is created; the choice is kept in a private attribute with no
    public setter.
    """
    if strategy._process_group_backend is None:
        strategy._process_group_backend = torch.distributed.get_default_backend_for_device(device)


def thread_stack(thread: threading.Thread, frames: int = 6) -> str:
    """The innermost ``frames`` frames of ``thread``'s Python stack, on one line. Python has no public way to see
    another thread's frames but ``sys._current_frames`` (documented, underscore and all; faulthandler prints to a
    file only)."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None  # None: not started
    if frame is None:
        return "no stack"
    summary = traceback.extract_stack(frame)[-frames:]
    return " > ".join(f"{os.path.basename(entry.filename)}:{entry.lineno} {entry.name}" for entry in summary)


def launches_subprocesses(strategy: Strategy) -> bool:
    """Whether this process started the others with Lightning's subprocess launcher (``ddp`` without torchrun
    or SLURM), and so must stop them itself. The launcher's class is private; its ``kill`` is not."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    return isinstance(strategy.launcher, _SubprocessScriptLauncher)


def stop_after_this_step_as_on_sigterm(trainer: Trainer) -> None:
    """Make Lightning stop after the current training step as it does on SIGTERM: it raises ``SIGTERMException``,
    which callbacks see in ``on_exception``. ``trainer.should_stop`` would stop without that exception."""
    trainer._signal_connector.received_sigterm = True


def replace_sigterm_notifier(trainer: Trainer, note: Callable[[int, Any], None]) -> None:
    """Have the SIGTERM handler Lightning registers as ``fit`` starts call ``note(signum, frame)`` in place of its
    notifier, which broadcasts a flag from inside the signal handler and so waits there for every other process.
    Call it before the Trainer registers its handlers (``setup``)."""
    trainer._signal_connector._sigterm_notifier_fn = note  # type: ignore[method-assign, assignment]  # in its place


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Leave out the broadcast of the first process's SIGTERM flag that Lightning's training loop makes before every
    step of a run of several processes, and reads back (a wait for the GPU): ``CheckpointOnStopSignal`` has every
    process agree on a stop signal, and raise the flag, at the same step, which then stops each of them after it."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]  # in its place


TRAIN_LOADER_NEXT = "[_TrainingEpochLoop].train_dataloader_next"
"""The action under which Lightning's training loop profiles its wait for the loader's next batch (the name of its
private loop class; ``run.step_times.LoaderClock`` times it)."""


def is_log_step(trainer: Trainer) -> bool:
    """Whether Lightning writes the logged metrics after this training step (every ``log_every_n_steps`` optimizer
    steps, and the step a run stops after): its own test, which it does not make public."""
    return trainer._logger_connector.should_update_logs


def should_skip_saving(callback: ModelCheckpoint, trainer: Trainer) -> bool:
    """ModelCheckpoint's own test of whether this moment may not write a checkpoint (sanity check, fast_dev_run,
    not fitting, the same step written already). It has no public counterpart."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Write ``callback``'s ``last.ckpt`` now, recording it in its own state as its own saves do. ModelCheckpoint's
    public hooks save only at its own intervals."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


class CheckpointPathCLI(LightningCLI):
    """``LightningCLI`` where ``resolve_checkpoint_path`` replaces Lightning's reading of ``--ckpt_path``."""

    def resolve_checkpoint_path(self) -> None:
        raise NotImplementedError

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint here, before the model is built, and puts its hyperparameters over the
        # command line; it has no public switch for that.
        self.resolve_checkpoint_path()


_PIPELINE_STAGE = "torch.distributed.pipelining.PipelineStage"
_SCHEDULES = "torch.distributed.pipelining.schedules"
_CHECKPOINT = "lightning.pytorch.callbacks.ModelCheckpoint"

PRIVATE_HOOKS = (
    PrivateHook(_PIPELINE_STAGE, "_shape_inference", "pipeline_stage", ("self", "args", "kwargs"), optional=True),
    PrivateHook(_PIPELINE_STAGE, "_get_init_p2p_neighbors_ops", "pipeline_stage", ("self",), optional=True),
    *(PrivateHook(_PIPELINE_STAGE, name, "time_stage_actions") for name in STAGE_ACTIONS),
    PrivateHook(_SCHEDULES, "_batch_p2p", "time_pipeline_parts", ("p2p_ops", "desc")),
    PrivateHook(_SCHEDULES, "_wait_batch_p2p", "time_pipeline_parts", ("work",)),
    PrivateHook("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", "schedule_actions"),
    PrivateHook(
        "torch.distributed.pipelining._backward",
        "stage_backward_input",
        "split_backward",
        ("stage_outputs_or_loss", "output_grads", "input_values", "weights"),
    ),
    PrivateHook(
        "torch.distributed.pipelining._backward",
        "stage_backward_weight",
        "split_backward",
        ("weights", "param_groups", "retain_graph"),
    ),
    PrivateHook("torch.nn.modules.batchnorm", "_BatchNorm", "BatchNormBase"),
    PrivateHook("torch.nn.modules.batchnorm._BatchNorm", "_check_input_dim", "AnyDimBatchNorm", ("self", "input")),
    PrivateHook("torch.nn.Module", "_apply", "BuiltBlocksMove", ("self", "fn", "recurse")),
    PrivateHook(
        "torch.amp.GradScaler", "_per_optimizer_states", "found_inf_flags", instance=lambda: torch.amp.GradScaler("cpu")
    ),
    PrivateHook("torch.distributed.rendezvous", "_rendezvous_handlers", "rendezvous_handlers"),
    PrivateHook("lightning.pytorch.strategies.ParallelStrategy", "_layer_sync", "layer_sync", instance=DDPStrategy),
    PrivateHook(
        "lightning.pytorch.strategies.DDPStrategy",
        "_process_group_backend",
        "set_default_process_group_backend",
        instance=DDPStrategy,
    ),
    PrivateHook("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher", "launches_subprocesses"),
    PrivateHook("sys", "_current_frames", "thread_stack"),
    PrivateHook(
        "lightning.pytorch.Trainer",
        "_signal_connector",
        "stop_after_this_step_as_on_sigterm",
        instance=lambda: Trainer(accelerator="cpu", logger=False),
    ),
    PrivateHook(
        "lightning.pytorch.trainer.connectors.signal_connector._SignalConnector",
        "_sigterm_notifier_fn",
        "replace_sigterm_notifier",
        ("self", "signum", "_"),
    ),
    PrivateHook(
        "lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop",
        "_broadcast_sigterm_tensor",
        "skip_sigterm_broadcast",
        ("self",),
    ),
    PrivateHook(
        "lightning.pytorch.Trainer",
        "_logger_connector",
        "is_log_step",
        instance=lambda: Trainer(accelerator="cpu", logger=False),
    ),
    PrivateHook(
        "lightning.pytorch.trainer.connectors.logger_connector.logger_connector._LoggerConnector",
        "should_update_logs",
        "is_log_step",
    ),
    PrivateHook(_CHECKPOINT, "_should_skip_saving_checkpoint", "should_skip_saving", ("self", "trainer")),
    PrivateHook(
        _CHECKPOINT, "_save_last_checkpoint", "save_last_checkpoint", ("self", "trainer", "monitor_candidates")
    ),
    PrivateHook(_CHECKPOINT, "_monitor_candidates", "save_last_checkpoint", ("self", "trainer")),
    PrivateHook("lightning.pytorch.cli.LightningCLI", "_parse_ckpt_path", "CheckpointPathCLI", ("self",)),
)

_ACCELERATOR_CONNECTOR = "lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector"
_DATA_PARALLEL = "multigpu.strategies.data_parallel.DataParallelStrategy"

LIGHTNING_CONTRACTS = (
    LightningContract(
        "is_distributed",
        _DATA_PARALLEL,
        f"{_ACCELERATOR_CONNECTOR}.is_distributed",
        "dp's one process would be given a DistributedSampler's share of the data",
    ),
    LightningContract(
        "num_nodes",
        _DATA_PARALLEL,
        f"{_ACCELERATOR_CONNECTOR}._lazy_init_strategy",
        "dp would take --trainer.num_nodes above 1 without a word",
    ),
)
