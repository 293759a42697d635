"""``StrategySpec``: one record per strategy, the source of every list of strategies in the project.

Each strategy's package states its own (its ``SPECS``), and ``multigpu.strategies.SPECS`` gathers them from the packages
named in ``PACKAGES``, one name each.
From that list come Lightning's registry of our names, the names the CLI suggests, the strategies ``plan`` asks
for layouts, and the README's table of strategies.
"""

import inspect
from dataclasses import dataclass

from lightning.pytorch.strategies import Strategy

from multigpu.strategies.layout import Layout

__all__ = ["PUBLIC_MODULE", "StrategySpec"]

PUBLIC_MODULE = "multigpu.strategies"
"""Where a config file finds our strategy classes (``class_path: multigpu.strategies.<class>``)."""


@dataclass(frozen=True)
class StrategySpec:
    """A strategy as the rest of the project knows it.

    Attributes:
        name: what ``--trainer.strategy=`` takes.
        runs: what runs, in a few words (the README's table).
        details: the page of the docs that says more, as a Markdown link (``""``: none).
        layout: what it tells ``plan`` (its ``Layout`` subclass); ``None``: ``plan`` does not try it.
        strategy: our Lightning strategy class; ``None``: Lightning's own strategy under ``name``.
        as_instance: the Trainer is given an instance, not the name (Lightning reads some names as its own
            strategies' before its registry: ``fsdp`` as its CUDA-only FSDP1).
    """

    name: str
    runs: str
    details: str = ""
    layout: type[Layout] | None = None
    strategy: type[Strategy] | None = None
    as_instance: bool = False

    def __post_init__(self) -> None:
        if self.layout is not None:  # the layouts' name and class in a config file are the spec's
            self.layout.strategy, self.layout.class_path = self.name, self.class_path

    @property
    def class_path(self) -> str | None:
        """``class_path`` of the strategy in a config file; ``None`` for Lightning's own."""
        return None if self.strategy is None else f"{PUBLIC_MODULE}.{self.strategy.__name__}"

    @property
    def options(self) -> list[str]:
        """The options ``--trainer.strategy.<option>`` takes: our class's parameters."""
        return [] if self.strategy is None else list(inspect.signature(self.strategy).parameters)

    def table_row(self) -> str:
        """Its row in the README's table of strategies."""
        return f"| `{self.name}` | {self.runs} | {self.details} |"
