"""What a pipeline asks of the LightningModule and its batch, checked before any process is launched."""

from lightning.pytorch import LightningModule
from torch import Tensor, nn

from multigpu.contracts import trains_network
from multigpu.errors import UsageError
from multigpu.strategies.micro_batch_check import micro_batch_refusal
from multigpu.strategies.network_lookup import block_sequence
from multigpu.strategies.partition import BalanceBy, check_stage_count, choose_balance
from multigpu.typed_options import ModuleOptions

__all__ = ["pipeline_blocks", "refuse_untrainable_micro_batches"]


def pipeline_blocks(
    pl_module: LightningModule, micro_batches: int, num_stages: int, balance: list[int] | None, balance_by: BalanceBy
) -> nn.Sequential:
    """The blocks of ``pl_module.net``, once the pipeline's demands are checked: a ``criterion`` for the last stage,
    a batch that cuts into ``micro_batches``, enough blocks for the stages, a ``balance`` that fits them."""
    blocks = block_sequence(pl_module, "pipeline")
    if not trains_network(pl_module):
        raise UsageError(
            f"strategy pipeline computes the loss on the last stage with the LightningModule's `criterion`; "
            f"{type(pl_module).__name__} has none."
        )
    batch_size = ModuleOptions.of(pl_module).batch_size
    if batch_size is not None and batch_size % micro_batches:
        raise UsageError(
            f"the batch of {batch_size} images cannot be cut into micro_batches={micro_batches} equal parts: "
            "choose a batch size that is a multiple of micro_batches."
        )
    check_stage_count(num_stages, len(blocks))
    if balance is not None:
        choose_balance(blocks, num_stages, balance, balance_by, None)
    return blocks


def refuse_untrainable_micro_batches(blocks: nn.Sequential, pl_module: LightningModule, micro_batches: int) -> None:
    """Refuse micro-batches too small to train (evaluation runs them in eval mode, where they can): BatchNorm given
    one value per channel, say (``micro_batch_refusal``, the check ``plan`` makes)."""
    batch_size, example = ModuleOptions.of(pl_module).batch_size, pl_module.example_input_array
    if batch_size is None or not isinstance(example, Tensor):
        return
    images = batch_size // micro_batches
    if why := micro_batch_refusal(blocks, example.shape[1:], images):
        raise UsageError(
            f"a micro-batch of {images} image(s) (a batch of {batch_size} in micro_batches={micro_batches}) "
            f"cannot train: {why}. Use fewer micro-batches or a larger --data.batch_size."
        )
