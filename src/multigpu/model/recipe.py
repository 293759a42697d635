"""The training recipe: the optimizer's, the learning-rate schedule's and the loss's settings of ``--model.*``, held
and checked together (``Recipe``), by the CLI before it builds anything and by the model when it is built."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multigpu.errors import UsageError, check_at_least
from multigpu.model.torchvision_weights import read_state_dict
from multigpu.typed_options import options_of

__all__ = ["Recipe"]


@dataclass(frozen=True)
class Recipe:
    """The options of ``ImageClassifier`` that say how it trains, with its defaults (its docstring says what each
    means)."""

    base_lr: float = 0.2
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    no_decay_norm_bias: bool = True
    warmup_epochs: float = 2.0
    label_smoothing: float = 0.0
    recompute_activations: bool = False
    compile: bool | dict[str, Any] = False
    init_from: str | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> "Recipe":
        """The recipe among a model's options (``--model.*``, or the hyperparameters of a model or checkpoint)."""
        return options_of(cls, options)

    def check(self) -> None:
        """Refuse optimizer and loss settings that mean nothing, and a weights file that is not there, in one line
        each."""
        if self.init_from is not None:
            read_state_dict(self.init_from)
        for option in ("base_lr", "momentum", "weight_decay", "warmup_epochs"):
            check_at_least(f"model.{option}", getattr(self, option), 0)
        check_at_least("model.label_smoothing", self.label_smoothing, 0, below=1)
        if self.nesterov and self.momentum == 0:
            raise UsageError(
                "model.nesterov=true needs model.momentum above 0: add --model.nesterov=false for plain SGD."
            )
        if self.recompute_activations and self.compile:
            raise UsageError(
                "model.recompute_activations=true does not run under model.compile (torch.compile refuses "
                "torch.utils.checkpoint's context_fn, which keeps BatchNorm's statistics exact): drop one of them."
            )
