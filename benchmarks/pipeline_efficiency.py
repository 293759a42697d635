"""Pipeline efficiency: a 2-process pipeline under each schedule against one process, and where the time goes.

    python benchmarks/pipeline_efficiency.py                      # every schedule, 4 and 8 micro-batches
    python benchmarks/pipeline_efficiency.py --schedules gpipe Interleaved1F1B --micro-batches 8 --rounds 3

For each number of micro-batches m it trains ResNet-50 (CIFAR stem) on synthetic 32x32
images, one thread per process, and measures side by side:

    accumulated   one process that accumulates the same m micro-batches (the same arithmetic)
    ceiling       two such processes at once, each on its own: what two processes reach on
                  this machine without a pipeline, over twice one (the shared memory bandwidth)
    <schedule>    the ``pipeline`` strategy over 2 processes (multi-stage schedules hold 2
                  stages per process), with efficiency = img/s / (2 x accumulated img/s)

next to the ideal m / (m + p - 1) of a balanced 2-process pipeline without communication.
For each schedule it also prints, per process and step, the seconds spent computing forward
and backward passes, posting sends and receives, waiting for them (the bubble and the other
process), and the rest (loss, optimizer, Lightning). Each run is a fresh process or set of
processes; the first ``--warmup`` steps are not timed. It runs ``--rounds`` rounds (5), every configuration
once per round in a rotated order, so that a slow period of the machine falls on all of them alike; each
efficiency is taken within its round (the pipeline against the accumulating process of the same round), and each
figure is the median of its rounds with the order-statistic interval of that median
(``multigpu.timing.intervals``; with 5 rounds the lowest and the highest, 15 times in 16); the clocks are those
of the median round. Writes ``<out>/pipeline_efficiency.json`` and a chart of efficiency against micro-batches,
one line per schedule with its intervals, to ``<out>/pipeline_efficiency.png``.
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
from machine import machine
from stage_clock import PARTS, StageClock
from torch.utils.data import DataLoader

from multigpu.data.synthetic import SyntheticCIFAR10
from multigpu.model.classifier import ImageClassifier
from multigpu.run.host_memory import keep_freed_memory
from multigpu.run.process_groups import end_process_groups
from multigpu.strategies import PipelineStrategy
from multigpu.strategies.pipeline.stage_placement import SCHEDULES, natural_stages_per_process
from multigpu.timing.intervals import median_interval
from multigpu.timing.step_timer import StepTimer

PROCESSES = 2


def worker(args: argparse.Namespace) -> None:
    """One configuration: trains and writes its images per second (rank 0) and, for a pipeline, its clocks."""
    keep_freed_memory()  # as main.py's processes do
    torch.set_num_threads(1)
    batch_size = args.batch_size // args.accumulate
    callbacks = [StepTimer(args.warmup, args.out)]
    if args.schedule:
        per_process = natural_stages_per_process(args.schedule)
        strategy, devices = (
            PipelineStrategy(micro_batches=args.micro_batches, schedule=args.schedule, stages_per_process=per_process),
            PROCESSES,
        )
        callbacks.append(StageClock(args.warmup, args.out))
    else:
        strategy, devices = "auto", 1
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.warmup + args.steps,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    model = ImageClassifier(batch_size=batch_size, stem=args.stem, warmup_epochs=0)
    batches = (args.warmup + args.steps) * args.accumulate
    trainer.fit(model, DataLoader(SyntheticCIFAR10(batch_size * batches), batch_size=batch_size))
    end_process_groups()


def _start(args: argparse.Namespace, out: Path, micro_batches: int, schedule: str = "", accumulate: int = 1):
    command = [
        sys.executable,
        __file__,
        "--worker",
        f"--micro-batches={micro_batches}",
        f"--accumulate={accumulate}",
        f"--schedule={schedule}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--stem={args.stem}",
        f"--out={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return command, subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(args: argparse.Namespace, micro_batches: int, schedule: str = "", accumulate: int = 1, copies: int = 1) -> dict:
    """Images per second (summed over ``copies`` independent runs at once) and, for a pipeline, each rank's clock."""
    with tempfile.TemporaryDirectory() as folder:
        outs = [Path(folder) / f"result{copy}.json" for copy in range(copies)]
        started = [_start(args, out, micro_batches, schedule, accumulate) for out in outs]
        for command, process in started:
            output = process.communicate()[0]
            if process.returncode:
                sys.exit(f"error: {' '.join(command)} failed:\n{output[-6000:]}")
        clocks = sorted(Path(folder).glob("result0.json.clock*"))
        return {
            "images_per_s": sum(json.loads(out.read_text())["images_per_s"] for out in outs),
            "clocks": [json.loads(clock.read_text()) for clock in clocks],
        }


def markdown(data: dict) -> str:
    """``pipeline_efficiency.json``'s table: each schedule's efficiency with its interval, beside the references."""
    args = data["args"]
    lines = [
        f"ResNet-50 ({args['stem']} stem), batch {args['batch_size']}, 1 thread per process, {args['warmup']} warm-up "
        f"+ {args['steps']} timed steps, {args['rounds']} rounds; each figure the median of its rounds, each interval "
        f"holds that median {data['results'][0]['interval_coverage']:.0%} of the time:",
        "",
        "| micro-batches | run | img/s | interval | efficiency | interval |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for m, accumulated in data["accumulated_images_per_s"].items():
        low, high = data["accumulated_intervals"][m]
        ceiling_low, ceiling_high = data["ceiling_intervals"][m]
        lines += [
            f"| {m} | one process accumulating them | {accumulated:.1f} | {low:.1f}-{high:.1f} | 1 | - |",
            f"| {m} | two such processes at once (the ceiling) | - | - | {data['ceilings'][m]:.3f} | "
            f"{ceiling_low:.3f}-{ceiling_high:.3f} |",
            f"| {m} | ideal pipeline, m / (m + 1) | - | - | {int(m) / (int(m) + PROCESSES - 1):.3f} | - |",
        ]
        for row in data["results"]:
            if str(row["micro_batches"]) == str(m):
                low, high = row["images_per_s_interval"]
                efficiency_low, efficiency_high = row["efficiency_interval"]
                lines.append(
                    f"| {m} | {row['schedule']} | {row['images_per_s']:.1f} | {low:.1f}-{high:.1f} | "
                    f"{row['efficiency']:.3f} | {efficiency_low:.3f}-{efficiency_high:.3f} |"
                )
    return "\n".join(lines) + "\n"


def write_chart(results: list[dict], ceilings: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    counts = sorted(ceilings)
    schedules = list(dict.fromkeys(row["schedule"] for row in results))
    # Each schedule a little to the side of its micro-batch count, so that intervals that overlap stay apart.
    gap = min((b - a for a, b in zip(counts, counts[1:])), default=1)
    step = 0.4 * gap / max(1, len(schedules))
    for index, schedule in enumerate(schedules):
        rows = sorted((row for row in results if row["schedule"] == schedule), key=lambda row: row["micro_batches"])
        shift = (index - (len(schedules) - 1) / 2) * step
        axes.errorbar(
            [row["micro_batches"] + shift for row in rows],
            [row["efficiency"] for row in rows],
            yerr=[
                [row["efficiency"] - row["efficiency_interval"][0] for row in rows],
                [row["efficiency_interval"][1] - row["efficiency"] for row in rows],
            ],
            marker="o",
            capsize=3,
            label=schedule,
        )
    axes.plot(counts, [m / (m + PROCESSES - 1) for m in counts], "k--", label="ideal m/(m+p-1)", marker="x")
    axes.plot(counts, [ceilings[m] for m in counts], "k:", label="two independent processes", marker="+")
    axes.set(
        xlabel="micro-batches",
        ylabel="efficiency vs 2 x one process accumulating",
        xticks=counts,
        xlim=(counts[0] - gap / 2, counts[-1] + gap / 2),
        title=f"{PROCESSES}-process pipeline, ResNet-50, CPU, 1 thread per process",
    )
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def measure(args: argparse.Namespace) -> dict[tuple[int, str], list[dict]]:
    """Every configuration once per round, the order rotated from round to round: for each number of micro-batches,
    one process accumulating them (``""``), two such processes at once (``"ceiling"``) and each schedule."""
    jobs = [(m, name) for m in args.micro_batches for name in ("", "ceiling", *args.schedules)]
    rounds: dict[tuple[int, str], list[dict]] = {job: [] for job in jobs}
    for index in range(args.rounds):
        shift = index * len(jobs) // args.rounds
        for m, name in jobs[shift:] + jobs[:shift]:
            if name in ("", "ceiling"):
                figures = run(args, m, accumulate=m, copies=PROCESSES if name else 1)
            else:
                figures = run(args, m, schedule=name)
            rounds[m, name].append(figures)
        done = ", ".join(f"{name or 'accumulated'} m{m} {rounds[m, name][-1]['images_per_s']:.1f}" for m, name in jobs)
        print(f"  round {index + 1} of {args.rounds} (img/s): {done}", flush=True)
    return rounds


def summary(rounds: list[dict], accumulated: list[float]) -> dict:
    """The median and interval of the images per second of ``rounds`` and of their efficiency, round by round
    against twice the accumulating process's; the clocks of the median round."""
    own = [figures["images_per_s"] for figures in rounds]
    throughput = median_interval(own)
    efficiency = median_interval([mine / (PROCESSES * theirs) for mine, theirs in zip(own, accumulated, strict=True)])
    median_round = sorted(range(len(own)), key=own.__getitem__)[(len(own) - 1) // 2]
    return {
        "images_per_s": throughput.median,
        "images_per_s_interval": [throughput.low, throughput.high],
        "efficiency": efficiency.median,
        "efficiency_interval": [efficiency.low, efficiency.high],
        "rounds_images_per_s": own,
        "interval_coverage": efficiency.coverage,
        "clocks": rounds[median_round]["clocks"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), type=str.lower, choices=SCHEDULES)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=5, help="runs of every configuration, interleaved")
    parser.add_argument("--stem", choices=["cifar", "imagenet"], default="cifar")
    parser.add_argument("--out", default=".", help="folder for pipeline_efficiency.json and .png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="", help=argparse.SUPPRESS)
    parser.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.micro_batches = args.micro_batches[0]
        worker(args)
        return
    for micro_batches in args.micro_batches:
        if args.batch_size % micro_batches:
            sys.exit(f"error: --batch-size {args.batch_size} is not divisible by {micro_batches} micro-batches.")
    if args.rounds < 1:
        sys.exit("error: --rounds must be at least 1.")
    print(
        f"ResNet-50 ({args.stem} stem), 32x32 synthetic images, batch {args.batch_size}, CPU, 1 thread per process, "
        f"{args.warmup} warm-up + {args.steps} timed steps, {PROCESSES} processes, {args.rounds} rounds",
        flush=True,
    )
    rounds = measure(args)
    results, ceilings, ceiling_intervals, references, reference_intervals = [], {}, {}, {}, {}
    for m in args.micro_batches:
        accumulated = [figures["images_per_s"] for figures in rounds[m, ""]]
        reference = median_interval(accumulated)
        ceiling = summary(rounds[m, "ceiling"], accumulated)
        references[m], ceilings[m] = reference.median, ceiling["efficiency"]
        reference_intervals[m] = [reference.low, reference.high]
        ceiling_intervals[m] = ceiling["efficiency_interval"]
        print(
            f"\n{m} micro-batches of {args.batch_size // m}: one process accumulating them "
            f"{reference.median:.1f} img/s [{reference.low:.1f}, {reference.high:.1f}]; "
            f"two at once {ceiling['efficiency']:.2f} "
            f"[{ceiling_intervals[m][0]:.2f}, {ceiling_intervals[m][1]:.2f}] of twice that (the ceiling); "
            f"ideal pipeline {m / (m + PROCESSES - 1):.2f}"
        )
        print(
            f"{'schedule':>22}  {'img/s':>6}  {'efficiency':>10}  {'interval':>12}  {'rank':>4}  "
            + "  ".join(f"{part:>9}" for part in (*PARTS, "other"))
            + "   (s per step, median round)"
        )
        for schedule in args.schedules:
            row = {"schedule": schedule, "micro_batches": m, **summary(rounds[m, schedule], accumulated)}
            results.append(row)
            low, high = row["efficiency_interval"]
            for rank, clock in enumerate(row["clocks"]):
                lead = (
                    f"{schedule:>22}  {row['images_per_s']:>6.1f}  {row['efficiency']:>10.2f}  "
                    f"{f'[{low:.2f}, {high:.2f}]':>12}"
                    if rank == 0
                    else " " * 56
                )
                print(
                    f"{lead}  {rank:>4}  " + "  ".join(f"{clock[part]:>9.2f}" for part in (*PARTS, "other")), flush=True
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_efficiency.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "args": vars(args),
                "accumulated_images_per_s": references,
                "accumulated_intervals": reference_intervals,
                "ceilings": ceilings,
                "ceiling_intervals": ceiling_intervals,
                "results": results,
            },
            indent=1,
        )
    )
    write_chart(results, ceilings, out / "pipeline_efficiency.png")
    print(f"\nwrote {out / 'pipeline_efficiency.json'} and {out / 'pipeline_efficiency.png'}")


if __name__ == "__main__":
    main()
