"""The command line: ``python main.py fit | validate | test | predict | plan | export``.

commands          the entry point: which command runs, and errors as one line
lightning_cli     MultiGPUCLI: LightningCLI with the project's links, checks and run folders
trainer_options   checks of the trainer's options before anything is built
"""

__all__ = ["commands", "lightning_cli", "trainer_options"]
