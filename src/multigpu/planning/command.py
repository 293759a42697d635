"""``python main.py plan``: measure every layout these devices allow, rank them, and write the fastest as a config.

    python main.py plan --trainer.devices=4                          # every layout of 4 GPUs
    python main.py plan --config configs/smoke.yaml --trainer.accelerator=cpu --trainer.devices=2
    python main.py plan --trainer.devices=4 --plan.strategies=[ddp,pipeline] --plan.dry_run=true

It takes ``fit``'s options. For each layout (``layouts``) it estimates the memory of each
device from the network on the meta device (``memory_estimate``) and leaves out, saying so,
what would not fit; it then trains each remaining layout in fresh processes through
``main.py fit`` on synthetic data of CIFAR-10's shape, for warm-up and timed steps
(``multigpu.timed_runs``, as the benchmarks do), and ranks them by images per second
(``report``). Split layouts (model and pipeline parallel) are balanced by the time of each
block, measured once here on the first device, and run with that balance.
"""

import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import yaml
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from multigpu.cli import MultiGPUCLI
from multigpu.data import CIFAR10DataModule
from multigpu.errors import UsageError, check_at_least
from multigpu.model import IMAGE_SHAPE
from multigpu.network import resnet50_block_factories
from multigpu.deferred_blocks import DeferredBlocks
from multigpu.partition import balance_by_cost
from multigpu.planning.layouts import STRATEGIES, Layout, Refusal, candidate_layouts
from multigpu.planning.memory_estimate import BlockMemory, block_memory, estimate
from multigpu.planning.report import Outcome, print_report, write_outputs
from multigpu.strategies.network_lookup import block_times_in, micro_batch_refusal
from multigpu.strategies.pipeline_layout import SCHEDULES
from multigpu.timed_runs import RunFailed, fit_command, run, step_timer
from multigpu.trainer_options import accelerator_name, device_request

__all__ = ["PlanOptions", "plan"]

MIB = 2**20
LAYOUT_TIMEOUT_S = 1200  # a layout still training after 20 minutes has hung (a deadlock, say): it is stopped


class PlanOptions:
    """What ``plan`` tries, and how long it trains each layout.

    Args:
        warmup: untimed optimizer steps first (default: 10 on GPUs, 2 on the CPU).
        steps: timed optimizer steps (default: 20 on GPUs, 3 on the CPU).
        strategies: the strategies to try besides one device, which is always measured (the reference).
        schedules: the pipeline schedules to try.
        micro_batches: the micro-batch counts a pipeline of P processes tries (default P, 2P and 4P).
        activation_checkpointing: ``auto`` tries it only for the layouts that would not fit without it
            (it adds a forward pass per step and saves only memory); ``both``, ``no`` or ``yes``.
        memory_per_device: GiB each device may use (on the CPU: each process), instead of the free memory.
        dry_run: list the layouts, the ones left out and the memory estimates, and train none.
    """

    def __init__(
        self,
        warmup: int | None = None,
        steps: int | None = None,
        strategies: list[str] = list(STRATEGIES),
        schedules: list[str] = list(SCHEDULES),
        micro_batches: list[int] | None = None,
        activation_checkpointing: Literal["auto", "both", "no", "yes"] = "auto",
        memory_per_device: float | None = None,
        dry_run: bool = False,
    ) -> None:
        for option, value in (("warmup", warmup), ("steps", steps)):
            if value is not None:
                check_at_least(f"--plan.{option}", value, 1 if option == "steps" else 0)
        if memory_per_device is not None and memory_per_device <= 0:
            raise UsageError(f"--plan.memory_per_device must be more than 0 GiB, not {memory_per_device}.")
        for count in micro_batches or ():
            check_at_least("--plan.micro_batches", count, 1)
        if unknown := [name for name in schedules if name.lower() not in SCHEDULES]:
            raise UsageError(f"--plan.schedules: {unknown[0]!r} is not one of {', '.join(SCHEDULES)}.")
        if unknown := [name for name in strategies if name not in STRATEGIES]:
            raise UsageError(f"--plan.strategies: {unknown[0]!r} is not one of {', '.join(STRATEGIES)}.")
        self.warmup, self.steps, self.strategies, self.schedules = warmup, steps, strategies, schedules
        self.micro_batches, self.checkpointing = micro_batches, activation_checkpointing
        self.memory_per_device, self.dry_run = memory_per_device, dry_run


class PlanCLI(MultiGPUCLI):
    """``fit``'s parser with ``--plan.*`` added; it checks the options and builds nothing."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_class_arguments(PlanOptions, "plan")

    @override
    def instantiate_classes(self) -> None:
        """Nothing is built here: each layout trains in processes of its own."""


@dataclass(frozen=True)
class Setting:
    """What every layout shares: where, how many devices, the batch and the network."""

    cuda: bool
    devices: int
    device_ids: list[int] | None  # GPU indices, when the user listed them
    batch_size: int  # per device, as ddp reads --data.batch_size
    precision: str
    memory: BlockMemory
    optimizer_states: int
    overhead: int  # CPU: what a process holds before the network (Python, torch, Lightning)

    def estimated_peaks(self, layout: Layout) -> list[int]:
        """Estimated peak of each device (CUDA), or of each process (CPU), in the order the runs report them."""
        processes = estimate(layout, self.memory, self.optimizer_states)
        if self.cuda:
            return [device for process in processes for device in process]
        return [sum(process) + self.overhead for process in processes]


def plan(args: Sequence[str], default_config_files: Sequence[str | Path]) -> None:
    """Run ``python main.py plan <args>``."""
    cli = PlanCLI(default_config_files=default_config_files, args=list(args), run=False)
    config = cli.config
    _check_no_plan_section(args)
    options = PlanOptions(**vars(config["plan"]))
    trainer = config["trainer"]
    if (trainer.get("num_nodes") or 1) > 1:
        raise UsageError(
            "plan measures the layouts on this machine alone: drop --trainer.num_nodes, and add it to the fit "
            "command of the layout it chooses."
        )
    setting = _setting(config)
    warmup = options.warmup if options.warmup is not None else (10 if setting.cuda else 2)
    steps = options.steps or (20 if setting.cuda else 3)
    layouts, refusals = candidate_layouts(
        setting.devices, setting.cuda, setting.batch_size, bool(config["model"]["compile"]), options.strategies,
        options.schedules, options.micro_batches,
    )
    where = f"{setting.devices} {'CUDA' if setting.cuda else 'CPU'} device(s)"
    print(f"plan: {where}, batch {setting.batch_size} per device, {setting.precision}, "
          f"{warmup} warm-up + {steps} timed steps per layout", flush=True)
    layouts, unbalanced = _balanced(layouts, setting, config)
    refusals += unbalanced
    budget = _budget(setting, options.memory_per_device)
    chosen, left_out = _choose(layouts, setting, budget, options.checkpointing, bool(config["model"]["compile"]))
    refusals += left_out
    outcomes = [Outcome(layout, setting.estimated_peaks(layout)) for layout in chosen]
    if not options.dry_run:
        accumulate = trainer.get("accumulate_grad_batches") or 1
        outcomes = _measure(outcomes, args, setting, warmup, steps, accumulate if isinstance(accumulate, int) else 1)
    folder = Path(trainer.get("default_root_dir") or "logs") / config["run_name"]
    print_report(outcomes, refusals, setting.device_ids, budget, measured=not options.dry_run)
    if not options.dry_run and write_outputs(outcomes, folder, setting.device_ids, trainer,
                                             f"{where}, batch {setting.batch_size} per device, {setting.precision}") is None:
        raise UsageError("no layout trained, so nothing was written: each was left out or failed, as listed above.")


def _setting(config) -> Setting:
    trainer, model = config["trainer"], config["model"]
    cuda = accelerator_name(trainer.get("accelerator", "auto")) == "cuda"
    request = device_request(trainer.get("devices", "auto"))
    device_ids = request if isinstance(request, list) else None
    if request == "auto" or request == -1:
        devices = torch.cuda.device_count() if cuda else 1
    else:
        devices = len(request) if device_ids else request
    precision = str(trainer.get("precision") or "32-true")
    return Setting(
        cuda=cuda, devices=devices, device_ids=device_ids, batch_size=config["data"]["batch_size"], precision=precision,
        memory=block_memory(CIFAR10DataModule.num_classes, model["stem"], half_activations="16" in precision),
        optimizer_states=1 if model["momentum"] > 0 else 0, overhead=0 if cuda else _resident_bytes(),
    )


def _resident_bytes() -> int:
    """This process's resident memory now: Python, torch and Lightning, before any network."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _balanced(layouts: list[Layout], setting: Setting, config) -> tuple[list[Layout], list[Refusal]]:
    """The split layouts with the balance that evens out their blocks' measured time, as ``balance_by: time``
    would choose it in each run; timed once per micro-batch size, on the first device. Those whose
    micro-batches cannot train (BatchNorm given one value per channel) are refused."""
    device = torch.device("cuda", (setting.device_ids or [0])[0]) if setting.cuda else torch.device("cpu")
    blocks = DeferredBlocks(resnet50_block_factories(CIFAR10DataModule.num_classes, config["model"]["stem"]))
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


def _block_times(blocks: DeferredBlocks, precision: Precision, device: torch.device, images: int,
                 micro_batches: int) -> list[float] | str:
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


def _budget(setting: Setting, memory_per_device: float | None) -> tuple[int, bool]:
    """The bytes a layout may use, and whether that is per device (else for all processes together)."""
    if memory_per_device is not None:
        return int(memory_per_device * 2**30), True
    if setting.cuda:
        ids = setting.device_ids or list(range(setting.devices))
        return int(0.9 * min(torch.cuda.mem_get_info(index)[0] for index in ids)), True
    return int(0.9 * _available_bytes()), False


def _available_bytes() -> int:
    """Memory the processes can have on this machine: MemAvailable (free memory and reclaimable cache),
    within the control group's limit."""
    with open("/proc/meminfo") as file:
        available = next(int(line.split()[1]) * 1024 for line in file if line.startswith("MemAvailable:"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)


def _fits(peaks: list[int], budget: tuple[int, bool]) -> bool:
    limit, per_device = budget
    return max(peaks) <= limit if per_device else sum(peaks) <= limit


def _choose(
    layouts: list[Layout], setting: Setting, budget: tuple[int, bool], checkpointing: str, compiled: bool
) -> tuple[list[Layout], list[Refusal]]:
    """The layouts to run, with or without activation checkpointing as asked, and why the others are left out."""
    chosen, refusals, fitting = [], [], 0
    limit, per_device = budget
    room = f"{limit / MIB:,.0f} MiB {'per device' if per_device else 'for all processes'}"
    for layout in layouts:
        variants = {"no": [layout], "yes": [], "both": [layout], "auto": [layout]}[checkpointing]
        if checkpointing in ("yes", "both") or (checkpointing == "auto" and not _fits(setting.estimated_peaks(layout), budget)):
            if compiled:
                refusals.append(Refusal(f"{layout.label} +ckpt", "activation checkpointing does not run under --model.compile"))
            else:
                variants.append(replace(layout, checkpointing=True))
        elif checkpointing == "auto":
            fitting += 1
        for variant in variants:
            peaks = setting.estimated_peaks(variant)
            if _fits(peaks, budget):
                chosen.append(variant)
            else:
                need = max(peaks) if per_device else sum(peaks)
                refusals.append(Refusal(variant.label, f"would need about {need / MIB:,.0f} MiB, more than the {room} free"))
    if fitting:
        refusals.append(Refusal(
            f"+ckpt (activation checkpointing) of {fitting} layouts",
            "they fit without it, and it only adds a forward pass per step; --plan.activation_checkpointing=both "
            "measures them too",
        ))
    return chosen, refusals


def _measure(
    outcomes: list[Outcome], args: Sequence[str], setting: Setting, warmup: int, steps: int, accumulate: int
) -> list[Outcome]:
    """Train each layout in fresh processes; its figures, or why it failed."""
    entry = Path(sys.argv[0]).resolve()
    if entry.suffix != ".py":
        raise UsageError("run plan as `python main.py plan ...`: it launches main.py fit for each layout.")
    user_args = _without_plan_options(args)
    images = setting.batch_size * setting.devices * accumulate * (warmup + steps + 1)
    measured = []
    with tempfile.TemporaryDirectory(prefix="multigpu-plan-") as tmp:
        folder = Path(tmp)
        for index, outcome in enumerate(outcomes):
            out = folder / f"layout{index}.json"
            options = [*user_args, *outcome.layout.fit_options(setting.device_ids)]
            command = fit_command(entry, options, folder, f"plan-{index}", warmup + steps, images, step_timer(warmup, out))
            try:
                outcome = replace(outcome, figures=run(command, out, folder / f"layout{index}.log", timeout=LAYOUT_TIMEOUT_S))
                said = f"{outcome.figures['images_per_s']:.1f} img/s"
            except RunFailed as failure:
                log = (folder / f"layout{index}.log").read_text()
                outcome = replace(outcome, failure=_last_error(log) if "still running" not in str(failure) else
                                  f"still training after {LAYOUT_TIMEOUT_S} s: stopped")
                said = f"failed: {outcome.failure}"
            print(f"  [{index + 1}/{len(outcomes)}] {outcome.layout.label}: {said}", flush=True)
            measured.append(outcome)
    return measured


def _check_no_plan_section(args: Sequence[str]) -> None:
    """Refuse a config file with a ``plan`` section: each layout's ``fit`` reads the same files, and has no such section."""
    for index, arg in enumerate(args):
        path = arg.partition("=")[2] if arg.startswith("--config=") else args[index + 1] if arg == "--config" else None
        if path and Path(path).is_file() and isinstance(loaded := yaml.safe_load(Path(path).read_text()), dict) \
                and "plan" in loaded:
            raise UsageError(f"{path} has a plan section, which fit (run for each layout) refuses: give the "
                             "--plan.* options on the command line instead.")


def _without_plan_options(args: Sequence[str]) -> list[str]:
    """``args`` without ``--plan.*`` options and their values."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("--plan."):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def _last_error(log: str) -> str:
    """The line of a failed run's output that says what went wrong."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("error:") or "Error" in line.split(":", 1)[0]:
            return line[:300]
    return lines[-1][:300] if lines else "no output"
