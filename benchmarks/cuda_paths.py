"""Every CUDA path of the application on one GPU: does it train, how fast, and in how much memory.

    python benchmarks/cuda_paths.py                          # every path below, 3 rounds
    python benchmarks/cuda_paths.py --paths app fast fsdp --rounds 5

Each path is one of ``benchmarks/throughput.py``'s configurations and runs the same way: ``main.py fit`` (or the
plain loop) on synthetic CIFAR-sized images in fresh processes, warm-up steps then timed ones, the paths
interleaved in rounds, each figure the median of its rounds with its interval. Two things differ, because a GPU
is often lent for minutes: a path that fails is kept in the table with the last line of its output, and left out
of the later rounds; and ``cuda_paths.json`` is written again after every round, so that a run stopped early
keeps the rounds it finished. ``ddp`` and ``fsdp`` run one process (NCCL with one rank): their efficiency is their
speed over the one-process application's.
"""

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import throughput
from machine import machine

from multigpu.planning.timed_runs import RunFailed, run

HERE = Path(__file__).resolve().parent
PATHS = ["plain", "app", "app-16", "plain-fast", "fast", "fast-compiled", "ddp", "fsdp"]
# What each path checks, in the guide's words, for the table.
CHECKS = {
    "plain": "the reference: a plain PyTorch loop, float32",
    "app": "float32",
    "app-16": "16-mixed",
    "plain-fast": "the reference for bf16: a plain loop, bf16 + channels_last",
    "fast": "bf16-mixed + channels_last",
    "fast-compiled": "bf16-mixed + channels_last + torch.compile",
    "fast-on-device": "configs/fast.yaml (+ the data on the GPU)",
    "ddp": "ddp, NCCL with one rank",
    "fsdp": "fsdp (FSDP2), NCCL with one rank",
    "dp": "DataParallel, one GPU",
}


def last_line(log: Path) -> str:
    """The last line a failed run printed, the line that says why."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def measure(names: list[str], args: argparse.Namespace, write: Callable[[list[dict]], None]) -> list[dict]:
    """Every path once per round, orders rotated; a failing path is dropped with its reason. ``write`` gets the
    rows after every round."""
    table = throughput.configs(args.processes)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, str] = {}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            folder = Path(tmp) / f"round{round_index}"
            folder.mkdir()
            live = [name for name in names if name not in failed]
            shift = round_index % max(1, len(live))
            for name in live[shift:] + live[:shift]:
                out, log = folder / f"{name}.json", folder / f"{name}.log"
                try:
                    runs[name].append(
                        run(throughput.command(table[name], args, folder), out, log, cwd=HERE.parent, pythonpath=[HERE])
                    )
                except RunFailed:
                    failed[name] = last_line(log)
                    del runs[name]
                    print(f"  {name} failed: {failed[name]}", flush=True)
            print(
                f"  round {round_index + 1} of {args.rounds} (img/s): "
                + ", ".join(f"{name} {runs[name][-1]['images_per_s']:.1f}" for name in runs),
                flush=True,
            )
            rows = [
                {"name": name, "check": CHECKS.get(name, table[name].description), "rounds": round_index + 1}
                | ({"error": failed[name]} if name in failed else throughput.summary(name, table, runs, args.processes))
                for name in names
            ]
            write(rows)
    return rows


def markdown(data: dict) -> str:
    """``cuda_paths.json``'s table for docs/speed.md: each path, whether it trained, its figures with intervals
    (none where only one round finished)."""
    settings = data["settings"]
    finished = min(row["rounds"] for row in data["results"])

    def figure(value: float, interval: list[float], digits: int) -> str:
        spread = "" if finished == 1 else f" ({interval[0]:,.{digits}f}-{interval[1]:,.{digits}f})"
        return f"{value:,.{digits}f}{spread}"

    def ratio(row: dict, name: str) -> str:
        return "-" if row.get(name) is None else figure(row[name], row[f"{name}_interval"], 3)

    spread = (
        "one run of each path, so no interval"
        if finished == 1
        else "each figure the median of its rounds, with the interval of its rounds in brackets"
    )
    lines = [
        f"ResNet-50 ({settings['stem']} stem) on synthetic CIFAR-sized images, batch {settings['batch_size']}, "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps, {finished} of {settings['rounds']} rounds; "
        f"{spread}:",
        "",
        "| path | checks | trains | img/s | vs plain | ddp, fsdp: vs app | step ms | peak MiB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in data["results"]:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['check']} | **no**: {row['error']} | - | - | - | - | - |")
            continue
        memory = "/".join(f"{value / 2**20:,.0f}" for value in row["peak_memory_bytes"])
        lines.append(
            f"| {row['name']} | {row['check']} | yes | {figure(row['images_per_s'], row['images_per_s_interval'], 0)} "
            f"| {ratio(row, 'vs_plain')} | {ratio(row, 'efficiency')} | {row['step_time_s'] * 1000:,.1f} | {memory} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", default=PATHS, help=f"configurations to run (default: {PATHS})")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every path, interleaved")
    throughput.add_run_options(parser)
    args = parser.parse_args()
    device = throughput.where(args)
    if not args.cuda and args.accelerator == "auto":
        sys.exit(
            "error: no CUDA device is visible; cuda_paths.py measures the GPU paths (on the CPU: --accelerator cpu)."
        )
    args.processes = 1
    table = throughput.configs(args.processes)
    if unknown := [name for name in args.paths if name not in table]:
        sys.exit(f"error: unknown path {unknown[0]!r}; benchmarks/throughput.py --list shows them all.")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    where_it_ran = machine(device)
    path = args.out / "cuda_paths.json"

    def write(rows: list[dict]) -> None:
        path.write_text(json.dumps({"machine": where_it_ran, "settings": settings, "results": rows}, indent=2))

    print(f"{device}: {', '.join(args.paths)}; {args.rounds} rounds", flush=True)
    measure(args.paths, args, write)
    print(markdown(json.loads(path.read_text())))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
