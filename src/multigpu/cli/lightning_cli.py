"""The command line: LightningCLI with our model, data, run naming and checkpoints.

python main.py fit                                   # the recipe in configs/default.yaml
python main.py fit --config configs/smoke.yaml       # presets stack on the recipe
python main.py fit --config configs/smoke.yaml --ckpt_path last   # start or resume
"""

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from multigpu.checkpointing.elastic import torchrun_node_count
from multigpu.checkpointing.resume import ResumePoint, RunMetadata
from multigpu.checkpointing.saving import BestCheckpoints
from multigpu.checkpointing.stop_signals import CheckpointOnStopSignal, StopAllProcessesOnError
from multigpu.cli.config_files import resolve_data_dir, unreadable_config
from multigpu.cli.run_options import RunOptions, TrainerOptions
from multigpu.cli.saved_options import checkpoint_dir, follow_checkpoint
from multigpu.cli.trainer_assembly import assemble_trainer
from multigpu.cli.trainer_options import USUAL_STRATEGIES, check_trainer_options, precision_error
from multigpu.compat import CheckpointPathCLI
from multigpu.contracts import parallelism_of
from multigpu.data.datamodule import ImageDataModule
from multigpu.errors import UsageError, check_at_least, check_writable
from multigpu.model.classifier import ImageClassifier
from multigpu.renamed_options import add_old_names, move_to_new_names, new_names
from multigpu.run.fit_summary import FitSummary
from multigpu.run.gradient_norm import GradientNorm
from multigpu.run.replicas import accumulation_for, data_parallel_size
from multigpu.run.run_hparams import RunHparams
from multigpu.run.spawned_ranks import EndSpawnedProcessGroups
from multigpu.run.step_times import StepTimes
from multigpu.run.throughput import ThroughputSummary
from multigpu.run.validation_report import ValidationReport
from multigpu.strategies import name_to_class_path
from multigpu.trained.prediction_writer import PredictionWriter

__all__ = ["MultiGPUCLI"]

SUBCOMMANDS = ("fit", "validate", "test", "predict")


class OneLineErrorParser(LightningArgumentParser):
    """Reports a value the parser refuses in one ``error: ...`` line, without the usage text."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        if message.startswith('Parser key "trainer.precision"') and (given := re.search(r"Given value: (.*)", message)):
            print(f"error: {precision_error(given.group(1).strip())}", file=sys.stderr)  # not Lightning's types
            sys.exit(2)
        # jsonargparse spreads a refused value over several lines: the key, each expected type, the value.
        message = re.sub(r'^Parser key "([^"]+)":', r"--\1:", message)
        # argparse's words, which jsonargparse before 4.45 capitalises
        message = re.sub(r"^Unrecognized arguments:", "unrecognized arguments:", message)
        lines = [re.sub(r"^\s*(- )?", "", line).strip() for line in message.splitlines()]
        kept = [line for line in lines if line and not line.startswith(("Subtypes:", "Given value type:", "Errors:"))]
        print(f"error: {' '.join(kept)}{self._nearest_options(message)} (see --help)", file=sys.stderr)
        sys.exit(2)

    def _nearest_options(self, message: str) -> str:
        """``; did you mean --x?`` for each unrecognized option of ``message`` with a near valid one."""
        if not message.lower().startswith("unrecognized arguments:"):
            return ""
        known = _option_names(self)
        hints = []
        for arg in message.partition(":")[2].split():
            name = arg.partition("=")[0]
            if name.startswith("--") and (near := difflib.get_close_matches(name, known, n=1, cutoff=0.75)):
                hints.append(f"{name}: did you mean {near[0]}?")
        return f"; {'; '.join(hints)}" if hints else ""


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--option`` ``parser`` and its subcommands' parsers take."""
    names = []
    for action in parser._actions:  # argparse's list of what a parser takes; it has no public accessor
        names += [name for name in action.option_strings if name.startswith("--")]
        subcommands = action.choices if isinstance(action.choices, dict) else {}  # a subcommands action's parsers
        for subparser in subcommands.values():
            if isinstance(subparser, argparse.ArgumentParser):
                names += _option_names(subparser)
    return names


class MultiGPUCLI(CheckpointPathCLI):
    """LightningCLI for ``ImageClassifier`` on ``ImageDataModule``.

    Adds ``--run_name`` and ``--checkpoint_root``: checkpoints go to
    ``<checkpoint_root>/<run_name>/`` and TensorBoard logs to
    ``<trainer.default_root_dir>/<run_name>/version_N/``, next to the resolved
    ``config.yaml``. ``--ckpt_path`` is checked before anything is built, and a
    resumed ``fit`` continues the TensorBoard run of its checkpoint.
    """

    def __init__(self, default_config_files: Sequence[str | Path] = (), **kwargs) -> None:
        self._resumed: ResumePoint | None = None  # the checkpoint's point, on --ckpt_path
        self._options: RunOptions | None = None  # the run's own options, once the checkpoint's are taken
        self._command_line: list[str] = []  # as parsed: ``take_saved_options`` keeps what it gives
        # No option prefixes: --trainer.max_step=2 is refused, not taken as max_steps.
        defaults = {"default_config_files": [str(path) for path in default_config_files], "allow_abbrev": False}
        parser_kwargs = (
            {"allow_abbrev": False, **{name: defaults for name in SUBCOMMANDS}} if kwargs.get("run", True) else defaults
        )
        super().__init__(
            ImageClassifier,
            ImageDataModule,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={
                "callbacks": [
                    RunMetadata(),
                    CheckpointOnStopSignal(),
                    StopAllProcessesOnError(),
                    RunHparams(),
                    FitSummary(),
                    StepTimes(),
                    GradientNorm(),
                    EndSpawnedProcessGroups(),
                ]
            },
            parser_kwargs=parser_kwargs,
            parser_class=OneLineErrorParser,
            auto_configure_optimizers=False,
            **kwargs,
        )

    @override
    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Lightning's, in the order a user of this application reads them: the model's and the data's options, then
        the Trainer's; and the strategy's help names what users type."""
        assert self.model_class is not None and self.datamodule_class is not None  # this application's
        parser.add_lightning_class_args(self.model_class, "model")
        parser.add_lightning_class_args(self.datamodule_class, "data")
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults(
            {f"trainer.{key}": value for key, value in self.trainer_defaults.items() if key != "callbacks"}
        )
        for action in parser._actions:  # argparse's list of what a parser takes; it has no public accessor
            if action.dest == "trainer.strategy":
                action.help = (
                    f"How the devices share the work: {', '.join(USUAL_STRATEGIES)} (the README's table), or another "
                    "of Lightning's names or a Strategy class path. Default: auto (one device)."
                )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--run_name", type=str, default="resnet50-cifar10", help="Name of the run: its checkpoint and log folder."
        )
        parser.add_argument(
            "--checkpoint_root",
            type=str,
            default="checkpoints",
            help="Folder that holds one checkpoint folder per run.",
        )
        parser.add_argument(
            "--save_every_n_steps",
            type=int,
            default=0,
            help="Also write last.ckpt every N optimizer steps, so a killed run loses at most N steps "
            "(0: only at the end of each epoch).",
        )
        parser.add_argument(
            "--save_in_background",
            type=bool,
            default=True,
            help="Write checkpoint files in a thread of their own: a save holds training only while it copies the "
            "state to host memory (false: training waits for each file to be written).",
        )
        parser.add_argument(
            "--stall_timeout_s",
            type=float,
            default=300.0,
            help="Under several processes, end the job when none of them has made progress for this many seconds, "
            "naming the one that held it up and where each stood (0: never; torch's own timeout is 30 minutes).",
        )
        parser.add_lightning_class_args(ThroughputSummary, "throughput")
        parser.add_lightning_class_args(ValidationReport, "validation_report")
        parser.add_lightning_class_args(PredictionWriter, "predictions")
        parser.add_lightning_class_args(BestCheckpoints, "checkpoint")
        add_old_names(parser, "model")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/acc",
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 3,
                "checkpoint.save_last": True,
                "checkpoint.filename": "epoch{epoch:03d}-step{step}-val_acc{val/acc:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        parser.link_arguments(("checkpoint_root", "run_name"), "checkpoint.dirpath", compute_fn=checkpoint_dir)
        # The batch size's one home is the data module: the model gets it as it is built, as the class count.
        parser.link_arguments("data.batch_size", "model.batch_size", apply_on="instantiate")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.image_size", "model.image_size", apply_on="instantiate")

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        if args is None or isinstance(args, (list, tuple)):
            # `--trainer.strategy=manual_model_parallel --trainer.strategy.balance=[9,9]` reads as the class.
            self._command_line = new_names(name_to_class_path(sys.argv[1:] if args is None else args))
            if broken := unreadable_config(self._command_line):  # the parser would name no file
                raise UsageError(f"--config {broken}: the file is not valid YAML; mend it.")
            self.config = parser.parse_args(self._command_line)
        else:
            super().parse_arguments(parser, args)
        # Old names from a config file: moved to the new ones before the checkpoint's options are compared and
        # the model is built (its hyperparameters are this config).
        move_to_new_names(self._config(), self._command_line)
        resolve_data_dir(self._config(), self._command_line)

    def _subcommand(self) -> str | None:
        """The subcommand, or ``None`` with ``run=False``."""
        return self.config.get("subcommand")

    def _config(self, instantiated: bool = False):
        """This run's configuration: the subcommand's, or the whole one with ``run=False``; with ``instantiated``,
        its classes instantiated."""
        config = self.config_init if instantiated else self.config
        subcommand = self._subcommand()
        return config[subcommand] if subcommand else config

    @override
    def resolve_checkpoint_path(self) -> None:
        # In place of Lightning's reading of --ckpt_path (``follow_checkpoint`` says why).
        subcommand = self._subcommand()
        self._resumed = follow_checkpoint(self._config(), subcommand, self._command_line)
        if self._resumed is not None and subcommand != "fit":  # its log folder keeps the run's own config.yaml
            self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": f"{subcommand}-config.yaml"}

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except UsageError:
            raise
        except ValueError as error:
            # jsonargparse reports a class that refused its arguments (our strategies' checks among them)
            # as a value that matched none of the accepted types, with each type's reason on a line "- ...".
            reasons = [line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- ")]
            reasons = [reason for reason in reasons if not reason.startswith("Expected a")]
            if not reasons:
                raise
            raise UsageError("; ".join(reasons)) from error

    @override
    def before_instantiate_classes(self) -> None:
        # Before the data module, which may download CIFAR-10, and the model are built.
        config = self._config()
        options = RunOptions.of(config)
        check_trainer_options(options.trainer)
        nodes = torchrun_node_count()
        if nodes is not None and nodes != (options.trainer.num_nodes or 1):
            # torchrun has started the processes: an elastic run has as many nodes as are left.
            rank_zero_info(f"torchrun started {nodes} node(s): --trainer.num_nodes={nodes}.")
            config["trainer.num_nodes"] = nodes
            options = RunOptions.of(config)
        check_at_least("--save_every_n_steps", options.save_every_n_steps or 0, 0)
        check_at_least("--stall_timeout_s", options.stall_timeout_s or 0, 0)
        # Where the run will write, checked before minutes go into building and training.
        writes = {
            "--checkpoint_root": options.checkpoint_root,
            "--trainer.default_root_dir": options.trainer.log_root,
            "--predictions.path": options.predictions_path,
        }
        for option, path in writes.items():
            if path:
                check_writable(option, path)
        options.recipe.check()
        self._options = options

    def before_validate(self) -> None:
        """Let the strategy refuse the model before it launches any process."""
        parallelism_of(self.trainer).check_model(self.model)

    before_test = before_predict = before_validate

    def before_fit(self) -> None:
        """Let the strategy refuse the model, and what only training cannot run, before it launches any process;
        make the accumulated batches give ``--data.global_batch_size`` on this layout."""
        self.before_validate()
        parallelism_of(self.trainer).check_training(self.model)
        global_batch_size = self.datamodule.options.global_batch_size
        if global_batch_size is not None:
            trainer = self.trainer
            accumulation = accumulation_for(global_batch_size, self.datamodule.batch_size, data_parallel_size(trainer))
            if trainer.accumulate_grad_batches not in (1, accumulation):
                raise UsageError(
                    f"--trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} and "
                    f"--data.global_batch_size={global_batch_size} disagree on this layout, which needs {accumulation} "
                    "accumulated batches for that global batch: drop --trainer.accumulate_grad_batches."
                )
            trainer.accumulate_grad_batches = accumulation

    @override
    def instantiate_trainer(self, **kwargs) -> Trainer:
        chosen = TrainerOptions.of(self._config(instantiated=True)["trainer"]).callbacks or []
        build = super().instantiate_trainer
        resumed, self._resumed = self._resumed, None  # the checkpoint it read is the trainer's alone from here
        assert self._options is not None  # taken before the classes are built
        return assemble_trainer(build, self._options, chosen if isinstance(chosen, list) else [chosen], resumed,
                                **kwargs)  # fmt: skip
