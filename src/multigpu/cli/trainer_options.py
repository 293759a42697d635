"""Checks of the Trainer's accelerator, devices and strategy, made before anything is built.

Lightning checks these too, but only when the Trainer is built (after the data module
and the model), some with a traceback (``devices=-3`` on the CPU) and some over two
lines (more GPUs than the machine has). These say in one line what to pass instead.
"""

import difflib
from typing import Any

from lightning.pytorch.accelerators import (
    Accelerator,
    AcceleratorRegistry,
    CUDAAccelerator,
    MPSAccelerator,
    XLAAccelerator,
)
from lightning.pytorch.strategies import StrategyRegistry

from multigpu.cli.run_options import TrainerOptions
from multigpu.errors import UsageError, check_at_least
from multigpu.model.classifier import LR_SCHEDULE_NEEDS_AN_END
from multigpu.strategies import SPECS

__all__ = ["USUAL_STRATEGIES", "accelerator_name", "check_trainer_options", "device_request"]

USUAL_STRATEGIES = tuple(spec.name for spec in SPECS)
"""The strategies users type, in the order of the README's table."""

# Lightning's names of the precisions the recipe trains in ("16" and "bf16" are its short forms).
_PRECISIONS = {"32", "32-true", "16", "16-mixed", "bf16", "bf16-mixed"}


def precision_error(precision: Any) -> str:
    """Why ``--trainer.precision`` cannot be ``precision``, and the precisions to choose from."""
    return (
        f"--trainer.precision={precision} is not one this application trains in: use 32-true, 16-mixed "
        "(CUDA; bf16-mixed on the CPU) or bf16-mixed."
    )


def check_trainer_options(trainer: TrainerOptions) -> None:
    """Refuse an unknown strategy or accelerator, a device request this machine cannot meet, a
    precision the recipe does not train in, or counts and limits that mean nothing."""
    _check_strategy(trainer.strategy)
    if trainer.precision is not None and str(trainer.precision) not in _PRECISIONS:
        raise UsageError(precision_error(trainer.precision))
    if isinstance(trainer.accumulate_grad_batches, int):
        check_at_least("--trainer.accumulate_grad_batches", trainer.accumulate_grad_batches, 1)
    if isinstance(trainer.gradient_clip_val, (int, float)):
        check_at_least("--trainer.gradient_clip_val", trainer.gradient_clip_val, 0)
    for option, minimum in (("check_val_every_n_epoch", 1), ("num_nodes", 1), ("max_epochs", -1), ("max_steps", -1)):
        if isinstance(value := getattr(trainer, option), int):
            check_at_least(f"--trainer.{option}", value, minimum)
    if trainer.max_epochs == -1 and trainer.max_steps in (None, -1):
        raise UsageError(LR_SCHEDULE_NEEDS_AN_END)
    accelerator = accelerator_name(trainer.accelerator)
    if accelerator is not None:
        _check_devices(accelerator, trainer.devices)


def _check_strategy(strategy: Any) -> None:
    # Strategy objects and class paths are Lightning's and jsonargparse's to check.
    if not isinstance(strategy, str) or "." in strategy or strategy.lower() in ("auto", *StrategyRegistry):
        return
    name = strategy.lower()
    near = difflib.get_close_matches(name, USUAL_STRATEGIES, n=2) or difflib.get_close_matches(
        name, StrategyRegistry.available_strategies(), n=1
    )
    hint = f" (did you mean {' or '.join(near)}?)" if near else ""
    raise UsageError(
        f"--trainer.strategy={strategy} is not a strategy{hint}: use {', '.join(USUAL_STRATEGIES)}, or another of "
        "Lightning's registered names."
    )


def auto_accelerator() -> str:
    """The accelerator ``auto`` selects, in Lightning's order: TPU, then MPS, then CUDA, else the CPU."""
    for name, accelerator in (("tpu", XLAAccelerator), ("mps", MPSAccelerator), ("cuda", CUDAAccelerator)):
        if accelerator.is_available():
            return name
    return "cpu"


def _registered_accelerator(name: str) -> type[Accelerator]:
    """The accelerator class Lightning registers as ``name``."""
    return AcceleratorRegistry[name]["accelerator"]


def accelerator_name(accelerator: Any) -> str | None:
    """The registered accelerator that ``accelerator`` selects, checked to be usable here."""
    if not isinstance(accelerator, str):
        return None  # an Accelerator object: Lightning checks it
    name = accelerator.lower()
    if name == "auto":
        return auto_accelerator()
    if name == "gpu":
        name = "mps" if MPSAccelerator.is_available() else "cuda"
    if name not in AcceleratorRegistry:
        known = ", ".join(["auto", "gpu", *sorted(AcceleratorRegistry.available_accelerators())])
        raise UsageError(f"--trainer.accelerator={accelerator} is not an accelerator: use one of {known}.")
    accelerator_class = _registered_accelerator(name)
    try:
        available = accelerator_class.is_available()
    except Exception:  # e.g. XLA's check when torch_xla is not installed
        available = False
    if not available:
        raise UsageError(
            f"--trainer.accelerator={accelerator}: {accelerator_class.__name__} is not available on this "
            f"machine; use --trainer.accelerator={auto_accelerator()}, or auto."
        )
    return name


def device_request(devices: Any) -> int | list[int] | str:
    """``devices`` as Lightning reads it: ``"auto"``, a count, or a list of device indices."""
    if isinstance(devices, (int, list, tuple)) and not isinstance(devices, bool):
        request = devices if isinstance(devices, int) else list(devices)
    elif isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return text
        parts = [part.strip() for part in text.strip("[]").split(",") if part.strip()]
        try:
            numbers = [int(part) for part in parts]
        except ValueError:
            numbers = []
        if not numbers:
            raise UsageError(
                f"--trainer.devices={devices} is not a device request: pass a count such as 2, auto, "
                f"or GPU indices such as [0,1]."
            )
        request = numbers if "," in text or text.startswith("[") else numbers[0]
    else:
        raise UsageError(f"--trainer.devices={devices} is not a device request: pass a count such as 2, or auto.")
    if isinstance(request, list) and (not request or not all(isinstance(index, int) for index in request)):
        raise UsageError(f"--trainer.devices={devices}: list device indices as whole numbers, such as [0,1].")
    return request


def _check_devices(accelerator: str, devices: Any) -> None:
    request = device_request(devices)
    if isinstance(request, str):  # "auto"
        return
    # The CPU runs as many processes as asked for; the others have a fixed number of devices.
    available = None if accelerator == "cpu" else _registered_accelerator(accelerator).auto_device_count()
    if isinstance(request, int):
        if request == -1 and available is not None:
            return  # every device
        if request < 1:
            every = ", -1 for every device" if available is not None else ""
            raise UsageError(
                f"--trainer.devices={devices} is not a number of devices: pass a positive count{every}, or auto."
            )
        if available is not None and request > available:
            raise UsageError(
                f"--trainer.devices={devices} asks for {request} {accelerator} devices, but this machine has "
                f"{available}: pass at most {available}, or auto."
            )
        return
    if available is None:
        raise UsageError(
            f"--trainer.devices={devices} lists device indices, which only GPUs have: on the CPU pass a "
            f"number of processes, such as 2."
        )
    missing = [index for index in request if not 0 <= index < available]
    if missing:
        raise UsageError(
            f"--trainer.devices={devices} names {accelerator} device {missing[0]}, which this machine does not "
            f"have: it has {available}, numbered 0 to {available - 1}."
        )
