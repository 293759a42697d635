"""Every CUDA path of the application on one GPU: does it run, how fast, and in how much memory.

    python benchmarks/cuda_paths.py                          # every path below, 3 rounds
    python benchmarks/cuda_paths.py --paths app fast fsdp --rounds 5

Each path is one of ``benchmarks/throughput.py``'s configurations and runs the same way (``throughput.measure``):
``main.py fit`` (or the plain loop) on synthetic CIFAR-sized images in fresh processes, warm-up steps then timed
ones, the paths interleaved in rounds, each figure the median of its rounds with its interval. Two things differ,
because a GPU is often lent for minutes: a path that fails (or runs past ``--timeout-s``) is kept in the table with
the round and the line that say why, and left out of the later rounds; and ``cuda_paths.json`` is written again
after every round, so that a run stopped early keeps the rounds it finished. ``ddp`` and ``fsdp`` run one process
(NCCL with one rank): their efficiency is their speed over the one-process application's.
"""

import argparse
import json
import sys
from pathlib import Path

import throughput
from machine import machine

PATHS = ["plain", "app", "app-16", "plain-fast", "fast", "fast-compiled", "ddp", "fsdp"]


def markdown(data: dict) -> str:
    """``cuda_paths.json``'s table for docs/speed.md: each path, whether it ran, its figures with their intervals
    (none where only one round finished)."""
    settings, finished = data["settings"], data["rounds_finished"]
    measured = [row for row in data["results"] if "error" not in row]

    def figure(value: float, interval: list[float], digits: int) -> str:
        spread = "" if finished == 1 else f" ({interval[0]:,.{digits}f}-{interval[1]:,.{digits}f})"
        return f"{value:,.{digits}f}{spread}"

    def ratio(row: dict, name: str) -> str:
        return "-" if row[name] is None else figure(row[name], row[f"{name}_interval"], 3)

    spread = (
        "one run of each path, so no interval"
        if finished == 1 or not measured
        else f"each figure the median of its rounds; in brackets the rounds' interval, which holds that median "
        f"{measured[0]['interval_coverage']:.0%} of the time"
    )
    lines = [
        f"ResNet-50 ({settings['stem']} stem) on synthetic CIFAR-sized images, batch {settings['batch_size']}, "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps, {finished} of {settings['rounds']} rounds; "
        f"{spread}:",
        "",
        "| path | runs | img/s | vs its plain loop | ddp, fsdp: vs app | step ms | peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in data["results"]:
        if "error" in row:
            failed = f"**no**, round {row['failed_in_round']}: {row['error']}"
            lines.append(f"| {row['name']}: {row['description']} | {failed} | - | - | - | - | - |")
            continue
        memory = "/".join(f"{value / 2**20:,.0f}" for value in row["peak_memory_bytes"])
        lines.append(
            f"| {row['name']}: {row['description']} | yes | "
            f"{figure(row['images_per_s'], row['images_per_s_interval'], 0)} | {ratio(row, 'vs_plain')} | "
            f"{ratio(row, 'efficiency')} | {row['step_time_s'] * 1000:,.1f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=PATHS, help=f"configurations to run (default: {PATHS})")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    throughput.add_round_options(parser, 3)
    throughput.add_run_options(parser)
    args = parser.parse_args()
    device = throughput.where(args)
    if not args.cuda and args.accelerator == "auto":
        sys.exit(
            "error: no CUDA device is visible; cuda_paths.py measures the GPU paths (on the CPU: --accelerator cpu)."
        )
    throughput.check_rounds(args)
    args.processes = 1
    table = throughput.configs(args.processes)
    if unknown := [name for name in args.paths if name not in table]:
        sys.exit(f"error: unknown path {unknown[0]!r}; benchmarks/throughput.py --list shows them all.")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    where_it_ran = machine(device)
    path = args.out / "cuda_paths.json"

    def write(rows: list[dict], finished: int) -> None:
        data = {"machine": where_it_ran, "settings": settings, "rounds_finished": finished, "results": rows}
        path.write_text(json.dumps(data, indent=2))

    print(f"{device}: {', '.join(args.paths)}; {args.rounds} rounds", flush=True)
    throughput.measure(args.paths, args, keep_going=True, after_round=write)
    print(markdown(json.loads(path.read_text())))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
