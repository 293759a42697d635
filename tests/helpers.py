"""What the tests share: the repository's paths, CLI runners (in a subprocess or in this process), CIFAR-10 in its
official files, free ports, the bare Trainer that strategy tests train with, and the test-only Lightning callbacks
that configs load by class path (``helpers.<Name>``, found through ``HELPERS_ENV``)."""

import contextlib
import errno
import hashlib
import io
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fork_server
import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.model.resnet import bottleneck_block_factories
from multigpu.run.replicas import data_parallel_size

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "smoke.yaml")
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"

# What a process prints when gloo's threads outlive the interpreter (multigpu.run.process_groups): a child
# rank's abort leaves the launching process's exit status at 0, so the output is checked as well.
ABORTED_AT_EXIT = "terminate called without an active exception"

# Subprocesses find what configs name in tests/helpers.py (``helpers.tiny_resnet``, the test-only callbacks) with
# this; ``run_cli`` gives it to every run. The caller's PYTHONPATH stays after it, so that a checkout's runs import
# the src/ it names, not the one the environment's editable install points to.
HELPERS_ENV = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.getenv("PYTHONPATH")])])}


def run_cli(
    *args: str, cwd: Path = REPO, timeout: int = 300, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run ``python main.py ARGS`` and return it (output in ``.stdout``). A run still going after ``timeout`` seconds
    fails the test with the stack of every one of its processes (SIGABRT, faulthandler). The run is forked from this
    worker's ``fork_server``, its imports done, unless ``fresh`` (a test of the entry point or a launcher) or
    ``MULTIGPU_TEST_FRESH=1``: then a new interpreter."""
    command = [sys.executable, str(REPO / "main.py"), *args]
    full_env = {**os.environ, **HELPERS_ENV, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    if not fresh and os.environ.get("MULTIGPU_TEST_FRESH") != "1":
        return _forked_run(command, cwd, full_env, timeout)
    with subprocess.Popen(
        command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its ranks and loader workers: one group, so that a hang is dumped whole
    ) as process:  # fmt: skip
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGABRT)
            output, _ = process.communicate()
            pytest.fail(f"{command} ran past {timeout} s; its processes' stacks:\n{output[-30000:]}")
    assert ABORTED_AT_EXIT not in output, output
    return subprocess.CompletedProcess(command, process.returncode, output)


# This process's fork server (by pid: a process forked from this one starts its own): its address, and the write end
# of the pipe whose closing ends it.
_FORK_SERVERS: dict[int, tuple[Path, int]] = {}


def _fork_server() -> Path:
    """The address of this process's ``fork_server``, started on first use; it ends with this process."""
    if os.getpid() not in _FORK_SERVERS:
        folder = Path(tempfile.mkdtemp(prefix="multigpu-fork-server-"))
        address = folder / "socket"
        alive, keep = os.pipe()
        server = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "fork_server.py"), str(address), str(alive)],
            env={**os.environ, **HELPERS_ENV, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
            stdout=subprocess.PIPE, pass_fds=(alive,), start_new_session=True,
        )  # fmt: skip
        os.close(alive)
        os.set_inheritable(keep, False)  # held by this process alone: the server ends when it closes
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the tests' fork server did not start (exit status {server.wait()})")
        _FORK_SERVERS[os.getpid()] = address, keep
    return _FORK_SERVERS[os.getpid()][0]


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _forked_run(command: list[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """``command`` (``python main.py ARGS``) run by the fork server; as ``run_cli``'s fresh run."""
    with (
        tempfile.NamedTemporaryFile(prefix="multigpu-run-", suffix=".log") as output,
        socket.socket(socket.AF_UNIX) as connection,
    ):
        connection.connect(str(_fork_server()))
        request = {"main": command[1], "args": command[2:], "cwd": str(cwd), "env": env, "output": output.name}
        fork_server.send(connection, request)
        pid = fork_server.receive(connection)
        connection.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            returncode = fork_server.receive(connection)
            # As a fresh run's output pipe stays open while any of its processes lives: the run is over when its
            # whole group is (ranks, loader workers, their fork servers).
            while _group_alive(pid):
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.05)
        except TimeoutError:
            os.killpg(pid, signal.SIGABRT)
            connection.settimeout(None)
            with contextlib.suppress(EOFError):
                fork_server.receive(connection)
            time.sleep(1)  # the group's stacks, written as each process aborts
            text = Path(output.name).read_text(errors="replace")
            pytest.fail(f"{command} ran past {timeout} s; its processes' stacks:\n{text[-30000:]}")
        text = Path(output.name).read_text(errors="replace")
    assert ABORTED_AT_EXIT not in text, text
    return subprocess.CompletedProcess(command, returncode, text)


def cli_main(*args: str) -> None:
    """Run the CLI in this process, with configs/default.yaml read first as main.py does."""
    from multigpu.commands import main

    main(list(args), default_config_files=[DEFAULT_CONFIG])


def cli_error(capsys, *args: str) -> str:
    """Run ``fit`` with the smoke config and ARGS in this process, in an empty folder (what a user's own runs left in
    the checkout, such as ``checkpoints/smoke/``, is not the error under test); return its one ``error:`` line."""
    with tempfile.TemporaryDirectory() as folder, pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        with pytest.raises(SystemExit) as exit_info:
            cli_main("fit", "--config", SMOKE, *args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


class WholeBlock(nn.Sequential):
    """A block of layers that ``--model.arch`` keeps whole (it opens a plain ``nn.Sequential`` into its children), as
    ResNet-50's own stem and head are blocks."""


def tiny_resnet(num_classes: int) -> nn.Sequential:
    """ResNet-50's own block classes at 4 and 8 channels per bottleneck (``--model.arch=helpers.tiny_resnet``, or
    ``TINY``), for the tests whose promise is about a strategy, a checkpoint, the sampler or the loop: the CIFAR stem
    (8 channels), two bottlenecks of 4 (the first with a downsampled shortcut, the second with its input as the
    shortcut), one of 8 with stride 2, and the head. 8 blocks, whose entries pass the pair ``(out, identity)`` to
    their exits, each with BatchNorm: a split after an odd block falls inside a bottleneck."""
    blocks = [build() for build in bottleneck_block_factories(((4, 2, 1), (8, 1, 2)), 8, num_classes)]
    return nn.Sequential(*(WholeBlock(*block) if type(block) is nn.Sequential else block for block in blocks))


TINY = "--model.arch=helpers.tiny_resnet"


def helper_callback(folder: Path, name: str, **init_args) -> str:
    """Write a config that adds the callback ``helpers.<name>(**init_args)``; return its path."""
    lines = ["trainer:", "  callbacks:", f"    - class_path: helpers.{name}", "      init_args:"]
    lines += [f"        {key}: {value}" for key, value in init_args.items() if value is not None]
    path = folder / f"{name}{len(list(folder.glob(f'{name}*.yaml')))}.yaml"  # a new file per call
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous.

    It is drawn below the kernel's range of ephemeral ports: a port from ``bind(0)`` lies in that range, and the
    kernel hands the same ports to outgoing connections, so gloo's connections in a test running beside could take
    it in the seconds before the rendezvous listens on it (``EADDRINUSE``, seen in CI). The draw does not follow
    ``random``'s seed, which two test workers may share."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest_ephemeral = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    draw = random.SystemRandom()
    while True:
        port = draw.randrange(10000, lowest_ephemeral)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def run_args(tmp_path: Path, run_name: str = "test") -> list[str]:
    """Arguments that keep a run's checkpoints and logs inside ``tmp_path`` and train ``tiny_resnet``, ResNet-50's
    blocks at 4 to 8 channels. A test whose promise is ResNet-50 itself passes ``RESNET50`` after these: the
    network with the ImageNet stem, which trains about 16 times faster than the CIFAR stem on 32x32 images (the
    network's tests cover both). Each validation's images are off (``VALIDATION_IMAGES`` after these turns them on):
    matplotlib's import and drawing took 0.7 s of CPU a smoke run (17%), and the tests that promise the images, or
    a stop that waits for their thread, turn them on."""
    return [
        f"--run_name={run_name}",
        f"--checkpoint_root={tmp_path / 'checkpoints'}",
        f"--trainer.default_root_dir={tmp_path / 'logs'}",
        TINY,
        "--validation_report.images=false",
    ]


VALIDATION_IMAGES = "--validation_report.images=true"


RESNET50 = ["--model.arch=resnet50", "--model.stem=imagenet"]


def bare_trainer(strategy, devices: int, max_steps: int, **options) -> Trainer:
    """A CPU Trainer that trains ``max_steps`` steps and does nothing else: no logger, checkpoint, progress bar,
    summary or validation, and no sampler of Lightning's (``fit_in_order`` gives each replica its share).
    ``options`` add to these, or override them."""
    return Trainer(
        **{
            "accelerator": "cpu",
            "devices": devices,
            "strategy": strategy,
            "max_steps": max_steps,
            "limit_val_batches": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "use_distributed_sampler": False,
            **options,
        }
    )


def fit_in_order(trainer: Trainer, model: LightningModule, data: Dataset, batch_size: int) -> None:
    """``trainer.fit`` on ``data`` in its order, each data-parallel replica reading its ``DistributedSampler`` share
    unshuffled."""
    replicas = trainer.strategy.distributed_sampler_kwargs if trainer.world_size > 1 else {}
    shard = DistributedSampler(
        data, num_replicas=replicas.get("num_replicas", 1), rank=replicas.get("rank", 0), shuffle=False
    )
    trainer.fit(model, DataLoader(data, batch_size=batch_size, sampler=shard))


def write_cifar10_files(
    root: Path, train: np.ndarray, train_labels: list[int], test: np.ndarray, test_labels: list[int]
) -> Path:
    """Write CIFAR-10's official python layout under ``root``: uint8 images (N, 3, 32, 32), split into 5 training
    files, and the test file."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    parts = np.array_split(np.arange(len(train)), 5)
    batches = [(f"data_batch_{i}", train[part], [train_labels[j] for j in part]) for i, part in enumerate(parts, 1)]
    for name, images, labels in [*batches, ("test_batch", test, test_labels)]:
        entry = {"batch_label": name, "labels": list(labels), "data": images.reshape(len(images), 3072)}
        with open(folder / name, "wb") as file:
            pickle.dump(entry, file, protocol=4)
    with open(folder / "batches.meta", "wb") as file:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)], "num_vis": 3072}, file, protocol=4)
    return root


def write_tiny_cifar10(root: Path, per_batch: int = 20, test: int = 20) -> Path:
    """Write a CIFAR-10 in the official python layout with ``per_batch`` random images per training file."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5 * per_batch + test, 3, 32, 32), dtype=np.uint8)
    labels = rng.integers(0, 10, len(images)).tolist()
    return write_cifar10_files(root, images[:-test], labels[:-test], images[-test:], labels[-test:])


def write_image_folder(
    root: Path, classes: tuple[str, ...] = ("cat", "dog", "owl"), train: int = 8, val: int = 2
) -> Path:
    """Write ImageNet's layout under ``root``: ``train/<class>/`` and ``val/<class>/`` with ``train`` and ``val``
    PNG or JPEG images of each class, of assorted sizes, each class tinted its own colour."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                height, width = rng.integers(24, 64, 2)
                pixels = rng.integers(0, 128, (height, width, 3), dtype=np.uint8)
                pixels[..., label % 3] += 100
                suffix = ".jpg" if index % 3 == 2 else ".png"
                Image.fromarray(pixels).save(folder / f"{index}{suffix}")
    return root


class RecordSamples(Callback):
    """Writes a fingerprint of every training image this rank saw (a hash of all its values, bit for bit) to
    ``out_dir/rank<N>.txt``, a line each, in the order trained."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fingerprints = [hashlib.sha1(image.cpu().numpy().tobytes()).hexdigest() for image in batch[0]]
        with open(self.out_dir / f"rank{trainer.global_rank}.txt", "a") as file:
            file.write("\n".join(fingerprints) + "\n")


class KillAt(Callback):
    """Stops this process at optimizer step ``step`` (counted from 0), at one of ``MOMENTS`` of it: SIGKILL as the
    step starts (``step``), before its backward pass (``backward``), before its optimizer step (``optimizer``), or once
    it has ended but before the checkpoints of its end are written (``step-end``); SIGTERM or SIGUSR1 as the step
    starts (``sigterm``, ``sigusr1``); SIGINT to its whole process group as the step starts, as a terminal's Ctrl-C
    does (``ctrl-c``).
    (A kill inside a checkpoint's write: ``KillInWrites``.)

    ``whole_job``: SIGKILL the whole process group (every rank and loader worker of a job started in a session of
    its own), as a lost machine ends them, rather than this process alone. Only on global rank ``rank``, when
    given. A process that torchrun restarted (``TORCHELASTIC_RESTART_COUNT`` above 0) is left to finish.
    """

    MOMENTS = ("step", "backward", "optimizer", "step-end")  # the SIGKILLs

    def __init__(self, step: int, moment: str = "step", rank: int | None = None, whole_job: bool = False) -> None:
        self.step, self.moment, self.rank, self.whole_job = step, moment, rank, whole_job

    def _signal_if(self, trainer, moment: str, signum: int, step: int | None = None) -> None:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return  # a restart by torchrun is left to finish
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        step = trainer.global_step if step is None else step
        if self.moment == moment and step == self.step:
            if signum == signal.SIGINT or (signum == signal.SIGKILL and self.whole_job):
                os.killpg(os.getpgid(0), signum)
            else:
                os.kill(os.getpid(), signum)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._signal_if(trainer, "step", signal.SIGKILL)
        self._signal_if(trainer, "sigterm", signal.SIGTERM)
        self._signal_if(trainer, "sigusr1", signal.SIGUSR1)
        self._signal_if(trainer, "ctrl-c", signal.SIGINT)

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._signal_if(trainer, "backward", signal.SIGKILL)

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._signal_if(trainer, "optimizer", signal.SIGKILL)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._signal_if(trainer, "step-end", signal.SIGKILL, step=trainer.global_step - 1)


class KillInWrite(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` whose write of ``last.ckpt`` at global step ``step``, in the background as every write,
    is slow: it writes the first half of the file's bytes, then SIGKILLs the whole process group (every rank and
    loader worker of a job started in a session of its own) from the writer thread, while training goes on in the
    other: a kill inside a background write, whatever the machine's pace."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    @override
    def write(self, checkpoint, path) -> None:
        if path.name == "last.ckpt" and checkpoint["global_step"] == self.step:
            data = io.BytesIO()
            torch.save(checkpoint, data)
            with open(path.with_name(f".{path.name}.{os.getpid()}.tmp"), "wb") as file:
                file.write(data.getvalue()[: len(data.getvalue()) // 2])
                file.flush()
            os.killpg(os.getpgid(0), signal.SIGKILL)
        super().write(checkpoint, path)


class KillInWrites(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` that, on global rank ``rank``, from the first checkpoint holding ``step`` optimizer steps
    or more, slows every write by ``slow_s`` (half before its bytes, half after), and SIGKILLs the whole process group
    (every rank and loader worker of a job started in a session of its own) ``delay_s`` seconds after that save
    began, from a timer: wherever the wall clock puts the kill, inside a background write, between the shards of
    ``fsdp``, in its wait for the other process's shard, or after the write, while training goes on."""

    def __init__(self, step: int, delay_s: float, rank: int = 0, slow_s: float = 0.4) -> None:
        super().__init__()
        self.step, self.delay_s, self.rank, self.slow_s = step, delay_s, rank, slow_s
        self._armed = False

    def _arm(self, checkpoint) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self._armed or rank != self.rank or checkpoint["global_step"] < self.step:
            return
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return
        self._armed = True
        # not a daemon: a process whose last write ends before the timer waits for it, and is killed all the same
        threading.Timer(self.delay_s, os.killpg, args=(os.getpgid(0), signal.SIGKILL)).start()

    @override
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self._arm(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)

    @override
    def save_sharded(self, checkpoint, path, rank, processes, token) -> None:
        self._arm(checkpoint)
        super().save_sharded(checkpoint, path, rank, processes, token)

    @override
    def write(self, checkpoint, path) -> None:
        if self._armed:
            time.sleep(self.slow_s / 2)
        super().write(checkpoint, path)
        if self._armed:
            time.sleep(self.slow_s / 2)


class CtrlCInWrite(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` whose writes of a checkpoint at global step ``step`` or later each take ``slow_s`` more
    (before their bytes), and whose first such save sends SIGINT to the whole process group ``delay_s`` later, as a
    second Ctrl-C typed during the save that the first one asked for."""

    def __init__(self, step: int, slow_s: float = 20.0, delay_s: float = 0.5) -> None:
        super().__init__()
        self.step, self.slow_s, self.delay_s, self._armed = step, slow_s, delay_s, False

    @override
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        if not self._armed and checkpoint["global_step"] >= self.step:
            self._armed = True
            threading.Timer(self.delay_s, os.killpg, args=(os.getpgid(0), signal.SIGINT)).start()
        super().save_checkpoint(checkpoint, path, storage_options)

    @override
    def write(self, checkpoint, path) -> None:
        if self._armed:
            self._abandoned.wait(self.slow_s)  # as a long write, which a second Ctrl-C gives up
        super().write(checkpoint, path)


def helper_plugin(folder: Path, name: str, **init_args) -> str:
    """Write a config whose checkpoint plugin is ``helpers.<name>(**init_args)``; return its path."""
    lines = ["trainer:", "  plugins:", f"    - class_path: helpers.{name}", "      init_args:"]
    lines += [f"        {key}: {value}" for key, value in init_args.items() if value is not None]
    path = folder / f"{name}{len(list(folder.glob(f'{name}*.yaml')))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class FailWrite(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` whose write at global step ``step`` on global rank ``rank`` fails as a full quota does
    (``OSError`` EDQUOT): a shard under ``fsdp``, the whole file on the first process otherwise."""

    def __init__(self, rank: int, step: int) -> None:
        super().__init__()
        self.rank, self.step = rank, step

    @override
    def write(self, checkpoint, path) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        # a shard holds no step: its folder (step<N>-<token>) says it
        step = checkpoint["global_step"] if "global_step" in checkpoint else int(path.parent.name[4:].split("-")[0])
        if rank == self.rank and step == self.step:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
        super().write(checkpoint, path)


class FillDiskAt(Callback):
    """Fills the file system of folder ``disk`` as optimizer step ``step`` starts, on the first process (a ballast file
    as large as the space left): the saves after it find the disk full."""

    def __init__(self, disk: str, step: int) -> None:
        self.folder, self.step = Path(disk), step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step:
            free = os.statvfs(self.folder).f_bavail * os.statvfs(self.folder).f_frsize
            with open(self.folder / "ballast", "wb") as file:
                with contextlib.suppress(OSError):
                    file.write(b"\0" * free)


class SlowLoader(Callback):
    """Makes the training loader take ``seconds`` longer per image, on every process, as a slow transform would."""

    class sleeping(Dataset):
        """``dataset``, each image ``seconds`` longer to read."""

        def __init__(self, dataset: Dataset, seconds: float) -> None:
            self.dataset, self.seconds = dataset, seconds

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, index: int):
            time.sleep(self.seconds)
            return self.dataset[index]

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @override
    def setup(self, trainer, pl_module, stage) -> None:
        datasets = trainer.datamodule.datasets  # set up before the callbacks
        datasets["train"] = self.sleeping(datasets["train"], self.seconds)


class SlowSteps(Callback):
    """Makes every training step last ``seconds`` longer, on every process (steps of seconds, as a large network's),
    the run's first step ``first_s`` longer (as a compiled network's), and validation batches (below)."""

    def __init__(
        self, seconds: float = 0.0, first_s: float = 0.0, validation_s: float = 0.0, new_shape_s: float = 0.0
    ) -> None:
        self.seconds, self.first_s, self.validation_s, self.new_shape_s = seconds, first_s, validation_s, new_shape_s
        self._first, self._shapes = True, set()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds + (self.first_s if self._first else 0.0))
        self._first = False

    @override
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        """Each validation batch ``validation_s`` longer, and ``new_shape_s`` more where its shape is new (as a
        compiled network compiles a validation's shorter last batch; the sanity check's shapes are compiled there, and
        not slowed)."""
        new = tuple(batch[0].shape) not in self._shapes
        self._shapes.add(tuple(batch[0].shape))
        if not trainer.sanity_checking:
            time.sleep(self.validation_s + (self.new_shape_s if new else 0.0))


class StopAt(Callback):
    """SIGSTOPs this process as optimizer step ``step`` starts on global rank ``rank``, as the system stops a process
    (or a device hangs): it neither fails nor answers."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGSTOP)


LOSE_NODE = "MULTIGPU_TEST_LOSE_NODE"  # set in the environment of the torchrun agent whose node ``LoseNodeAt`` ends


class LoseNodeAt(Callback):
    """In a worker of the torchrun agent whose environment sets ``LOSE_NODE``: SIGKILLs that agent (its parent) and
    then its own session (itself and its loader workers) as optimizer step ``step`` starts, as a lost machine ends
    them. A worker that torchrun restarted is left to finish."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if os.environ.get(LOSE_NODE) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            if trainer.global_step == self.step:
                os.kill(os.getppid(), signal.SIGKILL)
                os.killpg(os.getpgid(0), signal.SIGKILL)


class FailOnRank(Callback):
    """Raises an error on rank ``rank`` at optimizer step ``step``, as a crashing process would."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"rank {self.rank} failed on purpose at step {self.step}")


class RecordIndices(Callback):
    """Writes, for every loader batch this rank trains, the optimizer step and the indices of its images in the
    training set, as lines ``step index index ...`` of ``out_dir/rank<N>.txt`` (data without augmentation:
    each image is found by its first values). Of the processes of one pipeline, which read the same images,
    only the first records them."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self._index: dict[tuple[float, ...], int] = {}

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        train = trainer.datamodule.datasets["train"]
        self._index = {tuple(train[index][0].flatten()[:4].tolist()): index for index in range(len(train))}

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank % (trainer.world_size // data_parallel_size(trainer)):
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        indices = [self._index[tuple(image.flatten()[:4].tolist())] for image in batch[0].cpu()]
        with open(self.out_dir / f"rank{trainer.global_rank}.txt", "a") as file:
            file.write(" ".join(map(str, [trainer.global_step, *indices])) + "\n")


def trained_steps(attempts: list[Path]) -> dict[int, list[int]]:
    """The images each optimizer step trained, from ``RecordIndices``' folders of successive attempts of one run:
    a step that a later attempt trained again (after a kill) counts as that attempt trained it."""
    steps: dict[int, list[int]] = {}
    for folder in attempts:
        found: dict[int, list[int]] = {}
        for path in sorted(folder.glob("rank*.txt")):
            for line in path.read_text().split("\n"):
                if line:
                    step, *indices = map(int, line.split())
                    found.setdefault(step, []).extend(indices)
        steps.update(found)
    return steps


def assert_within_scale(found: dict, expected: dict, relative: float, where: str = "", rtol: float = 0.0) -> float:
    """Two state dicts with the same keys, every floating-point tensor of ``found`` within ``relative`` of the largest
    value of ``expected``'s (``torch.testing.assert_close``'s ``atol``, with ``rtol``), every other one bit for bit.
    Returns the largest difference over that largest value, which tests print."""
    assert found.keys() == expected.keys(), where
    worst = 0.0
    for name, tensor in expected.items():
        scale = tensor.abs().max().item() if tensor.is_floating_point() else 0.0
        torch.testing.assert_close(
            found[name],
            tensor,
            rtol=rtol,
            atol=relative * scale,
            msg=lambda message, name=name: f"{where}: {name}: {message}",
        )
        if tensor.is_floating_point():
            worst = max(worst, (found[name] - tensor).abs().max().item() / max(scale, 1e-30))
    return worst


class RecordSteps(Callback):
    """On global rank 0, saves the network's initial weights (``init.pt``, torchvision's names) and, after each of
    the first ``steps`` optimizer steps, its state dict and the learning rate the step used (``step<K>.pt``), so
    that a plain loop can be compared with the application step by step."""

    def __init__(self, out_dir: str, steps: int) -> None:
        self.out_dir, self.steps, self._lr = Path(out_dir), steps, None

    def _save(self, pl_module, name: str, **extra) -> None:
        from multigpu.model.torchvision_weights import to_torchvision

        state = {key: tensor.detach().clone() for key, tensor in pl_module.net.state_dict().items()}
        torch.save({"state": to_torchvision(state), **extra}, self.out_dir / name)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._save(pl_module, "init.pt")

    @override
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._lr = optimizer.param_groups[0]["lr"]

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank == 0 and 0 < step <= self.steps and not (self.out_dir / f"step{step}.pt").exists():
            self._save(pl_module, f"step{step}.pt", lr=self._lr)
