"""Every file in configs/ parses and builds, stacked on the recipe as a user stacks it."""

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from helpers import DEFAULT_CONFIG, REPO, SMOKE, run_args
from lightning.fabric.utilities.rank_zero import LightningDeprecationWarning
from lightning.pytorch.strategies import DDPStrategy

from multigpu.cli.lightning_cli import MultiGPUCLI
from multigpu.data.data_options import DataOptions
from multigpu.data.datamodule import ImageDataModule
from multigpu.model.classifier import ImageClassifier
from multigpu.model.network_options import NetworkOptions
from multigpu.model.recipe import Recipe
from multigpu.strategies import FullyShardedStrategy

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
# Lets a config that reads CIFAR-10 build without the dataset on this machine.
OFFLINE = ["--data.synthetic=true"]


def _build(tmp_path: Path, *args: str) -> MultiGPUCLI:
    return MultiGPUCLI(default_config_files=[DEFAULT_CONFIG], run=False, args=[*args, *run_args(tmp_path), *OFFLINE])


def test_configs_folder_holds_the_documented_presets():
    assert {"default.yaml", "smoke.yaml", "ddp.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_builds_model_data_and_trainer(config, tmp_path):
    cli = _build(tmp_path, "--config", str(config), "--trainer.accelerator=cpu")
    assert isinstance(cli.model, ImageClassifier) and isinstance(cli.datamodule, ImageDataModule)
    # The links: batch size and class count come from the data module.
    assert cli.model.hparams.batch_size == cli.datamodule.batch_size
    assert cli.model.hparams.num_classes == cli.datamodule.num_classes == 10
    assert cli.trainer.checkpoint_callback.dirpath == str(tmp_path / "checkpoints" / "test")


def test_a_relative_data_path_in_a_config_file_is_relative_to_the_file_from_any_folder(tmp_path, monkeypatch):
    """configs/subset.yaml names the subset beside the project wherever the command runs; a data path on the command
    line after it, or configs/default.yaml's, stays relative to where the command runs."""
    monkeypatch.chdir(tmp_path)
    subset = str(REPO / "configs" / "subset.yaml")
    cli = _build(tmp_path, "--config", subset, "--trainer.accelerator=cpu")
    assert cli.datamodule.hparams.data_dir == str(REPO.parent / "shared" / "data" / "cifar10-subset")
    cli = _build(tmp_path, "--config", subset, "--data.data_dir=mine", "--trainer.accelerator=cpu")
    assert cli.datamodule.hparams.data_dir == "mine"
    assert _build(tmp_path, "--trainer.accelerator=cpu").datamodule.hparams.data_dir == "data"


def test_the_old_name_of_the_recomputation_option_still_works_with_a_deprecation_line(tmp_path):
    old_config = tmp_path / "old.yaml"
    old_config.write_text("model:\n  activation_checkpointing: true\n")
    for args, recomputes in (
        (["--model.activation_checkpointing=true"], True),
        (["--config", str(old_config)], True),
        (["--model.activation_checkpointing=true", "--model.recompute_activations=false"], False),  # the later wins
        (["--config", str(old_config), "--model.recompute_activations=false"], False),  # the command line wins
    ):
        with pytest.warns(LightningDeprecationWarning, match="use --model.recompute_activations"):
            cli = _build(tmp_path, "--config", SMOKE, *args)
        assert cli.model.hparams.recompute_activations is recomputes, args
        assert "activation_checkpointing" not in cli.model.hparams  # checkpoints keep the new name only


def test_ddp_config_builds_two_cpu_processes(tmp_path):
    cli = _build(
        tmp_path, "--config", str(REPO / "configs" / "ddp.yaml"), "--trainer.accelerator=cpu", "--trainer.devices=2"
    )
    assert isinstance(cli.trainer.strategy, DDPStrategy) and cli.trainer.num_devices == 2


def test_fsdp_config_builds_our_sharded_strategy_on_two_cpu_processes(tmp_path):
    fsdp = ["--config", str(REPO / "configs" / "fsdp.yaml"), "--trainer.accelerator=cpu"]
    cli = _build(tmp_path, *fsdp, "--trainer.devices=2")
    assert isinstance(cli.trainer.strategy, FullyShardedStrategy) and cli.trainer.num_devices == 2
    # Its options on the command line, as the config's comments show (HSDP: 2 replicas of 2 shards).
    cli = _build(tmp_path, *fsdp, "--trainer.devices=4", "--trainer.strategy.shard_size=2")
    assert cli.trainer.strategy.shard_size == 2 and cli.trainer.strategy.mesh_shape(4) == (2, 2)


@pytest.mark.parametrize(("section", "component"), [("model", ImageClassifier), ("data", ImageDataModule)])
def test_the_code_defaults_are_the_recipe(section, component):
    """Code that builds the model or the data module without the CLI trains the recipe of configs/default.yaml."""
    recipe = yaml.safe_load(DEFAULT_CONFIG.read_text())[section]
    defaults = {name: parameter.default for name, parameter in inspect.signature(component).parameters.items()}
    assert {key: defaults[key] for key in recipe} == recipe


def test_the_typed_options_handed_inward_keep_the_defaults_users_see():
    """``DataOptions`` holds every ``--data.*`` option with ``ImageDataModule``'s default, and ``Recipe`` and
    ``NetworkOptions`` the ``--model.*`` options each holds with ``ImageClassifier``'s: the typed objects the CLI's
    flat options become say what its schema says (an old checkpoint without an option gets that default)."""

    def defaults(cls: type) -> dict:
        return {name: parameter.default for name, parameter in inspect.signature(cls).parameters.items()}

    def fields(cls: type) -> dict:
        return {field.name: field.default for field in dataclasses.fields(cls)}

    assert fields(DataOptions) == defaults(ImageDataModule)
    model = defaults(ImageClassifier)
    for typed in (Recipe, NetworkOptions):
        assert fields(typed) == {name: model[name] for name in fields(typed)}
