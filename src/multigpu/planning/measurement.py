"""``plan``'s measurements: the time of each block (to balance the split layouts), then each layout trained in
fresh processes through ``main.py fit``, its figures scraped from what the run writes."""

import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from multigpu.data import CIFAR10DataModule
from multigpu.errors import UsageError
from multigpu.lazy_blocks import LazyBlocks
from multigpu.model import IMAGE_SHAPE
from multigpu.network import resnet50_block_factories
from multigpu.partition import balance_by_cost
from multigpu.planning.layouts import Layout, Refusal
from multigpu.planning.options import without_plan_options
from multigpu.planning.report import Outcome
from multigpu.planning.selection import Setting
from multigpu.strategies.block_measures import block_times_in, micro_batch_refusal
from multigpu.timed_runs import RunFailed, fit_command, run, step_timer

__all__ = ["LAYOUT_TIMEOUT_S", "balanced", "measure"]

LAYOUT_TIMEOUT_S = 1200  # a layout still training after 20 minutes has hung (a deadlock, say): it is stopped


def balanced(layouts: list[Layout], setting: Setting, config) -> tuple[list[Layout], list[Refusal]]:
    """The split layouts with the balance that evens out their blocks' measured time, as ``balance_by: time``
    would choose it in each run; timed once per micro-batch size, on the first device. Those whose
    micro-batches cannot train (BatchNorm given one value per channel) are refused."""
    device = torch.device("cuda", (setting.device_ids or [0])[0]) if setting.cuda else torch.device("cpu")
    blocks = LazyBlocks(resnet50_block_factories(CIFAR10DataModule.num_classes, config["model"]["stem"]))
    precision = _precision_plugin(setting.precision, device)
    times: dict[tuple[int, int], list[float] | str] = {}  # by micro-batch size and count
    balanced, refusals = [], []
    for layout in layouts:
        if layout.num_stages > 1:
            images = layout.batch_size // layout.micro_batches
            key = (images, layout.micro_batches)
            if key not in times:
                times[key] = _block_times(blocks, precision, device, images, layout.micro_batches)
            if isinstance(times[key], str):
                refusals.append(Refusal(layout.label, times[key]))
                continue
            layout = replace(layout, balance=tuple(balance_by_cost(times[key], layout.num_stages)))
        balanced.append(layout)
    if setting.cuda:
        torch.cuda.empty_cache()
    return balanced, refusals


def _block_times(
    blocks: LazyBlocks, precision: Precision, device: torch.device, images: int, micro_batches: int
) -> list[float] | str:
    """The time of each block for ``micro_batches`` micro-batches of ``images`` images, or why there is none."""
    if why := micro_batch_refusal(blocks, IMAGE_SHAPE, images):
        return f"micro-batches of {images} image(s) do not train: {why}"
    print(f"timing the blocks for {micro_batches} micro-batch(es) of {images} images", flush=True)
    try:
        return block_times_in(precision, blocks, torch.zeros(images, *IMAGE_SHAPE), device, micro_batches)
    except RuntimeError as error:  # out of memory, say
        return f"timing its blocks failed: {str(error).splitlines()[0]}"


def _precision_plugin(precision: str, device: torch.device) -> Precision:
    """Lightning's precision plugin for ``--trainer.precision`` on ``device``: 16-bit mixed precision is
    bf16 on the CPU, as Lightning makes it there."""
    name = {"16": "16-mixed", "bf16": "bf16-mixed"}.get(precision, precision)
    if name in ("32", "32-true"):
        return Precision()
    return MixedPrecision("bf16-mixed" if device.type == "cpu" else name, device.type)


def measure(
    outcomes: list[Outcome], args: Sequence[str], setting: Setting, warmup: int, steps: int, accumulate: int
) -> list[Outcome]:
    """Train each layout in fresh processes; its figures, or why it failed."""
    entry = Path(sys.argv[0]).resolve()
    if entry.suffix != ".py":
        raise UsageError("run plan as `python main.py plan ...`: it launches main.py fit for each layout.")
    user_args = without_plan_options(args)
    images = setting.batch_size * setting.devices * accumulate * (warmup + steps + 1)
    measured = []
    with tempfile.TemporaryDirectory(prefix="multigpu-plan-") as tmp:
        folder = Path(tmp)
        for index, outcome in enumerate(outcomes):
            out = folder / f"layout{index}.json"
            options = [*user_args, *outcome.layout.fit_options(setting.device_ids)]
            command = fit_command(
                entry, options, folder, f"plan-{index}", warmup + steps, images, step_timer(warmup, out)
            )
            try:
                outcome = replace(
                    outcome, figures=run(command, out, folder / f"layout{index}.log", timeout=LAYOUT_TIMEOUT_S)
                )
                said = f"{outcome.figures['images_per_s']:.1f} img/s"
            except RunFailed as failure:
                log = (folder / f"layout{index}.log").read_text()
                outcome = replace(
                    outcome,
                    failure=_last_error(log)
                    if "still running" not in str(failure)
                    else f"still training after {LAYOUT_TIMEOUT_S} s: stopped",
                )
                said = f"failed: {outcome.failure}"
            print(f"  [{index + 1}/{len(outcomes)}] {outcome.layout.label}: {said}", flush=True)
            measured.append(outcome)
    return measured


def _last_error(log: str) -> str:
    """The line of a failed run's output that says what went wrong."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line.split(":", 1)[0]:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
