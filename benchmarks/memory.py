"""Memory of each way to split ResNet-50: what each process and each stage holds, and each process's peak.

    python benchmarks/memory.py                    # every layout below, ~20 minutes on 2 cores
    python benchmarks/memory.py --layouts one-device pipeline-2

Each layout trains ``--steps`` optimizer steps of ResNet-50 on synthetic CIFAR-sized images
at the recipe's batch (128 per process) through ``main.py fit``, without and with
``--model.recompute_activations``. Model parallel and pipeline split by parameter count
(``balance_by: params``), save the ``-time`` layouts, which split by measured time. The table
shows, for each stage:

    params / grads / optimizer   MiB of parameters, gradients and SGD momentum it holds, counted
                                 from the tensors before the last step's optimizer step
    held                         their sum
    vs ddp                       held over what one ddp process holds (the whole network's)
    peak MiB                     the process's peak memory (CUDA: allocated; CPU: resident, which
                                 includes Python, torch and the data), once per process; on the
                                 CPU with glibc's own allocator (MULTIGPU_KEEP_FREED_MEMORY=0)

and writes the figures to ``<out>/memory.json``. Launching and reading the runs is
``throughput.py``'s; the counting is ``held_bytes.HeldBytes``.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from machine import machine
from throughput import HERE, REPO, add_run_options, fit_command, network_name, where

from multigpu.timing.timed_runs import RunFailed, launch

PARAMS = "--trainer.strategy.balance_by=params"
LAYOUTS = {
    "one-device": (1, []),
    "ddp-2": (2, ["--trainer.strategy=ddp", "--trainer.devices=2"]),
    "fsdp-2": (2, ["--trainer.strategy=fsdp", "--trainer.devices=2"]),
    "fsdp-4": (4, ["--trainer.strategy=fsdp", "--trainer.devices=4"]),
    "model-parallel-2": (1, ["--trainer.strategy=manual_model_parallel", "--trainer.devices=2", PARAMS]),
    "model-parallel-4": (1, ["--trainer.strategy=manual_model_parallel", "--trainer.devices=4", PARAMS]),
    "pipeline-2": (2, ["--trainer.strategy=pipeline", "--trainer.devices=2", PARAMS]),
    "pipeline-4": (4, ["--trainer.strategy=pipeline", "--trainer.devices=4", PARAMS]),
    "pipeline-2-time": (2, ["--trainer.strategy=pipeline", "--trainer.devices=2"]),
    "pipeline-4-time": (4, ["--trainer.strategy=pipeline", "--trainer.devices=4"]),
}
RECOMPUTED = ["--model.recompute_activations=true"]
MIB = 2**20


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for layout in args.layouts:
            processes, options = LAYOUTS[layout]
            for recomputed in {"both": (False, True), "no": (False,), "yes": (True,)}[args.recompute]:
                name = layout + ("+recompute" if recomputed else "")
                out = folder / f"{name}.json"
                extra = [*options, *(RECOMPUTED if recomputed else [])]
                callbacks = ["--trainer.callbacks+=held_bytes.HeldBytes", f"--trainer.callbacks.out={out}"]
                command = fit_command(name, folder, args, args.steps, processes, args.precision, extra, callbacks)
                try:
                    ranks = launch(
                        command, out, folder / f"{name}.log", None if args.cuda else args.threads, [HERE], REPO
                    )
                except RunFailed as failure:
                    sys.exit(f"error: {failure}")
                rows.append({"layout": layout, "recomputed": recomputed, "ranks": ranks})
                peaks = "/".join(f"{rank['peak'] / MIB:.0f}" for rank in ranks)
                print(f"  {name}: peak {peaks} MiB", flush=True)
    return rows


def markdown(data: dict) -> str:
    """``memory.json``'s table: what each stage holds (counted, the same in every run) and each process's peak."""
    rows = data["results"]
    whole = next((row for row in rows if row["layout"] in ("ddp-2", "one-device")), None)
    reference = sum(whole["ranks"][0]["stages"][0][key] for key in ("params", "grads", "optimizer")) if whole else None
    lines = [
        "| layout | recompute | rank | stage blocks | params MiB | grads MiB | optimizer MiB | held MiB | vs ddp "
        "| peak MiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for rank in row["ranks"]:
            for index, stage in enumerate(rank["stages"]):
                held = stage["params"] + stage["grads"] + stage["optimizer"]
                ratio = f"{held / reference:.3f}" if reference else "-"
                peak = f"{rank['peak'] / MIB:,.0f}" if index == 0 else ""
                lines.append(
                    f"| {row['layout']} | {'yes' if row['recomputed'] else 'no'} | {rank['rank']} | "
                    f"{stage['blocks']} | {stage['params'] / MIB:.1f} | {stage['grads'] / MIB:.1f} | "
                    f"{stage['optimizer'] / MIB:.1f} | {held / MIB:.1f} | {ratio} | {peak} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batch-size", type=int, default=128, help="per process (the recipe's)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps; counted before the last one's update")
    parser.add_argument(
        "--recompute",
        "--checkpointing",  # its old name
        choices=["both", "no", "yes"],
        default="both",
        help="each layout without and with activation recomputation, or one of them (--checkpointing: deprecated)",
    )
    add_run_options(parser)
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("error: --steps must be at least 2: the optimizer state exists from the first step on.")
    device = where(args)
    # What the strategies hold, in memory glibc hands back when freed: main.py's runs keep it on the CPU
    # (docs/speed.md), up to 43% more at this batch, and 4 such processes would not fit a 24 GB machine.
    os.environ["MULTIGPU_KEEP_FREED_MEMORY"] = "0"
    title = f"{network_name(args.arch, args.stem)}, batch {args.batch_size} per process, {args.precision}, {device}"
    print(title, flush=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    data = {"machine": machine(device), "settings": settings, "results": measure(args)}
    print("\n" + markdown(data))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(data, indent=2))
    print(f"\nwrote {args.out / 'memory.json'}")


if __name__ == "__main__":
    main()
