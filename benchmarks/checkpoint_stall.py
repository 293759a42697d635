"""How much a checkpoint after every step costs a run, written in the background and in the foreground.

    python benchmarks/checkpoint_stall.py                 # 5 rounds, ~15 minutes on 2 cores
    python benchmarks/checkpoint_stall.py --rounds 3 --arch resnet18

Each round runs, in turn, the same two epochs of ``configs/smoke.yaml`` with ``--data.synthetic_size=64`` (8 steps an
epoch) and ResNet-50 through ``main.py fit``, three ways: ``--save_every_n_steps=1`` with the writes in the background
(the default), the same with ``--save_in_background=false``, and ``--save_every_n_steps=0``. For each it records:

    wall s       the command's wall time, start-up and validation included, as a user times it
    vs none      the wall time over the same round's run without saves (the ratio the issue bounds at 1.25)
    held ms      how long each save held the training thread: the copy to host memory (and a wait for the
                 write before, if one was still in flight); in the foreground, the whole write
    peak MiB     the process's peak resident memory (``wait4``'s ``ru_maxrss``)

Medians with their intervals over the rounds (``multigpu.timing.intervals``); the figures go to
``<out>/checkpoint_stall.json``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine
from typing_extensions import override

from multigpu.checkpointing.checkpoint_io import AtomicCheckpointIO
from multigpu.timing.intervals import median_interval

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WAYS = {  # name: (save_every_n_steps, in the background)
    "background": (1, True),
    "foreground": (1, False),
    "none": (0, True),
}


class HeldRecorder(AtomicCheckpointIO):
    """``AtomicCheckpointIO`` that records how long each save held the training thread, into ``out`` at the end."""

    def __init__(self, out: str, background: bool = True) -> None:
        super().__init__(background)
        self.out, self.held = Path(out), []

    @override
    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        start = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.held.append(time.perf_counter() - start)

    @override
    def teardown(self) -> None:
        super().teardown()
        self.out.write_text(json.dumps(self.held))


def run_once(way: str, args: argparse.Namespace, folder: Path, index: int) -> dict:
    """One run of ``way``: its wall time, the hold of each save and its peak resident memory."""
    every, background = WAYS[way]
    held = folder / f"held-{way}-{index}.json"
    plugin = folder / f"plugin-{way}-{index}.yaml"
    plugin.write_text(
        "trainer:\n  plugins:\n    - class_path: checkpoint_stall.HeldRecorder\n"
        f"      init_args:\n        out: {held}\n        background: {str(background).lower()}\n"
    )
    command = [
        sys.executable,
        str(REPO / "main.py"),
        "fit",
        "--config",
        str(REPO / "configs" / "smoke.yaml"),
        "--config",
        str(plugin),
        f"--data.synthetic_size={args.synthetic_size}",
        f"--model.arch={args.arch}",
        f"--trainer.max_epochs={args.epochs}",
        f"--save_every_n_steps={every}",
        f"--run_name={way}-{index}",
        f"--checkpoint_root={folder / 'checkpoints'}",
        f"--trainer.default_root_dir={folder / 'logs'}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    with open(folder / f"{way}-{index}.log", "w") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        tail = (folder / f"{way}-{index}.log").read_text()[-3000:]
        raise SystemExit(f"{way} failed ({process.returncode}):\n{tail}")
    return {"wall_s": wall, "held_s": json.loads(held.read_text()), "peak_bytes": usage.ru_maxrss * 1024}


def summary(runs: dict[str, list[dict]]) -> list[dict]:
    """Each way's medians and intervals over the rounds; its wall time over the same round's run without saves."""
    rows = []
    for way, results in runs.items():
        walls = [result["wall_s"] for result in results]
        ratios = [result["wall_s"] / none["wall_s"] for result, none in zip(results, runs["none"])]
        holds = [statistics.median(result["held_s"]) for result in results if result["held_s"]]
        peaks = [result["peak_bytes"] / 2**20 for result in results]
        row = {"way": way, "saves": len(results[0]["held_s"])}
        for name, values in (("wall_s", walls), ("vs_none", ratios), ("held_s", holds), ("peak_mib", peaks)):
            if values:
                interval = median_interval(values)
                row[name] = [interval.median, interval.low, interval.high]
        rows.append(row)
    return rows


def markdown(data: dict) -> str:
    """The table docs/fault-tolerance.md shows."""
    lines = [
        "| writes | saves | wall s | vs none | held ms per save | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        wall, ratio, peak = row["wall_s"], row["vs_none"], row["peak_mib"]
        held = row.get("held_s")
        held_text = f"{held[0] * 1000:.0f} ({held[1] * 1000:.0f}-{held[2] * 1000:.0f})" if held else "-"
        lines.append(
            f"| {row['way']} | {row['saves']} | {wall[0]:.1f} ({wall[1]:.1f}-{wall[2]:.1f}) | "
            f"{ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f}) | {held_text} | "
            f"{peak[0]:.0f} ({peak[1]:.0f}-{peak[2]:.0f}) |"
        )
    lines.append("")
    lines.append(
        f"{data['arch']}, {data['rounds']} rounds: medians, and in brackets the interval of the rounds that holds the "
        f"median {data['coverage']:.0%} of the time."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--synthetic-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="checkpoint-stall-") as tmp:
        for index in range(args.rounds):
            for way in WAYS:
                runs[way].append(run_once(way, args, Path(tmp), index))
                print(f"round {index + 1}/{args.rounds} {way}: {runs[way][-1]['wall_s']:.1f} s", flush=True)
    data = {
        "machine": machine(),
        "rounds": args.rounds,
        "arch": args.arch,
        "coverage": median_interval([0.0] * args.rounds).coverage,
        "rows": summary(runs),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_stall.json").write_text(json.dumps(data, indent=1))
    print(markdown(data))


if __name__ == "__main__":
    main()
