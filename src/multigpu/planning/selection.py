"""Which layouts ``plan`` runs: what every layout shares (``Setting``), and the memory-fit policy that leaves out,
saying why, the layouts that would not fit, with or without activation recomputation."""

from dataclasses import asdict, dataclass, replace

import torch

from multigpu.cli.run_options import RunOptions, TrainerOptions
from multigpu.cli.trainer_options import accelerator_name, device_request
from multigpu.model.architectures import network_blocks
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.model.network_options import NetworkOptions
from multigpu.model.recipe import Recipe
from multigpu.planning.memory_estimate import block_memory
from multigpu.planning.profile import BlockProfile, precision_plugin
from multigpu.run.host_memory import resident_bytes
from multigpu.strategies.block_timing import sgd_options
from multigpu.strategies.layout import BlockMemory, Layout, Refusal

__all__ = ["MIB", "Setting", "choose", "fits", "setting_of"]

MIB = 2**20
PLANNED_CLASSES = 10  # plan trains on synthetic images of CIFAR-10's shape; the head's width barely counts


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

    def profile(self, network: NetworkOptions, recipe: Recipe) -> BlockProfile:
        """The blocks' times of ``network`` on the first device, in the run's precision, updated by ``recipe``'s
        SGD, measured as they are asked for."""
        device = torch.device("cuda", (self.device_ids or [0])[0]) if self.cuda else torch.device("cpu")
        blocks = LazyBlocks(network_blocks(network.arch, PLANNED_CLASSES, network.stem))
        return BlockProfile(blocks, precision_plugin(self.precision, device), device, sgd_options(asdict(recipe)))

    def estimated_peaks(self, layout: Layout) -> list[int]:
        """Estimated peak of each device (CUDA), or of each process (CPU), in the order the runs report them."""
        processes = layout.device_memory(self.memory, self.optimizer_states)
        if self.cuda:
            return [device for process in processes for device in process]
        return [sum(process) + self.overhead for process in processes]


def devices_of(trainer: TrainerOptions) -> tuple[bool, int, list[int] | None]:
    """Whether ``trainer`` asks for CUDA devices, how many devices, and the GPU indices it lists (None where it asks
    for a count)."""
    cuda = accelerator_name(trainer.accelerator) == "cuda"
    request = device_request(trainer.devices)
    device_ids = request if isinstance(request, list) else None
    if isinstance(request, str) or request == -1:  # "auto", or every device
        return cuda, torch.cuda.device_count() if cuda else 1, None
    return cuda, len(request) if isinstance(request, list) else request, device_ids


def setting_of(run: RunOptions) -> Setting:
    """What ``plan`` plans for; it builds the network (other than ResNet-50, it runs it once, to check it)."""
    network = run.network
    cuda, devices, device_ids = devices_of(run.trainer)
    precision = str(run.trainer.precision or "32-true")
    return Setting(
        cuda=cuda,
        devices=devices,
        device_ids=device_ids,
        batch_size=run.data.batch_size,
        precision=precision,
        memory=block_memory(network_blocks(network.arch, PLANNED_CLASSES, network.stem, seed=0), "16" in precision),
        optimizer_states=1 if run.recipe.momentum > 0 else 0,
        overhead=0 if cuda else resident_bytes(),
    )


def fits(peaks: list[int], budget: tuple[int, bool]) -> bool:
    limit, per_device = budget
    return max(peaks) <= limit if per_device else sum(peaks) <= limit


def choose(
    layouts: list[Layout], setting: Setting, budget: tuple[int, bool], recompute: str, compiled: bool
) -> tuple[list[Layout], list[Refusal]]:
    """The layouts to run, with or without activation recomputation as asked, and why the others are left out."""
    chosen, refusals, fitting = [], [], 0
    limit, per_device = budget
    room = f"{limit / MIB:,.0f} MiB {'per device' if per_device else 'for all processes'}"
    for layout in layouts:
        variants = {"no": [layout], "yes": [], "both": [layout], "auto": [layout]}[recompute]
        if recompute in ("yes", "both") or (recompute == "auto" and not fits(setting.estimated_peaks(layout), budget)):
            if compiled:
                refusals.append(
                    Refusal(f"{layout.label} +recompute", "activation recomputation does not run under --model.compile")
                )
            else:
                variants.append(replace(layout, recompute=True))
        elif recompute == "auto":
            fitting += 1
        for variant in variants:
            peaks = setting.estimated_peaks(variant)
            if fits(peaks, budget):
                chosen.append(variant)
            else:
                need = max(peaks) if per_device else sum(peaks)
                refusals.append(
                    Refusal(variant.label, f"would need about {need / MIB:,.0f} MiB, more than the {room} free")
                )
    if fitting:
        refusals.append(
            Refusal(
                f"+recompute (activation recomputation) of {fitting} layouts",
                "they fit without it, and it only adds a forward pass per step; --plan.recompute_activations=both "
                "measures them too",
            )
        )
    return chosen, refusals
