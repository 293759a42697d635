"""The private torch and Lightning hooks ``multigpu.compat`` relies on, each by name, and the maths they keep on every
supported torch."""

import inspect
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import free_port
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.utils.data import DataLoader

from multigpu.compat import (
    LIGHTNING_CONTRACTS,
    PRIVATE_HOOKS,
    STAGE_HOOKS_OF_TORCH_211,
    TRAIN_LOADER_NEXT,
    _StageOfTorch211,
    pipeline_stage,
    resolve,
    set_default_process_group_backend,
    split_backward,
)
from multigpu.errors import UsageError
from multigpu.strategies import DataParallelStrategy

pytestmark = pytest.mark.internals  # CI runs these on the lowest torch we declare too


@pytest.mark.parametrize("hook", PRIVATE_HOOKS, ids=lambda hook: hook.name)
def test_each_private_hook_is_where_compat_uses_it_and_takes_the_same_arguments(hook):
    owner = hook.owner
    where = hook.instance() if hook.instance else resolve(hook.owner)
    if not hasattr(where, hook.name):
        assert hook.optional, (
            f"{owner}.{hook.name} is gone from this torch/Lightning release, and multigpu/compat.py relies on it: "
            "find what replaced it, and update compat.py"
        )
        return
    if hook.parameters is not None:
        takes = tuple(inspect.signature(getattr(where, hook.name)).parameters)
        assert takes == hook.parameters, (
            f"{owner}.{hook.name} now takes {takes}, not {hook.parameters} as multigpu/compat.py expects: see what "
            "this release changed, and update compat.py"
        )


def test_each_torch_211_stage_hook_is_gone_or_takes_what_compat_overrides_it_with():
    for hook in STAGE_HOOKS_OF_TORCH_211:
        if hasattr(PipelineStage, hook):
            torch_takes = list(inspect.signature(getattr(PipelineStage, hook)).parameters)
            ours = list(inspect.signature(getattr(_StageOfTorch211, hook)).parameters)
            assert torch_takes == ours, (
                f"torch.distributed.pipelining.PipelineStage.{hook} now takes {torch_takes}, and multigpu/compat.py's "
                f"override takes {ours}: see what this torch's {hook} does, and update the override"
            )


def test_a_stage_trains_batch_norm_statistics_of_its_micro_batches_only():
    """One process, one stage, GPipe over 2 micro-batches: BatchNorm's running statistics are those of one device
    given the 2 micro-batches, on every torch (2.11's shape inference ran a third pass, on zeros)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.manual_seed(0)
    piped = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    reference.load_state_dict(piped.state_dict())
    x, y = torch.randn(8, 4) * 3 + 1, torch.randn(8, 6)
    stage = pipeline_stage(piped, 0, 1, torch.device("cpu"), dist.group.WORLD)
    ScheduleGPipe(stage, 2, loss_fn=nn.functional.mse_loss).step(x, target=y)
    for micro_batch in x.chunk(2):
        reference(micro_batch)
    for name, buffer in reference.state_dict().items():
        assert torch.equal(piped.state_dict()[name], buffer), name
    assert int(piped[1].num_batches_tracked) == 2


def test_a_backward_pass_split_in_two_gives_the_gradients_of_a_whole_one():
    """``split_backward``, what ``plan`` times the zero-bubble schedules' passes with: its input gradients now, its
    weight gradients when the returned half runs, each those of one whole backward pass."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    weights = list(net.parameters())
    x, grad = torch.randn(8, 4, requires_grad=True), torch.randn(8, 3)
    whole = torch.autograd.grad(net(x), [x, *weights], grad)
    x_split = x.detach().requires_grad_()
    weights_half = split_backward([net(x_split)], [grad], [x_split], weights)
    assert torch.allclose(x_split.grad, whole[0]) and all(weight.grad is None for weight in weights)
    weights_half()
    for weight, expected in zip(weights, whole[1:]):
        assert torch.allclose(weight.grad, expected)


def test_a_strategy_that_shows_the_cpu_while_its_group_is_made_keeps_its_devices_backend():
    on_gpus, chosen = DDPStrategy(), DDPStrategy(process_group_backend="gloo")
    for strategy in (on_gpus, chosen):
        set_default_process_group_backend(strategy, torch.device("cuda", 1))
    assert on_gpus.process_group_backend == "nccl" and chosen.process_group_backend == "gloo"


# A private name imported when compat loaded would break every import below.
_EVERY_FEATURE = (
    "multigpu.compat, multigpu.cli.lightning_cli, multigpu.model.classifier, multigpu.strategies, "
    "multigpu.planning.command, multigpu.checkpointing.elastic, multigpu.checkpointing.stop_signals"
)


@pytest.mark.parametrize(
    ("missing", "feature"),
    [
        (
            "sys.modules['torch.distributed.pipelining._schedule_visualizer'] = None",
            "schedule_actions('1F1B', 2, 2, 1)",
        ),
        ("sys.modules['torch.distributed.rendezvous'] = None", "rendezvous_handlers()"),
        (
            "del lightning.pytorch.strategies.launchers._SubprocessScriptLauncher",
            "launches_subprocesses(SimpleNamespace(launcher=None))",
        ),
    ],
    ids=["schedule visualiser", "rendezvous registry", "subprocess launcher"],
)
def test_a_missing_private_name_breaks_only_the_feature_that_uses_it(missing, feature):
    """A torch or Lightning release without one private name: the whole project still imports, and only the compat
    function that uses the name fails."""
    code = f"""
import sys
from types import SimpleNamespace
import lightning.pytorch.strategies.launchers
{missing}
import {_EVERY_FEATURE}
from multigpu.compat import *
from multigpu.compat import rendezvous_handlers, launches_subprocesses, schedule_actions
print("imported")
try:
    {feature}
except ImportError:
    print("feature fails")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[:1] == ["imported"], done.stderr[-2000:]
    assert done.stdout.splitlines()[1:] == ["feature fails"], done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("contract", LIGHTNING_CONTRACTS, ids=lambda contract: contract.name)
def test_each_attribute_lightning_reads_by_name_is_still_read_and_ours_defines_it(contract):
    reader = resolve(contract.reader)
    reader = inspect.getsource(reader.fget if isinstance(reader, property) else reader)
    assert f'hasattr(self.strategy, "{contract.name}")' in reader, (
        f"{contract.reader} no longer reads the strategy's {contract.name}, so without a word {contract.what}: "
        "find where this Lightning release reads it, and update LIGHTNING_CONTRACTS in multigpu/compat.py"
    )
    assert contract.name in vars(resolve(contract.provider)), contract.provider


def test_dps_node_count_contract_refuses_a_second_machine():
    """What the ``num_nodes`` contract does, through public Lightning: dp takes one machine only."""
    with pytest.raises(UsageError, match="dp runs in one process on one machine, not 2"):
        Trainer(strategy=DataParallelStrategy(), accelerator="cpu", devices=1, num_nodes=2, logger=False)


def test_lightnings_training_loop_profiles_its_wait_for_the_loader_under_the_name_compat_gives():
    """Lightning profiles an action named ``TRAIN_LOADER_NEXT``, which ``LoaderClock`` adds up: 3 batches of 4
    images, each 10 ms to read."""
    from helpers import SlowLoader, bare_trainer
    from strategy_training import tiny

    from multigpu.run.step_times import LoaderClock

    class Actions(LoaderClock):
        names: set[str] = set()

        def start(self, action_name: str) -> None:
            self.names.add(action_name)
            super().start(action_name)

    model, data = tiny(4)
    clock = Actions()
    trainer = bare_trainer("auto", 1, 3, profiler=clock)
    trainer.fit(model, DataLoader(SlowLoader.sleeping(data, 0.01), batch_size=4))
    assert TRAIN_LOADER_NEXT in clock.names, sorted(clock.names)
    assert clock.waited_s >= 3 * 4 * 0.01
