"""The reference: the training loop the plain PyTorch recipes write by hand, one process.

    python benchmarks/plain_loop.py --batch-size 32 --steps 5 --out plain.json

Forward, loss, backward, SGD step, on the application's network (``multigpu.model.resnet``),
with the same optimizer settings as the recipe. ``--data synthetic`` trains on random
batches made on the device beforehand; ``--data torchvision`` reads random uint8 images
through a DataLoader with torchvision's augmentations on the CPU, as the recipes do.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from multigpu.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from multigpu.data.transforms import ImageTensorDataset, train_transform
from multigpu.model.architectures import DEFAULT_ARCH, network_blocks
from multigpu.model.lazy_blocks import LazyBlocks
from multigpu.model.resnet import resnet50_blocks
from multigpu.run.device_sync import synchronize
from multigpu.run.host_memory import keep_freed_memory
from multigpu.timing.step_timer import peak_memory_bytes, result


def batches(data: str, batch_size: int, count: int, device: torch.device, workers: int):
    """``count`` training batches of CIFAR-sized images on ``device``."""
    generator = torch.Generator().manual_seed(0)
    if data == "synthetic":
        pool = [
            (
                torch.randn(batch_size, 3, 32, 32, generator=generator).to(device),
                torch.randint(10, (batch_size,), generator=generator).to(device),
            )
            for _ in range(min(count, 4))
        ]
        yield from (pool[i % len(pool)] for i in range(count))
        return
    images = torch.randint(256, (batch_size * count, 3, 32, 32), dtype=torch.uint8, generator=generator)
    labels = torch.randint(10, (batch_size * count,), generator=generator)
    loader = DataLoader(
        ImageTensorDataset(images, labels, train_transform(CIFAR10_MEAN, CIFAR10_STD)),
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
    )
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--data", choices=["synthetic", "torchvision"], default="synthetic")
    parser.add_argument("--workers", type=int, default=4, help="loader workers with --data torchvision")
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help="the network, as the app's --model.arch names it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", required=True, help="JSON file for the figures")
    args = parser.parse_args()

    keep_freed_memory()  # as main.py does: a process setting, not part of the recipe
    device = torch.device(args.device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.arch == DEFAULT_ARCH:
        model = resnet50_blocks(10, args.stem)
    else:  # the app's blocks of another network, chained
        model = LazyBlocks(network_blocks(args.arch, 10, args.stem), seed=0)
        model.materialize()
    model = model.to(device, memory_format=memory_format)
    criterion = nn.CrossEntropyLoss()
    # Fused on CUDA, as the application's (multigpu.model.classifier): like with like.
    fused = device.type == "cuda" or None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=fused)
    bf16 = args.precision == "bf16-mixed"
    model.train()
    start = 0.0
    for step, (x, y) in enumerate(batches(args.data, args.batch_size, args.warmup + args.steps, device, args.workers)):
        if step == args.warmup:
            synchronize(device)
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = criterion(model(x.contiguous(memory_format=memory_format)), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    synchronize(device)
    seconds = time.perf_counter() - start
    figures = result(args.batch_size * args.steps, args.steps, seconds, [peak_memory_bytes(device)])
    Path(args.out).write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
