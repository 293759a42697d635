"""Pipeline efficiency: a 2-stage pipeline against one process, on the CPU, one thread per process.

    python benchmarks/pipeline_efficiency.py                       # ResNet-50, micro-batches 1 2 4 8
    python benchmarks/pipeline_efficiency.py --batch-size 64 --steps 2

For each number of micro-batches m it trains ResNet-50 (CIFAR stem) on synthetic
32x32 images with the ``pipeline`` strategy over 2 processes, and prints

    efficiency = pipeline throughput / (stages x single-process throughput)

next to the ideal m / (m + stages - 1) of a balanced pipeline without communication.
The single process trains on the whole batch; a second column compares with one
process that accumulates the same micro-batches (the same arithmetic, and on a CPU
often a faster one per image, as small batches stay in cache). Each configuration
runs in fresh processes with one thread each; the first ``--warmup`` steps are not timed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from multigpu.datasets import SyntheticCIFAR10
from multigpu.model import ResNet50Classifier
from multigpu.strategies import PipelineStrategy
from step_timer import StepTimer

STAGES = 2


def worker(args: argparse.Namespace) -> None:
    """One configuration: trains and writes its images per second (rank 0) to ``args.out``."""
    torch.set_num_threads(1)
    batch_size = args.batch_size // args.accumulate
    batches = (args.warmup + args.steps) * args.accumulate
    if args.micro_batches:
        strategy, devices = PipelineStrategy(micro_batches=args.micro_batches, schedule=args.schedule), STAGES
    else:
        strategy, devices = "auto", 1
    timer = StepTimer(args.warmup, args.out)
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.warmup + args.steps,
        accumulate_grad_batches=args.accumulate, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    model = ResNet50Classifier(batch_size=batch_size, stem=args.stem, warmup_epochs=0)
    trainer.fit(model, DataLoader(SyntheticCIFAR10(batch_size * batches), batch_size=batch_size))


def run(args: argparse.Namespace, micro_batches: int = 0, accumulate: int = 1) -> float:
    """Images per second of one configuration, measured in fresh processes."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [
            sys.executable, __file__, "--worker", f"--micro-batches={micro_batches}", f"--accumulate={accumulate}",
            f"--schedule={args.schedule}", f"--batch-size={args.batch_size}", f"--steps={args.steps}",
            f"--warmup={args.warmup}", f"--stem={args.stem}", f"--out={out}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"error: {' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
        return json.loads(out.read_text())["images_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.micro_batches = args.micro_batches[0] if args.micro_batches else 0
        worker(args)
        return
    for micro_batches in args.micro_batches:
        if args.batch_size % micro_batches:
            sys.exit(f"error: --batch-size {args.batch_size} is not divisible by {micro_batches} micro-batches.")
    print(f"ResNet-50 ({args.stem} stem), 32x32 synthetic images, batch {args.batch_size}, CPU, 1 thread per process, "
          f"{args.warmup} warm-up + {args.steps} timed steps, schedule {args.schedule}")
    single = run(args)
    print(f"one process, whole batch: {single:.1f} img/s\n")
    print(f"{'micro-batches':>13}  {'img/s':>6}  {'efficiency':>10}  {'vs same micro-batches':>21}  {'ideal':>5}")
    for micro_batches in args.micro_batches:
        throughput = run(args, micro_batches=micro_batches)
        accumulated = run(args, accumulate=micro_batches) if micro_batches > 1 else single
        ideal = micro_batches / (micro_batches + STAGES - 1)
        print(
            f"{micro_batches:>13}  {throughput:>6.1f}  {throughput / (STAGES * single):>10.2f}  "
            f"{throughput / (STAGES * accumulated):>21.2f}  {ideal:>5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
