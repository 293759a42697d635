"""``ImageClassifier``: the LightningModule that trains ResNet-50 (``resnet.py``) or any torchvision classifier
(``--model.arch``, ``architectures.py``).

It holds the loss, the metrics and the optimizer. The network itself is the plain
``nn.Sequential`` of blocks in ``self.net`` (see ``multigpu.model.resnet`` for ResNet-50's block layout);
strategies may move or wrap ``self.net`` but touch nothing else here.
"""

import math
import os
import random
from typing import Any

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torch.optim import SGD
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix
from torchmetrics.functional.classification import multiclass_accuracy
from typing_extensions import override

from multigpu.compat import is_log_step
from multigpu.errors import UsageError
from multigpu.model.architectures import DEFAULT_ARCH
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.model.lr_schedule import scaled_lr, warmup_cosine
from multigpu.model.network_options import NetworkOptions
from multigpu.model.recipe import Recipe
from multigpu.model.recomputation import recompute_blocks
from multigpu.model.replica_statistics import ReplicaStatistics, micro_batches_per_step, records_step_statistics
from multigpu.model.resnet import Stem
from multigpu.model.step_batch_norm import record_step_statistics
from multigpu.model.torchvision_weights import load_torchvision_weights
from multigpu.model.worst_images import WorstImages
from multigpu.renamed_options import renamed_class
from multigpu.run.replicas import data_parallel_size, global_batch_size

__all__ = [
    "IMAGE_SHAPE",
    "LR_SCHEDULE_NEEDS_AN_END",
    "ImageClassifier",
]

IMAGE_SHAPE = (3, 32, 32)
LR_SCHEDULE_NEEDS_AN_END = (
    "the cosine learning-rate schedule needs an end: set --trainer.max_epochs or --trainer.max_steps."
)


def _fuses(params: list[Tensor], trainer: Trainer) -> bool:
    """Whether SGD updates ``params`` in one fused kernel per device (``fused=True``): where they are all plain CUDA
    tensors and no gradient scaler (16-mixed) runs, which Lightning unscales and clips with only for optimizers that
    do not unscale themselves, as fused ones do. Elsewhere torch's default (``foreach``) stays: the CPU, whose tests
    pin the numbers, and ``fsdp``'s sharded parameters (DTensors). The update is the same arithmetic; its last bits
    may differ from foreach's."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        return False
    return bool(params) and all(param.is_cuda and type(param) is nn.Parameter for param in params)


class ImageClassifier(LightningModule):
    """Image classifier (ResNet-50 by default) with SGD, linear LR scaling, warm-up and cosine decay.

    Args:
        arch: the network: ``resnet50`` (ResNet-50 with each bottleneck in two blocks), any other of
            torchvision's classifiers (``resnet18``, ``convnext_tiny``, ``mobilenet_v3_small``, ``vit_b_32``...),
            or ``package.module.function`` for a network of your own (docs/networks.md). Every strategy splits
            it into blocks.
        num_classes: number of classes; linked from the data module by the CLI.
        batch_size: images per device and step; linked from the data module by the CLI.
        image_size: the side of the square images; linked from the data module by the CLI.
        stem: ``cifar`` (3x3 stride-1 first convolution, no max-pool) or ``imagenet``: the ResNet family's first
            layers. The other networks keep their own.
        base_lr: learning rate for a global batch of 256 images. The rate used is
            ``base_lr * batch_size * devices * nodes * accumulate_grad_batches / 256``.
        momentum: SGD momentum.
        nesterov: use Nesterov momentum.
        weight_decay: L2 weight decay.
        no_decay_norm_bias: exempt BatchNorm weights and all biases from weight decay.
        warmup_epochs: epochs of linear warm-up before the cosine decay.
        label_smoothing: label smoothing of the cross-entropy loss.
        channels_last: keep the network and its inputs in channels-last memory format.
        recompute_activations: recompute each block's forward pass during the backward pass
            instead of keeping its activations (``multigpu.model.recomputation``; torch calls it activation
            checkpointing), under every strategy: same gradients, less activation memory, about one
            more forward pass.
        compile: run the network through ``torch.compile``: ``true``, or a mapping of its
            keyword arguments such as ``{mode: max-autotune}``. Shapes are static unless it
            says ``dynamic``. Parameter names do not change, so checkpoints stay
            interchangeable with uncompiled runs.
        init_from: start from the weights of a torchvision ``resnet50`` state dict (ImageNet weights, say): each
            tensor of the same shape is loaded, the others (the classifier of another width, the first
            convolution under the CIFAR stem) keep their initial values, and the run says which.
            Only a new run reads it: a resumed one continues from its checkpoint.
    """

    hparams: AttributeDict  # what save_hyperparameters keeps, read by attribute

    def __init__(
        self,
        arch: str = DEFAULT_ARCH,
        num_classes: int = 10,
        batch_size: int = 128,
        image_size: int = 32,
        stem: Stem = "cifar",
        base_lr: float = 0.2,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 5e-4,
        no_decay_norm_bias: bool = True,
        warmup_epochs: float = 2.0,
        label_smoothing: float = 0.0,
        channels_last: bool = False,
        recompute_activations: bool = False,
        compile: bool | dict[str, Any] = False,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()  # the options as given, saved in checkpoints; read below as typed objects
        self.recipe = Recipe.of(self.hparams)
        self.recipe.check()
        self.network_options = NetworkOptions.of(self.hparams)
        # On the meta device until configure_model, where the strategy places each block (lazy_blocks).
        self.net = LazyBlocks(self.network_options.blocks())
        if not compile:
            # Two images of the run's size: the model summary shows sizes, and strategies time the blocks with
            # them. The summary's forward would make a compiled network compile once more, for 2 images.
            self.example_input_array = torch.zeros(2, *self.image_shape)
        self._compiled = False
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # Top-1: the share of images whose most probable class is right (torchmetrics' default is the mean over
        # classes), the accuracy plain loops and ``predict`` report. Training's is the step's own (training_step).
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        # Which classes the validation confuses (rows: the true class), over every process; read at its end
        # (``run.validation_report``). Without the check of the targets' values: a wait for the GPU per batch.
        self.val_confusion = MulticlassConfusionMatrix(num_classes, validate_args=False)
        self.val_worst = WorstImages()  # the validation images of highest loss

    @override
    def configure_model(self) -> None:
        self.net.materialize()
        if self.recipe.init_from and self._starts_training():
            rank_zero_info(load_torchvision_weights(self.net, self.recipe.init_from))
        if (trainer := self._trainer_if_any()) is not None and records_step_statistics(trainer):
            record_step_statistics(self.net, micro_batches=micro_batches_per_step(trainer))
        if self.hparams.channels_last:
            self.net.to(memory_format=torch.channels_last)
        if self.recipe.recompute_activations:
            recompute_blocks(self.net)
        compile_options = self.recipe.compile
        if compile_options and not self._compiled:
            options = {} if compile_options is True else dict(compile_options)
            self.net.compile(**{"dynamic": False, **options})  # in place: the state dict keeps its names
            self._compiled = True

    def _trainer_if_any(self) -> Trainer | None:
        try:
            return self.trainer
        except RuntimeError:  # built outside a Trainer
            return None

    def _starts_training(self) -> bool:
        """Whether this is a new training run (not a resumed one, nor evaluation)."""
        trainer = self._trainer_if_any()
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.ckpt_path is None

    @override
    def configure_callbacks(self) -> list[Callback]:
        return [ReplicaStatistics()]  # BatchNorm's statistics over replicas: the callback talks to the others

    def training_flops_per_image(self) -> int:
        """FLOPs of the forward and backward pass of one training image, counted with torch's flop
        counter on a copy of the network on the meta device (nothing is computed)."""
        net = nn.Sequential(*LazyBlocks(self.net.factories, seed=0))
        with torch.device("meta"):
            images = torch.zeros(2, *self.image_shape)  # BatchNorm in training mode needs two
        return measure_flops(net, lambda: net(images), lambda logits: logits.sum()) // 2

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """The shape of one input image: 3 channels, ``image_size`` square."""
        return self.network_options.image_shape

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    @property
    def global_batch_size(self) -> int:
        """Images per optimizer step over all processes: the batch the learning rate scales with."""
        trainer = self.trainer
        return global_batch_size(self.hparams.batch_size, data_parallel_size(trainer), trainer.accumulate_grad_batches)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Dropout and stochastic depth draw their masks from torch's generators, whose state no checkpoint keeps.
        # Seeded here from the run's seed, the step, the batch within the step and the process, they draw the same
        # masks in a run resumed from its checkpoint as in the run never stopped. The generators of the device types
        # the run uses only: ``torch.manual_seed`` also seeds those of accelerators not in use, each of which defers
        # the call with a copy of the stack (docs/speed.md, "Overhead per step").
        trainer = self.trainer
        within = batch_idx % trainer.accumulate_grad_batches
        key = f"{os.environ.get('PL_GLOBAL_SEED', '')}/{trainer.global_step}/{within}/{trainer.global_rank}"
        seed = random.Random(key).getrandbits(63)
        torch.default_generator.manual_seed(seed)
        device = trainer.strategy.root_device.type
        if device == "cuda":
            torch.cuda.manual_seed_all(seed)
        elif device != "cpu":
            torch.manual_seed(seed)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.log("train/loss", loss)  # the run's bar shows it (PacedProgressBar), read at log steps only
        # The step's top-1 as a tensor: torchmetrics' functional form, without the check of the targets' values
        # (torch.unique, a wait for the GPU between the forward and the backward pass; the data modules give class
        # indices in range), and logged as a tensor, which Lightning handles in a fraction of a Metric's time.
        accuracy = multiclass_accuracy(
            logits.detach(), y, self.network_options.num_classes, average="micro", validate_args=False
        )
        self.log("train/acc", accuracy)
        if is_log_step(self.trainer):  # a Python number logged becomes a tensor on the device: at log steps only
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], split: str, accuracy: MulticlassAccuracy) -> Tensor:
        x, y = batch
        logits = self(x)
        accuracy(logits, y)
        self.log(f"{split}/loss", self.criterion(logits, y), sync_dist=True, prog_bar=split == "val")
        self.log(f"{split}/acc", accuracy, prog_bar=split == "val")
        return logits

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits = self._eval_step(batch, "val", self.val_acc).detach()
        self.val_confusion.update(logits, batch[1])
        self.val_worst.update(batch[0], logits, batch[1])

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_acc)

    @override
    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """The logits of the batch's images (``PredictionWriter`` turns them into classes and probabilities)."""
        return self(batch[0])

    def _param_groups(self) -> list[dict]:
        if not self.recipe.no_decay_norm_bias:
            return [{"params": list(self.net.parameters())}]
        # BatchNorm weights and biases are the only parameters with fewer than 2 dimensions.
        decay = [p for p in self.net.parameters() if p.ndim > 1]
        no_decay = [p for p in self.net.parameters() if p.ndim <= 1]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        recipe, trainer = self.recipe, self.trainer
        groups = self._param_groups()
        optimizer = SGD(
            groups,
            lr=scaled_lr(recipe.base_lr, self.global_batch_size),
            momentum=recipe.momentum,
            nesterov=recipe.nesterov,
            weight_decay=recipe.weight_decay,
            fused=_fuses([param for group in groups for param in group["params"]], trainer) or None,
        )
        if math.isinf(trainer.estimated_stepping_batches):
            raise UsageError(LR_SCHEDULE_NEEDS_AN_END)
        total_steps = int(trainer.estimated_stepping_batches)
        if trainer.train_dataloader is None:  # not loaded yet when only max_steps bounds the run
            trainer.fit_loop.setup_data()
        steps_per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
        warmup_steps = min(total_steps, round(recipe.warmup_epochs * steps_per_epoch))
        scheduler = LambdaLR(optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def __getattr__(name: str) -> Any:
    return renamed_class(__name__, name, globals())
