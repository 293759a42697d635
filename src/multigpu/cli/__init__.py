"""The command line: ``python main.py fit | validate | test | predict | export`` (``plan``'s is ``multigpu.planning``;
``multigpu.commands`` sends each command to its own).

lightning_cli     MultiGPUCLI: LightningCLI with the project's links, checks and run folders
run_options       RunOptions, TrainerOptions: a command's config, read once into typed options
trainer_options   checks of the trainer's options before anything is built
export_command    ``export``'s options and lines (what it writes: ``multigpu.trained.export``)
saved_options     ``--ckpt_path`` followed before anything is built; a checkpoint's own options for the commands on it
trainer_assembly  the run's Trainer: logger, progress bar, model summary, atomic checkpoint files, last.ckpt
config_files      the ``--config`` files: a relative data path relative to its file, a file that is not YAML
quiet_console     Lightning's advertisements and others' warnings kept off the console
"""

__all__ = [
    "config_files",
    "export_command",
    "lightning_cli",
    "quiet_console",
    "run_options",
    "saved_options",
    "trainer_assembly",
    "trainer_options",
]
