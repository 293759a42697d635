"""The options of a command as they enter from its parsed config: ``RunOptions`` (the run's own, ``--run_name`` and
the rest, with its ``--trainer.*``, ``--data.*`` and ``--model.*``) and ``TrainerOptions`` (the ``--trainer.*`` this
application reads), each made once from the config's sections (``options_of``) and read by attribute. The config
itself stays what LightningCLI builds the classes from."""

from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from multigpu.data.data_options import DataOptions
from multigpu.model.network_options import NetworkOptions
from multigpu.model.recipe import Recipe
from multigpu.typed_options import options_of

__all__ = ["RunOptions", "TrainerOptions"]


@dataclass(frozen=True)
class TrainerOptions:
    """The ``--trainer.*`` options this application reads or checks before Lightning does (Lightning's docs say what
    each means); ``None`` where a config leaves one out."""

    strategy: Any = "auto"
    accelerator: Any = "auto"
    devices: Any = "auto"
    num_nodes: int | None = None
    precision: Any = None
    accumulate_grad_batches: Any = None
    gradient_clip_val: Any = None
    check_val_every_n_epoch: Any = None
    max_epochs: int | None = None
    max_steps: int | None = None
    max_time: Any = None
    default_root_dir: str | None = None
    logger: Any = None
    plugins: Any = None
    profiler: Any = None
    enable_checkpointing: bool | None = None
    sync_batchnorm: bool | None = None
    callbacks: Any = None

    @classmethod
    def of(cls, trainer: Any) -> "TrainerOptions":
        """The options of a config's ``trainer`` section."""
        return options_of(cls, trainer)

    @property
    def log_root(self) -> str:
        """Where TensorBoard's runs go: ``--trainer.default_root_dir``, ``logs`` by default."""
        return self.default_root_dir or "logs"


@dataclass(frozen=True)
class RunOptions:
    """A command's own options (``MultiGPUCLI.add_arguments_to_parser`` says what each means), with its trainer's."""

    run_name: str = "resnet50-cifar10"
    checkpoint_root: str = "checkpoints"
    ckpt_path: str | None = None
    weights_only: bool | None = None
    save_every_n_steps: int | None = 0
    save_in_background: bool = True
    stall_timeout_s: float = 300.0
    predictions: Any = None
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    data: DataOptions = field(default_factory=DataOptions)
    network: NetworkOptions = field(default_factory=NetworkOptions)
    recipe: Recipe = field(default_factory=Recipe)

    @classmethod
    def of(cls, config: Any) -> Self:
        """The options of a subcommand's ``config``, as it stands: made again after a checkpoint's are put in it."""
        model = config["model"]
        return options_of(
            cls,
            config,
            trainer=TrainerOptions.of(config["trainer"]),
            data=DataOptions.of(config["data"]),
            network=NetworkOptions.of(model),
            recipe=Recipe.of(model),
        )

    @property
    def predictions_path(self) -> str | None:
        """``--predictions.path``, where the command has the section."""
        return (self.predictions or {}).get("path")
