"""The reference for learning: ResNet-50 on CIFAR-10 in plain PyTorch and torchvision, the loop people write by hand.

    python benchmarks/plain_cifar10.py --data-dir ../shared/data/cifar10-subset --epochs 10 --out plain.json
    torchrun --nproc-per-node=2 benchmarks/plain_cifar10.py --data-dir D --batch-size 64 --out plain.json   # DDP, gloo

torchvision's ``resnet50`` and its v2 transforms on PIL images (``ToImage``, ``RandomCrop(32, padding=4)``,
``RandomHorizontalFlip``, ``ToDtype(float32, scale=True)``, ``Normalize``), a ``DataLoader``, SGD with Nesterov
momentum and no weight decay on BatchNorm and biases, a ``LambdaLR`` of linear warm-up then
cosine written here, and forward / loss / backward / step. It shares nothing with the
application but, with ``--order app``, the order of the images and each one's augmentation
seed: the application's sampler (``multigpu.data.sampling.ResumableSampler``) gives the indices,
and each image is augmented under ``torch.manual_seed`` of its seed, so that the two can be
compared step by step (``tests/test_learning_parity.py``). ``--order shuffle`` is the usual
``DataLoader(shuffle=True)`` (``DistributedSampler`` under torchrun).

The files are read as torchvision's ``CIFAR10`` reads them, without its md5 check, which
refuses a subset of the official files.
"""

import argparse
import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torchvision
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler
from torchvision.transforms import v2

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class CIFAR10Files(Dataset):
    """The official python files as torchvision's ``CIFAR10`` reads them: HWC uint8 arrays, PIL images."""

    def __init__(self, root: str, train: bool, transform) -> None:
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        data, self.targets = [], []
        for name in names:
            with open(Path(root) / "cifar-10-batches-py" / name, "rb") as file:
                entry = pickle.load(file, encoding="latin1")
            data.append(entry["data"])
            self.targets.extend(entry["labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.transform(Image.fromarray(self.data[index])), self.targets[index]


class SeededSamples(Dataset):
    """Takes ``(index, seed)`` keys and augments sample ``index`` under ``torch.manual_seed(seed)``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.dataset[index]


def network(stem: str, init: str | None) -> nn.Module:
    model = torchvision.models.resnet50(num_classes=10)
    if stem == "cifar":
        model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    if init:
        model.load_state_dict(torch.load(init, weights_only=True))
    return model


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Top-1 accuracy and mean loss over the test split."""
    model.eval()
    correct, loss, count = 0, 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            count += len(y)
    model.train()
    return correct / count, loss / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="the folder that holds cifar-10-batches-py/")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--batch-size", type=int, default=128, help="images per process and forward pass")
    parser.add_argument("--accumulate", type=int, default=1, help="forward passes per optimizer step")
    parser.add_argument("--base-lr", type=float, default=0.2, help="per 256 images of the global batch")
    parser.add_argument("--warmup-epochs", type=float, default=2.0)
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="imagenet")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="initial weights (without --init), order and augmentation")
    parser.add_argument("--init", help="initial weights: a torchvision resnet50 state dict")
    parser.add_argument("--order", choices=["shuffle", "app"], default="shuffle")
    parser.add_argument("--shuffle-seed", type=int, default=0, help="the application's data.shuffle_seed (--order app)")
    parser.add_argument("--record", help="folder: save the state dict and learning rate after each of the first steps")
    parser.add_argument("--record-steps", type=int, default=0)
    parser.add_argument("--no-eval", action="store_true", help="skip the test split")
    parser.add_argument("--out", help="JSON file: loss and accuracy per epoch")
    args = parser.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    model = network(args.stem, args.init)
    # v1's ToTensor divides by 255 where v2 multiplies by 1/255: pixels one rounding apart, which is enough for
    # two runs to part after one step (docs/learning.md), so the step-by-step comparison takes v2.
    to_float = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    train_transform = v2.Compose([v2.ToImage(), v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *to_float])
    train = CIFAR10Files(args.data_dir, True, train_transform)
    if args.order == "app":
        from multigpu.data.sampling import ResumableSampler  # the order and seeds alone; the images are read here

        sampler = ResumableSampler(train, world, rank, args.batch_size, args.accumulate, seed=args.shuffle_seed)
        train = SeededSamples(train)
    elif world > 1:
        sampler = DistributedSampler(train, world, rank, shuffle=True, seed=args.seed, drop_last=True)
    else:
        sampler = RandomSampler(train, generator=torch.Generator().manual_seed(args.seed))
    loader = DataLoader(
        train, args.batch_size, sampler=sampler, num_workers=args.workers, drop_last=True,
        persistent_workers=args.workers > 0,
    )  # fmt: skip
    test = DataLoader(CIFAR10Files(args.data_dir, False, v2.Compose([v2.ToImage(), *to_float])), 256)

    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    global_batch = args.batch_size * world * args.accumulate
    optimizer = torch.optim.SGD(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.base_lr * global_batch / 256, momentum=0.9, nesterov=True, weight_decay=5e-4,
    )  # fmt: skip
    steps_per_epoch = len(loader) // args.accumulate
    total = (
        args.epochs * steps_per_epoch if args.max_steps is None else min(args.max_steps, args.epochs * steps_per_epoch)
    )
    warmup = min(total, round(args.warmup_epochs * steps_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total))
    trained = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    criterion = nn.CrossEntropyLoss()
    if args.record and rank == 0:
        Path(args.record).mkdir(parents=True, exist_ok=True)

    step, epochs = 0, []
    model.train()
    for epoch in range(args.epochs):
        if step == total:
            break
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        losses = []
        for index, (x, y) in enumerate(loader):
            loss = criterion(trained(x), y)
            (loss / args.accumulate).backward()
            losses.append(loss.item())
            if (index + 1) % args.accumulate:
                continue
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            if args.record and rank == 0 and step <= args.record_steps:
                torch.save({"lr": lr, "state": model.state_dict()}, Path(args.record) / f"step{step}.pt")
            if step == total:
                break
        train_loss = torch.tensor(sum(losses) / len(losses))
        if world > 1:
            dist.all_reduce(train_loss)
            train_loss /= world
        row = {"epoch": epoch, "step": step, "train_loss": train_loss.item()}
        if not args.no_eval and rank == 0:
            row["test_acc"], row["test_loss"] = evaluate(model, test)
            print(f"epoch {epoch}: train loss {row['train_loss']:.4f}, test top-1 {row['test_acc']:.4f}", flush=True)
        epochs.append(row)
    if args.out and rank == 0:
        best = max((row.get("test_acc", 0.0) for row in epochs), default=0.0)
        Path(args.out).write_text(json.dumps({"epochs": epochs, "best_acc": best}, indent=1))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
