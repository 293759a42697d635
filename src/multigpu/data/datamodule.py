"""``ImageDataModule``: the loaders, their workers, the sharding over the replicas and the resumable training order,
over the source ``--data.*`` picks: CIFAR-10's or CIFAR-100's files, a folder of the user's labelled images, or
synthetic images of CIFAR's shape (``source``)."""

import os
from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.fabric.utilities.data import AttributeDict, suggested_max_num_workers
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from multigpu.data.cifar import (
    CIFAR10_CLASSES,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    CIFAR_CLASS_COUNTS,
    CifarFiles,
)
from multigpu.data.data_options import DataOptions
from multigpu.data.image_files import ImageFiles, Indexed
from multigpu.data.image_folder import ImageFolderSource, folder_classes
from multigpu.data.loader_workers import start_worker_server, worker_start
from multigpu.data.on_device import DeviceBatches
from multigpu.data.sampling import EpochOrder, ResumableSampler, TrainingOrder
from multigpu.data.source import ImageSource, Stats, images_in
from multigpu.data.synthetic import SyntheticImages
from multigpu.data.transforms import ImageTensorDataset
from multigpu.errors import UsageError, check_at_least
from multigpu.renamed_options import renamed_class
from multigpu.run.replicas import data_parallel_rank, data_parallel_size, global_batch_size

__all__ = ["ImageDataModule", "class_count", "node_local_rank"]


def class_count(dataset: str, data_dir: str) -> int:
    """How many classes the data module of ``dataset`` in ``data_dir`` serves: CIFAR's, or an image folder's (its
    ``train/``'s subfolders), without reading an image."""
    return CIFAR_CLASS_COUNTS[dataset] if dataset in CIFAR_CLASS_COUNTS else len(folder_classes(data_dir))


def _source(options: DataOptions) -> ImageSource:
    """The source ``--data.*`` asks for: synthetic images, an image folder, or CIFAR's files."""
    dataset, mean, std = options.dataset, options.mean, options.std
    given = (mean, std) if mean and std else None
    if dataset == "imagefolder":
        if options.synthetic:
            raise UsageError(
                "data.synthetic=true (configs/smoke.yaml sets it) stands in for CIFAR: add --data.synthetic=false to "
                "train on the image folder, or use --data.dataset=cifar10 or cifar100."
            )
        return ImageFolderSource(options.data_dir, options.image_size, given)
    default = (CIFAR100_MEAN, CIFAR100_STD) if dataset == "cifar100" else (CIFAR10_MEAN, CIFAR10_STD)
    stats = (mean or default[0], std or default[1])
    if options.synthetic:
        classes = list(CIFAR10_CLASSES) if dataset == "cifar10" else None
        return SyntheticImages(options.synthetic_size, CIFAR_CLASS_COUNTS[dataset], classes, stats)
    return CifarFiles(options.data_dir, dataset, options.download, options.verify_checksums, options.val_split, stats)


def node_local_rank() -> int:
    """This process's rank among the processes of its machine: ``LOCAL_RANK`` where Lightning's
    launcher or torchrun set it, ``SLURM_LOCALID`` under srun (which sets no ``LOCAL_RANK``),
    and 0 for a process started by hand."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))


class ImageDataModule(LightningDataModule):
    """CIFAR-10 (or CIFAR-100, or a folder of labelled images) for training, validation, test and predict.

    Under DDP, Lightning wraps each loader in a ``DistributedSampler`` so that every
    rank reads its own shard. That sampler pads the validation set with repeated
    samples when its length is not a multiple of the number of ranks, which biases
    the accuracy of a small validation set slightly.

    Args:
        dataset: ``cifar10``, ``cifar100`` (torchvision's, downloaded where missing), or ``imagefolder``: your own
            images under ``data_dir/train/<class>/`` and ``data_dir/val/<class>/``
            (``multigpu.data.image_folder``), validated on ``val/`` and tested on it too.
        data_dir: folder that holds (or receives) ``cifar-10-batches-py/`` (``cifar-100-python/``), or the image
            folder's ``train/`` and ``val/``.
        download: download CIFAR-10 with torchvision when it is missing.
        verify_checksums: check the files against torchvision's md5 sums. Turn off for
            your own or a partial copy of the dataset.
        batch_size: images per device and loader batch (the whole batch of the process under ``dp``, of one
            pipeline under ``pipeline``).
        global_batch_size: images per optimizer step over all replicas. When set, each replica accumulates
            ``global_batch_size / (batch_size x replicas)`` loader batches per step, whatever the layout, so a
            run resumed on other devices trains the same steps (``--trainer.accumulate_grad_batches`` then
            follows from it); it must split into whole loader batches. Default: ``batch_size x replicas x
            accumulate_grad_batches``.
        num_workers: loader worker processes per device; by default, as many as this machine's cores allow each
            of its processes (Lightning's ``suggested_max_num_workers``: cores / processes - 1, at least 1);
            they start from a fork server, never forked from the training process (``loader_workers``).
        pin_memory: pin host memory (only when training on CUDA devices).
        persistent_workers: keep the workers alive between epochs (only with workers).
        val_split: 0 validates on the official test split; N > 0 holds out N training
            images instead, the same ones on every run.
        synthetic: serve random tensors of CIFAR's shape instead of reading the disk.
        synthetic_size: training images per epoch with ``synthetic``; validation, test and
            predict get a quarter of it.
        shuffle_seed: seed of the training set's per-epoch shuffle and of each sample's random
            augmentation (see ``multigpu.data.sampling``). Default: the run's ``seed_everything``, so that runs
            with other seeds also see the images in other orders, augmented otherwise, as a plain
            ``DataLoader(shuffle=True)`` does. A checkpoint records the seed its run used, and a run resumed
            from it, even one written mid-epoch and resumed on another layout, goes on with that seed: it sees
            the same images, augmented the same way, as a run never stopped.
        on_device: keep the whole dataset (uint8) on the training device and crop, flip and
            normalise whole batches there, without loader workers (see ``multigpu.data.on_device``).
            Each rank reads the same shard of the same per-epoch shuffle as without it.
        image_size: the side of the square images an image folder is resized to (CIFAR's are 32).
        mean: per-channel mean the images are normalised with; default the dataset's (an image folder's measured).
        std: per-channel standard deviation, as ``mean``.
        predict_dir: ``predict`` reads the PNG and JPEG images under this folder, of any size, instead of
            the test split (``multigpu.data.image_files``); CIFAR-10 need not be on disk then.
    """

    hparams: AttributeDict  # what save_hyperparameters keeps, read by attribute

    def __init__(
        self,
        data_dir: str = "data",
        dataset: Literal["cifar10", "cifar100", "imagefolder"] = "cifar10",
        download: bool = True,
        verify_checksums: bool = True,
        batch_size: int = 128,
        global_batch_size: int | None = None,
        num_workers: int | None = None,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        val_split: int = 0,
        synthetic: bool = False,
        synthetic_size: int = 50_000,
        shuffle_seed: int | None = None,
        on_device: bool = False,
        image_size: int = 32,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        predict_dir: str | None = None,
    ) -> None:
        super().__init__()
        check_at_least("data.batch_size", batch_size, 1)
        if global_batch_size is not None:
            check_at_least("data.global_batch_size", global_batch_size, 1)
        if num_workers is not None:
            check_at_least("data.num_workers", num_workers, 0)
        check_at_least("data.synthetic_size", synthetic_size, 1)
        check_at_least("data.val_split", val_split, 0)
        check_at_least("data.image_size", image_size, 1)
        if dataset != "imagefolder" and image_size != 32:
            raise UsageError(f"data.image_size={image_size}: CIFAR's images are 32x32; it sizes an image folder's.")
        self.save_hyperparameters()
        self.options = DataOptions.of(self.hparams)  # what the rest of the data module reads
        self.datasets: dict[str, Dataset] = {}
        self._order: TrainingOrder | None = None  # the order the next training loader follows (``follow``)
        self._sampler: ResumableSampler | None = None
        self.source = _source(self.options)
        self._predict_files = ImageFiles(predict_dir, image_size, self.source.stats) if predict_dir else None
        # The first process of each machine checks (and downloads) the data before anything is built. Lightning
        # starts the other local processes after it; under torchrun or srun, which start them all at once, they wait
        # for it when the process group is set up, which it joins after this.
        if not predict_dir and node_local_rank() == 0:
            self.source.prepare()

    @property
    def batch_size(self) -> int:
        """Images per device and loader batch (``options.batch_size``), which the CLI hands the model as it is built
        and Lightning's batch-size finder reads and sets."""
        return self.options.batch_size

    @batch_size.setter
    def batch_size(self, images: int) -> None:
        self.options = replace(self.options, batch_size=images)

    @property
    def image_size(self) -> int:
        """The side of the images, which the CLI hands the model as it is built (``options.image_size``)."""
        return self.options.image_size

    @override
    def setup(self, stage: str) -> None:
        if self.datasets:
            return
        if self._workers() and not self.options.on_device:
            start_worker_server()  # the loader workers' fork server imports while the run sets up
        if self._predict_files is not None and stage == "predict":
            self._predict_files.normalized_as(self.source.measured_stats())  # an image folder's: as its run did
            self.datasets = {"predict": self._predict_files}
            return
        device = self._device() if self.options.on_device else None
        self.datasets = self.source.splits(device)
        if device is not None:
            for dataset in self.datasets.values():
                assert isinstance(dataset, ImageTensorDataset)  # a source's on-device splits
                dataset.images, dataset.labels = dataset.images.to(device), dataset.labels.to(device)

    @property
    def classes(self) -> list[str] | None:
        """The class names, by label."""
        return self.source.classes

    @property
    def num_classes(self) -> int:
        return self.source.num_classes

    @property
    def stats(self) -> Stats:
        """The per-channel mean and std the images are normalised with (an image folder's: once set up)."""
        if self.source.stats is None:
            raise RuntimeError("an image folder's mean and std are measured in setup(): call it first")
        return self.source.stats

    @property
    def known_stats(self) -> Stats | None:
        """``stats`` where known, else None (an image folder's before ``setup`` measures them)."""
        return self.source.stats

    def _workers(self) -> int:
        """``num_workers``, or by default the cores of this machine shared by its training processes."""
        if self.options.num_workers is not None:
            return self.options.num_workers
        return suggested_max_num_workers(self.trainer.num_devices if self.trainer else 1)

    def _worker_start(self, workers: int) -> dict:
        """The loader arguments that start ``workers`` workers of this process (``loader_workers``)."""
        return worker_start(workers, self.trainer.global_rank if self.trainer else 0)

    def _device(self) -> torch.device:
        """Where the batches go: the strategy's device, or the CPU without a trainer."""
        return self.trainer.strategy.root_device if self.trainer else torch.device("cpu")

    def _shard(self) -> tuple[int, int]:
        """(replicas, this process's replica): who reads which shard of the data."""
        trainer = self.trainer
        return (data_parallel_size(trainer), data_parallel_rank(trainer)) if trainer else (1, 0)

    def _loader(self, split: str, sampler: DistributedSampler | None = None) -> DataLoader | DeviceBatches:
        if self.options.on_device:
            if sampler is None:  # evaluation: in order, sharded as Lightning shards a DataLoader
                replicas, rank = self._shard()
                sampler = DistributedSampler(self.datasets[split], replicas, rank, shuffle=False)
            dataset = self.datasets[split]
            assert isinstance(dataset, ImageTensorDataset)  # a source's on-device splits
            return DeviceBatches(dataset, sampler, self.batch_size, split == "train", self.stats)
        workers = self._workers()
        return DataLoader(
            self.datasets[split],
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=sampler is not None,
            num_workers=workers,
            pin_memory=self.options.pin_memory and self._device().type == "cuda",
            persistent_workers=self.options.persistent_workers and workers > 0,
            **self._worker_start(workers),
        )

    def _accumulation(self) -> int:
        return self.trainer.accumulate_grad_batches if self.trainer else 1

    @property
    def global_batch(self) -> int:
        """The images of an optimizer step over every replica, on this layout."""
        return global_batch_size(self.batch_size, self._shard()[0], self._accumulation())

    @property
    def training_seed(self) -> int | None:
        """The seed the training order is shuffled with, once its loader is made."""
        return self._sampler.seed if self._sampler is not None else None

    def follow(self, order: TrainingOrder) -> None:
        """Train in ``order`` from the next training loader on: a resumed run's, given by its checkpoint's
        ``TrainingPosition``."""
        self._order = order

    def epoch_order(self, epoch: int) -> EpochOrder:
        """How this layout trains ``epoch``: as its pass under way does, or whole."""
        sampler = self._sampler
        if sampler is not None and sampler.epoch == epoch:
            return sampler.current
        return EpochOrder(images_in(self.datasets["train"]), self.global_batch)

    @override
    def train_dataloader(self) -> DataLoader | DeviceBatches:
        replicas, rank = self._shard()
        train = self.datasets["train"]
        if self.global_batch > (images := images_in(train)):
            raise UsageError(
                f"the global batch of {self.global_batch} images is larger than the {images} training images: "
                "lower --data.batch_size, --data.global_batch_size or --trainer.accumulate_grad_batches."
            )
        order, self._order = self._order, None
        sampler = ResumableSampler(train, replicas, rank, self.batch_size, self._accumulation(), seed=self._seed(order))
        if order is not None:  # between epochs too: the epoch is set before workers start
            sampler.resume_at(order.epoch, order.start)
        self._sampler = sampler
        return self._loader("train", sampler)

    def _seed(self, order: TrainingOrder | None) -> int:
        """The shuffle's seed: the one ``order`` gives (a resumed run's own, or where ``shuffle_seed`` is not given, an
        earlier version's default), else the one this run shuffled with before, else ``shuffle_seed``, else the run's
        ``seed_everything`` (``PL_GLOBAL_SEED``; 0 without one), the first process's wherever processes might disagree
        (a random seed drawn by each process that torchrun started)."""
        seed = self.options.shuffle_seed
        if order is not None and order.shuffle_seed is not None:
            return order.shuffle_seed
        if order is not None and seed is None and order.seed_by_default is not None:
            return order.seed_by_default
        if self._sampler is not None:
            return self._sampler.seed
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            if self.trainer is not None and self.trainer.world_size > 1:
                seed = self.trainer.strategy.broadcast(seed)
        return seed

    @override
    def val_dataloader(self) -> DataLoader | DeviceBatches:
        return self._loader("val")

    @override
    def test_dataloader(self) -> DataLoader | DeviceBatches:
        return self._loader("test")

    @override
    def predict_dataloader(self) -> DataLoader:
        """The user's images (``predict_dir``) or the test split, in order, each sample with its index."""
        dataset = self.datasets["predict"] if "predict" in self.datasets else self.datasets["test"]
        workers = 0 if self.options.on_device else self._workers()
        return DataLoader(
            Indexed(dataset),
            batch_size=self.batch_size,
            num_workers=workers,
            pin_memory=self.options.pin_memory and self._device().type == "cuda" and not self.options.on_device,
            **self._worker_start(workers),
        )


def __getattr__(name: str) -> Any:
    return renamed_class(__name__, name, globals())
